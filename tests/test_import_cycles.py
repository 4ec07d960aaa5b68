"""No import cycles between the packages of rlworkers (read from the source, nothing is imported).

A unit is a top-level module or subpackage of rlworkers (``rlworkers.data``, ``rlworkers.storage``...); a cycle is
two units that import each other, directly or through others.
"""

from __future__ import annotations

import ast
from pathlib import Path

RLWORKERS = Path(__file__).resolve().parents[1] / "rlworkers"
KNOWN_CYCLES: list[set[str]] = []


def unit_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for file in RLWORKERS.rglob("*.py"):
        module = ".".join(file.relative_to(RLWORKERS.parent).with_suffix("").parts).removesuffix(".__init__")
        source = unit_of(module)
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module]
            else:
                continue
            for target in targets:
                if target.startswith("rlworkers.") and unit_of(target) != source:
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


def test_rlworkers_has_no_import_cycles():
    graph = import_graph()
    assert "rlworkers.data" in graph["rlworkers.workers"]  # the graph is read: the rollout uses a data helper
    unexpected = [group for group in cycles(graph) if group not in KNOWN_CYCLES]
    assert not unexpected, f"import cycles between {unexpected}: move the shared helper into the lower package"
