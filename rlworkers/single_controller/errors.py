"""Errors the controller raises for worker-side failures, with the failing rank and its traceback."""

from __future__ import annotations

from typing import Any, Sequence


class WorkerError(RuntimeError):
    """A worker raised or died while running a worker-group method.

    ``rank`` is the failing worker's rank, ``method`` the method name; the message carries the remote traceback.
    """

    def __init__(self, rank: int, method: str, cause: BaseException):
        self.rank, self.method, self.cause = rank, method, cause
        super().__init__(f"worker rank {rank} failed in {method!r}:\n{cause}")


class PlacementError(RuntimeError):
    """A resource pool cannot be placed on the cluster (names what it asked for and what exists)."""


def get_with_rank(refs: Sequence[Any], ranks: Sequence[int], method: str) -> list:
    """``ray.get(refs)``; on failure raise WorkerError naming the first rank (in rank order) that failed."""
    import ray

    try:
        return ray.get(list(refs))
    except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as first_error:
        for rank, ref in zip(ranks, refs):
            try:
                ray.get(ref)
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as error:
                raise WorkerError(rank, method, error) from error
        raise WorkerError(-1, method, first_error) from first_error
