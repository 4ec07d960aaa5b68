"""Flow runs in the test process, as a notebook or a sweep runs them: the worker processes a run ends with are kept
for the next run of the process (flows/controller/groups.py), which the CLI's own process cannot do."""

from __future__ import annotations


def train_here(algorithm: str, preset: str, *overrides: str) -> None:
    """What `rlflow train <algorithm> --config <preset> <overrides>` runs, in this process (where the gate, the data
    or the model is under test; `rlflow train` itself is for the runs that are paused, killed or read from the
    terminal)."""
    from flows.config import load_config
    from flows.controller.groups import ray_task_runner
    from flows.launch import get_flow

    config = load_config(preset, list(overrides))
    config.check_algorithm(algorithm)
    state = get_flow(algorithm).with_options(task_runner=ray_task_runner())(config=config, return_state=True)
    assert state.is_completed(), state.message
