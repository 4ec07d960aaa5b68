"""What a run does when a step fails: find the workers that died or hung, replace them, restore the newest valid
checkpoint (or the start) and say where the run rewinds to, within ``trainer.max_restarts``; and what it refuses to
retry (every worker alive: a bug or bad data a restart would repeat; a checkpoint store that failed)."""

from __future__ import annotations

import re
import time
from datetime import datetime

from prefect import get_run_logger
from prefect.exceptions import UnfinishedRun

from flows.controller.run_checkpoints import STATEFUL_ROLES, checkpoint_root, restore, send_rollout_weights
from flows.controller.run_state import RunState, TrainState
from flows.stages import is_task_run_of_step
from rlworkers.checkpoint import CheckpointSaveError, find_latest_checkpoint, read_json
from rlworkers.single_controller import PlacementError, StageTimeout


class FaultBudgetExhausted(RuntimeError):
    """More worker faults than ``trainer.max_restarts``; ``faults`` lists each one."""

    def __init__(self, message: str, faults: list[str]):
        self.faults = faults
        super().__init__(message)

    def __reduce__(self):
        return type(self), (str(self), self.faults)


class StepFailed(RuntimeError):
    """A step failed with every worker alive (a bug or bad data, which a restart would repeat)."""


def recover(run: RunState, step: int, error: Exception) -> TrainState:
    """After a failed step: replace the workers that died or hung and restore every stateful group from the
    newest valid checkpoint (or the start), at most ``trainer.max_restarts`` times; returns that checkpoint's
    ``TrainState`` (or the run's ``initial_state``), which the run rewinds to (``Run.rewind``) to redo what it lost.

    Raises the step's error when every worker is alive (a restart would repeat it) or when the checkpoint
    store failed (a restart could not restore from it either), and ``FaultBudgetExhausted`` past the budget."""
    if isinstance(error, CheckpointSaveError):
        raise error  # the store failed, not a worker (a rank may still be stuck in its write): no restart
    started = time.perf_counter()
    run.drop_submitted_ahead()  # submitted after the failed stage: they never run (NotReady)
    lost = {name: ranks for name, group in run.distinct_groups().items() if (ranks := group.unresponsive_ranks())}
    failures = failed_stages(step, since=run.step_started_at) or [f"{type(error).__name__}: {error}"]
    if not lost:
        if isinstance(error, UnfinishedRun):  # a stage before this one failed: say which, and why
            raise StepFailed(f"step {step} failed with every worker alive: " + "; ".join(failures)) from error
        raise error
    cut = stage_cut(error, failures)
    if cut and run.last_cut == (step, cut[0]):
        trainer = run.config.trainer
        raise StepFailed(
            f"step {step}: {cut[0]!r} was cut at its time limit twice in a row, after {cut[1]:.0f} s the second "
            "time, its workers not working (a restart would only repeat it). If the stage is just slow, raise "
            f"trainer.stage_timeout_s (now {trainer.stage_timeout_s:.0f}) or trainer.stage_timeout_s_per_sample "
            f"(now {trainer.stage_timeout_s_per_sample})"
        ) from error
    where = ", ".join(f"{name} rank(s) {ranks}" for name, ranks in lost.items())
    faults = run.note_fault(step, f"step {step}: {where} lost; " + "; ".join(failures), cut)
    budget = run.config.trainer.max_restarts
    if faults > budget:
        listed = "\n".join(f"  {i}. {fault}" for i, fault in enumerate(run.faults, 1))
        raise FaultBudgetExhausted(
            f"run {run.config.trainer.run_name!r} hit {faults} worker "
            f"faults, more than trainer.max_restarts={budget}:\n{listed}",
            run.faults,
        ) from error
    log = get_run_logger()
    log.warning("step %d: %s lost (%s); restart %d of %d", step, where, failures[0], faults, budget)
    checkpoint = find_latest_checkpoint(checkpoint_root(run.root), required=["trainer_state.json"])
    rebuild = set(lost) if checkpoint else set(lost) | (set(STATEFUL_ROLES) & set(run.distinct_groups()))
    try:
        for name in sorted(rebuild):
            restart_group(run, name)
        if checkpoint:
            state = restore(run, checkpoint[0], read_json(f"{checkpoint[0]}/trainer_state.json"))
        else:
            state = run.initial_state
            send_rollout_weights(run)
    except Exception as during_recovery:  # another worker lost while recovering: one more fault
        return recover(run, step, during_recovery)
    seconds = time.perf_counter() - started
    run.tracker.log_metrics({"fault/restarts": faults, "fault/recovery_s": seconds}, step)
    if run.progress:
        run.progress.update(state.step, restarts=faults)
    log.warning(
        "recovered in %.1f s: rebuilt %s, resuming at step %d from %s",
        seconds,
        sorted(rebuild),
        state.step + 1,
        checkpoint[0] if checkpoint else "the start model",
    )
    return state


def stage_cut(error: BaseException, failures: list[str]) -> tuple[str, float] | None:
    """(method, seconds) of a call that a time limit cut (``StageTimeout``), found in ``error``'s chain or in the
    step's failed task runs' messages (a stage after the cut one fails too, with the cut one's message)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, StageTimeout):
            return seen.method, seen.waited_s
        seen = seen.__cause__ or seen.__context__
    for failure in failures:
        if found := re.search(r"'(\w+)' did not answer within (\d+) s", failure):
            return found.group(1), float(found.group(2))
    return None


def restart_group(run: RunState, name: str) -> None:
    """New actors for one group, waiting up to ``trainer.capacity_timeout_s`` for room (a lost node)."""
    group = run.groups[name]
    deadline = time.monotonic() + run.config.trainer.capacity_timeout_s
    while True:
        try:
            group.restart()
            break
        except PlacementError as error:
            if time.monotonic() > deadline:
                raise
            get_run_logger().warning(
                "waiting for capacity to restart %s (up to trainer.capacity_timeout_s=%.0f s): %s",
                name,
                run.config.trainer.capacity_timeout_s,
                error,
            )
    group.init_model()


def failed_stages(step: int, since: datetime | None = None, wait_s: float = 10.0) -> list[str]:
    """``"<task run name>: <state message>"`` for each failed task run of ``step`` (or of a block of steps that starts
    there, ``...-step-<step>-to-<last>``) in the current flow run that started at ``since`` or later (a step redone
    after a restart has task runs of the same names from before).

    Task-run states reach the Prefect server as events, a moment after the failure: wait up to ``wait_s``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.runtime import flow_run

    if not flow_run.get_id():
        return []
    deadline = time.monotonic() + wait_s
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.get_id()])),
                task_run_filter=TaskRunFilter(
                    state=TaskRunFilterState(type=TaskRunFilterStateType(any_=[StateType.FAILED]), name=None)
                ),
            )
            found = [
                f"{r.name}: {r.state.message if r.state else r.state_name}"
                for r in runs
                if is_task_run_of_step(r.name, step)
                and (since is None or (r.start_time or r.expected_start_time or r.created) >= since)
            ]
            if found or time.monotonic() > deadline:
                return found
            time.sleep(1.0)
