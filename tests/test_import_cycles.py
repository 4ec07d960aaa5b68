"""No import cycles between the packages of rlworkers, nor between the modules of flows, and rlworkers never imports
flows (read from the source, nothing is imported; imports inside functions count too).

A unit is a top-level module or subpackage (``rlworkers.data``, ``rlworkers.storage``, ``flows.controller.runtime``...);
a cycle is two units that import each other, directly or through others.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rlworkers", "flows")
KNOWN_CYCLES: list[set[str]] = []


def unit_of(module: str) -> str:
    """rlworkers' subpackages are its units; every module of flows is one (its rooms are packages of modules)."""
    return module if module.startswith("flows") else ".".join(module.split(".")[:2])


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for file in (path for package in PACKAGES for path in (ROOT / package).rglob("*.py")):
        module = ".".join(file.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        source = unit_of(module)
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from flows.lineages import lineage` imports the module flows.lineages.lineage
                named = [f"{node.module}.{alias.name}" for alias in node.names]
                targets = [name if is_module(name) else node.module for name in named]
            else:
                continue
            for target in targets:
                if target.startswith(PACKAGES) and unit_of(target) != source:
                    graph.setdefault(source, set()).add(unit_of(target))
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The units ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Groups of units that all reach each other (strongly connected, more than one unit)."""
    reach = {unit: reachable(graph, unit) for unit in graph}
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
    assert (
        "flows.controller.run_checkpoints" in graph["flows.controller.runtime"]
    )  # ... and `from flows.controller import run_checkpoints` counts
    unexpected = [group for group in cycles(graph) if group not in KNOWN_CYCLES]
    assert not unexpected, f"import cycles between {unexpected}: move the shared helper into the lower module"


def test_rlworkers_never_imports_flows():
    """rlworkers (the engine: workers, single controller, algorithms) knows nothing of Prefect flows."""
    upward = {unit: sorted(t for t in targets if t.startswith("flows")) for unit, targets in import_graph().items()}
    assert not {unit: t for unit, t in upward.items() if unit.startswith("rlworkers") and t}


def test_the_loops_collaborators_take_a_typed_run_state_and_never_reach_the_loop():
    """flows/controller/runtime.py's ``Run`` (the loop) calls checkpoints, recovery, evaluation, publishing and
    promotion with its state: each declares that parameter as ``RunState`` (flows/controller/run_state.py, which imports
    none of them), so no import cycle hides behind an untyped ``run``."""
    untyped = [
        f"{file.relative_to(ROOT)}:{node.lineno} {node.name}"
        for file in (ROOT / "flows").rglob("*.py")
        for node in ast.walk(ast.parse(file.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        if arg.arg == "run" and arg.annotation is None
    ]
    assert not untyped, f"untyped `run` parameters: {untyped}"
    graph = import_graph()
    collaborators = [
        "flows.controller.run_checkpoints",
        "flows.controller.recovery",
        "flows.controller.run_evaluation",
        "flows.controller.run_publish",
    ]
    for unit in [*collaborators, "flows.lineages.promotion", "flows.controller.run_state"]:
        assert "flows.controller.runtime" not in reachable(graph, unit), unit
    assert set(collaborators) <= graph["flows.controller.runtime"]  # the graph is read: the loop does call them


def test_a_runs_state_is_changed_only_by_its_owner():
    """Outside flows/controller/run_state.py and flows/controller/runtime.py nothing assigns a field of a run (``run.x =
    ...``, ``run.x[k] = ...``) or changes one in place (``run.faults.append(...)``): the collaborators ask the run,
    through its methods (``rewind``, ``note_fault``, ``checkpointed`` ...)."""
    changes = []
    mutators = {"append", "extend", "clear", "pop", "update", "insert", "remove", "setdefault"}
    reporters = {"progress", "terminal", "tracker"}  # objects the run holds, with methods of their own (update: a bar)
    for file in (ROOT / "flows").rglob("*.py"):
        if file.name in ("run_state.py", "runtime.py"):
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in mutators:
                targets = [node.func.value]
                if isinstance(node.func.value, ast.Attribute) and node.func.value.attr in reporters:
                    targets = []
            for target in targets:
                while isinstance(target, ast.Subscript):
                    target = target.value
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "run"
                ):
                    changes.append(f"{file.relative_to(ROOT)}:{node.lineno} run.{target.attr}")
    assert not changes, f"a run's state changed outside its owner: {changes}"


# flows' rooms, from the top down: a module imports its own room's modules and those of the rooms below, never above
LAYERS = [
    ("the entry point", ["flows.__main__"]),
    ("operations", ["flows.ops"]),
    ("the algorithms' flows", ["flows.sft", "flows.grpo", "flows.ppo", "flows.online_dpo", "flows.launch"]),
    ("the controller's runtime", ["flows.controller"]),
    ("lineages", ["flows.lineages"]),
    ("plumbing", ["flows.plumbing"]),
    ("the configuration and the stages", ["flows.config", "flows.stages", "flows"]),
]


def layer_of(module: str) -> int:
    """The index in LAYERS of the room ``module`` is in (its longest prefix there)."""
    best = max(
        ((len(prefix), index) for index, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
         if module == prefix or module.startswith(prefix + ".")),
        default=None,
    )  # fmt: skip
    assert best is not None, f"{module} is in no room of LAYERS: add it to one"
    return best[1]


def test_flows_rooms_import_only_downward():
    """The layering of flows/ (the README's layout): operations (the CLI, local servers, deploy, demo) are imported by
    nothing but the entry point; the flows call the controller's runtime, which uses lineages and the plumbing; the
    plumbing (task runner, Prefect internals, kept processes, servers, tracking) knows no RL; the configuration and the
    stages import no other module of flows."""
    graph = import_graph()
    assert "flows.controller.groups" in graph["flows.grpo"]  # the graph is read, module by module
    upward = [
        f"{source} ({LAYERS[layer_of(source)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for source, targets in graph.items()
        if source.startswith("flows")
        for target in targets
        if target.startswith("flows") and layer_of(target) < layer_of(source)
    ]
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_the_layering_check_sees_an_upward_import():
    assert layer_of("flows.controller.runtime") < layer_of("flows.plumbing.kept")
    assert layer_of("flows.grpo") < layer_of("flows.controller.run_start") < layer_of("flows.config")
    assert layer_of("flows.ops.cli") == 1 and layer_of("flows") == len(LAYERS) - 1
