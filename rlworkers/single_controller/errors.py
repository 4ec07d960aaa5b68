"""Errors the controller raises for worker-side failures, and the wait that produces them.

Every error here pickles with its fields: Ray re-raises a task's exception in the caller's process and Prefect
re-raises a task's in the flow's, so an error that could not be rebuilt from its pickle would reach the user as
``RaySystemError: __init__() missing 2 required positional arguments`` instead of what failed.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence


class StaleProcessError(RuntimeError):
    """A worker process kept for reuse imported code that changed on disk since it started."""


@dataclass(frozen=True)
class WorkerProcess:
    """Where one rank of a worker group runs: enough to find its process and its log."""

    worker_class: str
    actor_name: str
    pid: int
    node_ip: str
    node_id: str
    log_file: str | None = None

    def __str__(self) -> str:
        where = f"actor {self.actor_name}, pid {self.pid} on node {self.node_ip} ({self.node_id[:8]})"
        return f"{where}, log {self.log_file}" if self.log_file else where


class WorkerError(RuntimeError):
    """A worker raised, died or did not answer while running a worker-group method.

    ``rank`` is the failing worker's rank (-1 when Ray could not say which), ``method`` the method name,
    ``cause`` the exception seen by the controller (a ``RuntimeError`` with its text where the original does not
    pickle), ``remote_traceback`` the worker-side traceback, ``worker`` where the rank ran (``WorkerProcess``).
    """

    def __init__(
        self,
        rank: int,
        method: str,
        cause: BaseException | str,
        worker: WorkerProcess | None = None,
        remote_traceback: str | None = None,
    ):
        self.rank, self.method, self.worker = rank, method, worker
        self.cause = _picklable(cause)
        self.remote_traceback = remote_traceback if remote_traceback is not None else _remote_traceback(cause)
        super().__init__(self._message())

    @property
    def actor_died(self) -> bool:
        """The rank's process is gone (killed, crashed, node lost): retrying the call on it cannot succeed."""
        import ray

        return isinstance(self.cause, ray.exceptions.RayActorError) or isinstance(self, StageTimeout)

    def _message(self) -> str:
        who = f"{self.worker.worker_class} rank {self.rank}" if self.worker else f"worker rank {self.rank}"
        where = f" ({self.worker})" if self.worker else ""
        if self.actor_died:
            text = str(self.cause).strip()
            details = f"\n{text}" if "\n" in text else ""  # e.g. the constructor's traceback
            return f"{who} died in {self.method!r}{where}: {_first_line(self.cause)}{details}"
        return f"{who} failed in {self.method!r}{where}:\n{self.remote_traceback or self.cause}"

    def __reduce__(self):
        return type(self), (self.rank, self.method, self.cause, self.worker, self.remote_traceback)


class StageTimeout(WorkerError):
    """Ranks that did not answer a worker-group call within its time limit (their actors were killed)."""

    def __init__(
        self,
        ranks: Sequence[int],
        method: str,
        timeout_s: float,
        workers: Sequence[WorkerProcess | None] = (),
        windows: int = 1,
    ):
        self.ranks, self.timeout_s, self.workers, self.windows = list(ranks), timeout_s, list(workers), windows
        super().__init__(
            self.ranks[0],
            method,
            f"no answer within {timeout_s * windows:.0f} s",
            self.workers[0] if self.workers else None,
            remote_traceback="",
        )

    @property
    def waited_s(self) -> float:
        """How long the call ran before it was cut: its limit, times the windows it was given while working."""
        return self.timeout_s * self.windows

    def _message(self) -> str:
        where = "; ".join(f"rank {r}: {w}" for r, w in zip(self.ranks, self.workers) if w) or "no process details"
        why = (
            "their processes were not working (stopped, gone, or idle)"
            if self.windows == 1
            else f"they were working at {self.timeout_s:.0f} s and got {self.windows - 1} more window(s) of it, then "
            "stopped working or reached the most windows a call gets"
        )
        return (
            f"{self.method!r} did not answer within {self.waited_s:.0f} s on rank(s) {self.ranks} ({where}); {why}. "
            "Those actors were killed so that a retry starts clean. If the stage is just slow, raise "
            "trainer.stage_timeout_s / trainer.stage_timeout_s_per_sample"
        )

    def __reduce__(self):
        return type(self), (self.ranks, self.method, self.timeout_s, self.workers, self.windows)


