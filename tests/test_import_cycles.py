"""No import cycles between the packages of rlworkers, nor between the modules of flows, and rlworkers never imports
flows (read from the source, nothing is imported; imports inside functions count too).

A unit is a top-level module or subpackage (``rlworkers.data``, ``rlworkers.storage``, ``flows.runtime``...); a
cycle is two units that import each other, directly or through others.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rlworkers", "flows")
KNOWN_CYCLES: list[set[str]] = []


def unit_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for file in (path for package in PACKAGES for path in (ROOT / package).rglob("*.py")):
        module = ".".join(file.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        source = unit_of(module)
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in PACKAGES:
                targets = [f"{node.module}.{alias.name}" for alias in node.names]  # from flows import lineage
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module]
            else:
                continue
            for target in targets:
                if target.startswith(tuple(f"{p}." for p in PACKAGES)) and unit_of(target) != source:
                    graph.setdefault(source, set()).add(unit_of(target))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Groups of units that all reach each other (strongly connected, more than one unit)."""

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reach = {unit: reachable(unit) for unit in graph}
    groups = []
    for unit in sorted(graph):
        group = {unit} | {other for other in reach[unit] if unit in reach.get(other, ())}
        if len(group) > 1 and group not in groups:
            groups.append(group)
    return groups


def test_cycle_finder_by_hand():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_rlworkers_and_flows_have_no_import_cycles():
    graph = import_graph()
    assert "rlworkers.data" in graph["rlworkers.workers"]  # the graph is read: the rollout uses a data helper
    assert "flows.lineage" in graph["flows.runtime"]  # ... and `from flows import lineage` counts
    unexpected = [group for group in cycles(graph) if group not in KNOWN_CYCLES]
    assert not unexpected, f"import cycles between {unexpected}: move the shared helper into the lower module"


def test_rlworkers_never_imports_flows():
    """rlworkers (the engine: workers, single controller, algorithms) knows nothing of Prefect flows."""
    upward = {unit: sorted(t for t in targets if t.startswith("flows")) for unit, targets in import_graph().items()}
    assert not {unit: t for unit, t in upward.items() if unit.startswith("rlworkers") and t}
