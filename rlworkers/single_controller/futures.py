"""DataProtoFuture: the rows a non-blocking worker-group call will return, and how a consumer group shards them.

verl keeps ``DataProtoFuture`` in ``verl.protocol``; here it belongs to the single controller, which creates and
shards it (so ``rlworkers.protocol`` does not import the controller). Its constructor is
``DataProtoFuture(futures, lengths, method, ranks)``, and ``shard(rank, world_size, auto_padding)`` replaces
verl's ``chunk(n)``: each consumer rank fetches only the chunks that overlap its rows (``plan_shard``).
Ray is imported only when a future is materialised.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from tensordict import TensorDict

from rlworkers import tensordict_utils as tu
from rlworkers.protocol import DataProto
from rlworkers.single_controller.errors import get_with_rank

__all__ = ["DataProtoFuture", "DataProtoFutureShard", "plan_shard", "concat_batches"]


def concat_batches(parts: list) -> DataProto | TensorDict:
    """The per-rank outputs of a splitting dispatch mode as one batch: DataProtos concatenated with
    ``DataProto.concat``, TensorDicts with ``tensordict_utils.concat_tensordict`` (jagged tensors included)."""
    kind = TensorDict if isinstance(parts[0], TensorDict) else DataProto
    for i, part in enumerate(parts):
        if not isinstance(part, kind):
            raise TypeError(
                f"part {i} is a {type(part).__name__}; a splitting dispatch mode expects every rank to return "
                f"a DataProto or every rank a TensorDict (part 0 is a {type(parts[0]).__name__})"
            )
    return tu.concat_tensordict(parts) if kind is TensorDict else DataProto.concat(parts)


class DataProtoFuture:
    """The rows a non-blocking worker-group call will return: one Ray object per rank, in rank order.

    ``futures[i]`` holds rank i's DataProto and ``lengths[i]`` its row count (a tiny separate object, so a consumer
    can plan which chunks it needs without fetching any data). ``get()`` materialises everything on the caller.
    Passed to another group's DP_COMPUTE_PROTO method, each consumer rank fetches only the chunks that overlap its
    own rows (see ``plan_shard``), so each chunk moves once instead of once per consumer.
    """

    def __init__(self, futures: list, lengths: list, method: str = "", ranks: list[int] | None = None):
        if len(futures) != len(lengths):
            raise ValueError("DataProtoFuture needs one length per future")
        self.futures = list(futures)
        self.lengths = list(lengths)
        self.method = method
        self.ranks = list(range(len(futures))) if ranks is None else list(ranks)

    def get(self) -> DataProto | TensorDict:
        return concat_batches(get_with_rank(self.futures, self.ranks, self.method))

    def materialize(self) -> tuple[DataProto | TensorDict, None]:
        return self.get(), None

    def shard(self, rank: int, world_size: int, auto_padding: bool) -> "DataProtoFutureShard":
        return DataProtoFutureShard(self, rank, world_size, auto_padding)


def plan_shard(lengths: Sequence[int], rank: int, world_size: int, auto_padding: bool):
    """Which rows of which chunks rank ``rank`` of ``world_size`` needs, as ``[(chunk, start, stop)]``, and how
    many rows at its end are padding. Padding repeats leading rows, like ``pad_dataproto_to_divisor``."""
    total = int(sum(lengths))
    pad = (-total) % world_size if auto_padding else 0
    if pad == 0 and total % world_size:
        raise ValueError(f"cannot split {total} rows into {world_size} equal parts without auto-padding")
    size = (total + pad) // world_size
    start, stop = rank * size, (rank + 1) * size
    wanted = [(lo, hi) for lo, hi in [(start, min(stop, total))] if hi > lo]
    pad_here = max(0, stop - max(start, total))
    first_pad_row = max(start, total) - total  # index among the pad rows, which copy rows 0, 1, 2, ...
    for row in range(first_pad_row, first_pad_row + pad_here):
        wanted.append((row % total, row % total + 1))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(int)
    plan = []
    for lo, hi in wanted:
        for chunk in range(len(lengths)):
            c_lo, c_hi = max(lo, offsets[chunk]), min(hi, offsets[chunk + 1])
            if c_hi > c_lo:
                plan.append((chunk, int(c_lo - offsets[chunk]), int(c_hi - offsets[chunk])))
    return plan, pad_here


class DataProtoFutureShard:
    """Rank ``rank``'s part of a DataProtoFuture; materialised inside the worker that receives it."""

    def __init__(self, future: DataProtoFuture, rank: int, world_size: int, auto_padding: bool):
        self.future, self.rank, self.world_size, self.auto_padding = future, rank, world_size, auto_padding

    def materialize(self) -> tuple[DataProto | TensorDict, int]:
        import ray

        lengths = [n if isinstance(n, int) else None for n in self.future.lengths]
        pending = [i for i, n in enumerate(lengths) if n is None]
        for i, n in zip(pending, ray.get([self.future.lengths[i] for i in pending])):
            lengths[i] = n
        plan, pad = plan_shard(lengths, self.rank, self.world_size, self.auto_padding)
        needed = sorted({chunk for chunk, _, _ in plan})
        fetched = dict(zip(needed, ray.get([self.future.futures[i] for i in needed])))
        parts = [fetched[chunk][lo:hi] for chunk, lo, hi in plan]
        return concat_batches(parts), pad

    def get(self) -> DataProto | TensorDict:
        return self.materialize()[0]