class PlacementError(RuntimeError):
    """A resource pool cannot be placed on the cluster (names what it asked for and what exists)."""


def get_with_rank(
    refs: Sequence[Any],
    ranks: Sequence[int],
    method: str,
    *,
    workers: Sequence[WorkerProcess | None] | None = None,
    timeout_s: float | None = None,
    grace_s: float = 2.0,
    still_working: Callable[[list[int], Callable[[float], None]], bool] | None = None,
    max_windows: int = 10,
) -> list:
    """``ray.get(refs)`` in rank order, failing fast and naming who failed.

    Raises ``WorkerError`` as soon as one rank fails; when several fail within ``grace_s`` of the first (a dead
    peer makes the others' collectives fail too), a rank whose process died is named over one that raised.
    Raises ``StageTimeout`` for the ranks still running after ``timeout_s`` (the caller kills them), unless
    ``still_working(those ranks, pause)`` says they are slow, not hung: then they get another ``timeout_s``, up to
    ``max_windows`` in all (``pause(seconds)`` waits that long, or until every late rank has answered).
    """
    import ray

    failures = (ray.exceptions.RayTaskError, ray.exceptions.RayActorError)
    workers = list(workers) if workers else [None] * len(refs)
    index = {ref: i for i, ref in enumerate(refs)}
    outputs: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}
    pending = list(refs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    windows = 1

    def take(ref) -> None:
        nonlocal deadline
        i = index[ref]
        try:
            outputs[i] = ray.get(ref)
        except failures as error:
            errors[i] = error
            if len(errors) == 1:  # from now on wait only grace_s for the others
                deadline = time.monotonic() + grace_s if deadline is None else min(deadline, time.monotonic() + grace_s)

    while pending:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        if done:
            take(done[0])
            continue
        late, waiting = [ranks[index[ref]] for ref in pending], list(pending)

        def pause(seconds: float) -> None:
            ray.wait(waiting, num_returns=len(waiting), timeout=seconds)

        working = not errors and still_working is not None and windows < max_windows and still_working(late, pause)
        finished, pending = ray.wait(pending, num_returns=len(pending), timeout=0)  # done while it was watched
        for ref in finished:
            take(ref)
        if not pending or not working:
            break
        windows += 1
        deadline = time.monotonic() + timeout_s
    if errors:
        died = [i for i, e in errors.items() if isinstance(e, ray.exceptions.RayActorError)]
        i = min(died) if died else min(errors)
        raise WorkerError(ranks[i], method, errors[i], workers[i]) from errors[i]
    if pending:  # errors is empty here: the deadline is the call's own
        late = sorted(index[ref] for ref in pending)
        raise StageTimeout([ranks[i] for i in late], method, timeout_s, [workers[i] for i in late], windows)
    return [outputs[i] for i in range(len(refs))]


def _picklable(cause: BaseException | str) -> BaseException:
    if isinstance(cause, str):
        return RuntimeError(cause)
    try:
        pickle.loads(pickle.dumps(cause))
        return cause
    except Exception:
        return RuntimeError(f"{type(cause).__name__}: {cause}")


def _remote_traceback(cause: BaseException | str) -> str:
    text = getattr(cause, "traceback_str", None)
    return text if text else str(cause)


def _first_line(cause: BaseException) -> str:
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return next(
        (line for line in lines if "died" in line or "killed" in line or "exit" in line.lower()),
        lines[0] if lines else type(cause).__name__,
    )
