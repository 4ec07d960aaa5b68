"""``register``, ``Dispatch`` and ``Execute``: how one controller call becomes one call per worker.

``@register(dispatch_mode=..., execute_mode=...)`` only tags a Worker method. A WorkerGroup's binding step
(``WorkerGroup._bind_worker_method``) reads the tag and puts a same-named method on the group that

1. splits the arguments with the mode's ``dispatch_fn(worker_group, *args, **kwargs) -> (args, kwargs)``;
   every returned argument is a list with one value per rank (so a list is never scattered by accident:
   only a dispatch function decides what each rank gets);
2. runs the method on every rank (``Execute.ALL``) or on rank 0 (``Execute.RANK_ZERO``);
3. merges the per-rank outputs with ``collect_fn(worker_group, outputs)``. A collect function with a
   ``collect_ranks(worker_group)`` method merges only those ranks' outputs, in that order; the other ranks
   return None instead of their output (nd dispatch: one collector per dp group).

nd dispatch (``make_nd_compute_dataproto_dispatch_fn(mesh_name)``) splits each DataProto into one chunk per dp
rank of a device mesh the workers registered with ``Worker._register_dispatch_collect_info``; every rank of a
dp group (its tp/sp/pp replicas) receives the same chunk, stored once.

The splitting modes take TensorDicts too (verl 0.9's engine workers pass them, jagged nested tensors included):
split with ``tensordict_utils.chunk_tensordict`` (never padded: the length must divide) and merged with
``concat_tensordict``.

Auto-padding (DP_COMPUTE_PROTO, DP_COMPUTE_METRIC) is undone inside the worker that holds the padded rows, so
blocking calls, non-blocking calls and futures chained into other groups all return exactly the input rows.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from tensordict import TensorDict

from rlworkers import tensordict_utils as tu
from rlworkers.protocol import DataProto, ProtocolError, pad_dataproto_to_divisor
from rlworkers.single_controller.futures import DataProtoFuture, concat_batches

MAGIC_ATTR = "attrs_3141562937"  # verl's attribute name, kept so tools that look for it keep working
PAD_KEY = "_rlflow_pad_rows"  # rows of padding at the end of this rank's chunk (driver -> worker)
WITH_LEN_KEY = "_rlflow_return_len"  # ask the worker to also return len(output) (for chained futures)
DROP_OUTPUT_KEY = "_rlflow_drop_output"  # the controller discards this rank's output: return None instead


class DynamicEnum:
    """An enum that users can extend at run time (``Dispatch.register("MY_MODE")``); pickles by name."""

    _registry: dict[str, "DynamicEnum"]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._registry = {}

    def __init__(self, name: str):
        self.name = name

    @classmethod
    def register(cls, name: str) -> "DynamicEnum":
        if name not in cls._registry:
            member = cls(name)
            cls._registry[name] = member
            setattr(cls, name, member)
        return cls._registry[name]

    def __reduce__(self):
        return type(self).register, (self.name,)

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class Dispatch(DynamicEnum):
    pass


class Execute(DynamicEnum):
    pass


# RANK_ZERO is a name only (as in verl): it has no dispatch functions; use execute_mode=Execute.RANK_ZERO.
for _name in (
    "RANK_ZERO",
    "ONE_TO_ALL",
    "ALL_TO_ALL",
    "DP_COMPUTE",
    "DP_COMPUTE_PROTO",
    "DP_COMPUTE_PROTO_WITH_FUNC",
    "DP_COMPUTE_METRIC",
    "DIRECT_ROLLOUT_METHOD",
):
    Dispatch.register(_name)
for _name in ("ALL", "RANK_ZERO"):
    Execute.register(_name)


# --------------------------------------------------------------------------------------------- dispatch fns
def _broadcast(value: Any, world_size: int) -> list:
    return [value] * world_size


def dispatch_one_to_all(worker_group, *args, **kwargs):
    n = worker_group.world_size
    args = tuple(_broadcast(worker_group.share(a), n) for a in args)
    kwargs = {k: _broadcast(worker_group.share(v), n) for k, v in kwargs.items()}
    return args, kwargs


def dispatch_all_to_all(worker_group, *args, **kwargs):
    # verl passes these through and lets execute_all scatter lists of world_size; here they are broadcast.
    return dispatch_one_to_all(worker_group, *args, **kwargs)


def collect_all_to_all(worker_group, output):
    return output


def dispatch_dp_compute(worker_group, *args, **kwargs):
    n = worker_group.world_size
    for name, value in [*enumerate(args), *kwargs.items()]:
        if not isinstance(value, (list, tuple)) or len(value) != n:
            raise TypeError(
                f"Dispatch.DP_COMPUTE needs every argument to be a list with one value per rank ({n}); "
                f"argument {name!r} is {type(value).__name__}"
                + (f" of length {len(value)}" if isinstance(value, (list, tuple)) else "")
            )
    return args, kwargs


def collect_dp_compute(worker_group, output):
    if len(output) != worker_group.world_size:
        raise ValueError(f"expected {worker_group.world_size} outputs, got {len(output)}")
    return output


def _split_proto(value: Any, name: Any, n: int, auto_padding: bool):
    """Per-rank chunks of a DataProto (padded to a multiple of n) or a TensorDict (never padded), or shards of a
    DataProtoFuture."""
    if isinstance(value, DataProtoFuture):
        return [value.shard(rank, n, auto_padding) for rank in range(n)], None
    if isinstance(value, TensorDict):  # verl 0.9's engine workers: they pad themselves (tu.pad_to_divisor)
        if len(value) % n:
            raise ProtocolError(
                f"argument {name!r} is a TensorDict of {len(value)} rows, which does not split into {n} equal "
                "parts: pad it first (rlworkers.tensordict_utils.pad_to_divisor) or pass a DataProto (auto-padded)"
            )
        return [tu.contiguous(chunk).consolidate() for chunk in tu.chunk_tensordict(value, n)], None
    if not isinstance(value, DataProto):
        raise TypeError(
            f"argument {name!r} is a {type(value).__name__}; this dispatch mode splits DataProto, TensorDict or "
            "DataProtoFuture arguments. Pass other values through meta_info, or use Dispatch.ONE_TO_ALL."
        )
    pad = 0
    if auto_padding:
        value, pad = pad_dataproto_to_divisor(value, n)
    chunks = value.chunk(n)
    size = len(chunks[0])
    real = len(value) - pad
    pads = [max(0, min((r + 1) * size, len(value)) - max(r * size, real)) for r in range(n)]
    return chunks, pads


def _split_protos(args: tuple, kwargs: dict, parts: int, auto_padding: bool) -> tuple[tuple, dict]:
    """Every argument as a list of ``parts`` chunks; ``kwargs[PAD_KEY]`` lists each chunk's padding rows."""
    lengths, pads_seen = [], []
    split_args, split_kwargs = [], {}
    for name, value in [*enumerate(args), *kwargs.items()]:
        chunks, pads = _split_proto(value, name, parts, auto_padding)
        if isinstance(name, int):
            split_args.append(chunks)
        else:
            split_kwargs[name] = chunks
        if not isinstance(value, DataProtoFuture):
            lengths.append(len(value))
        if pads is not None:
            pads_seen.append(pads)
    if len(set(lengths)) > 1:
        raise ValueError(f"the batch arguments have different lengths: {lengths}")
    if pads_seen and any(pads_seen[0]):
        split_kwargs[PAD_KEY] = pads_seen[0]
    return tuple(split_args), split_kwargs


def dispatch_dp_compute_data_proto(worker_group, *args, **kwargs):
    return _split_protos(args, kwargs, worker_group.world_size, auto_padding=True)


def dispatch_dp_compute_data_proto_with_func(worker_group, func, *args, **kwargs):
    if not callable(func):
        raise TypeError("Dispatch.DP_COMPUTE_PROTO_WITH_FUNC needs a function as the first argument")
    split_args, split_kwargs = _split_protos(args, kwargs, worker_group.world_size, auto_padding=False)
    return (_broadcast(func, worker_group.world_size), *split_args), split_kwargs


def collect_dp_compute_data_proto(worker_group, output):
    return concat_batches(output)


# ------------------------------------------------------------------------------------------- nd dispatch
def _dp_rank_of_each_rank(worker_group, mesh_name: str) -> list[int]:
    """``[dp rank of global rank r]`` for ``mesh_name``, asked of the workers once per group."""
    if mesh_name not in worker_group._dispatch_info:
        dp_rank_of = list(worker_group._query_dispatch_info(mesh_name))
        if sorted(set(dp_rank_of)) != list(range(max(dp_rank_of) + 1)):
            raise ValueError(
                f"the ranks registered dp ranks {dp_rank_of} for mesh {mesh_name!r}; every dp rank from 0 to the "
                "largest needs at least one rank: check the dp_rank passed to _register_dispatch_collect_info"
            )
        worker_group._dispatch_info[mesh_name] = dp_rank_of
    return worker_group._dispatch_info[mesh_name]


def dispatch_nd_compute_data_proto(mesh_name: str, worker_group, *args, **kwargs):
    """One chunk of every DataProto (or future) per dp rank of ``mesh_name``, padded like DP_COMPUTE_PROTO; each
    chunk is stored once and every rank of its dp group receives it."""
    dp_rank_of = _dp_rank_of_each_rank(worker_group, mesh_name)
    split_args, split_kwargs = _split_protos(args, kwargs, max(dp_rank_of) + 1, auto_padding=True)

    def per_rank(chunks: list) -> list:
        shared = [worker_group.share(chunk) for chunk in chunks]
        return [shared[dp_rank] for dp_rank in dp_rank_of]

    return tuple(per_rank(chunks) for chunks in split_args), {k: per_rank(v) for k, v in split_kwargs.items()}


class NdCollect:
    """The collect function of an nd mode: the concatenated outputs of one collector rank per dp group of
    ``mesh_name``, in dp order (``collect_ranks``); the other ranks' outputs are never sent back."""

    def __init__(self, mesh_name: str):
        self.mesh_name = mesh_name

    def collect_ranks(self, worker_group) -> list[int]:
        if self.mesh_name not in worker_group._collect_info:
            worker_group._collect_info[self.mesh_name] = list(worker_group._query_collect_info(self.mesh_name))
        is_collector = worker_group._collect_info[self.mesh_name]
        dp_rank_of = _dp_rank_of_each_rank(worker_group, self.mesh_name)
        collectors = sorted((dp_rank_of[rank], rank) for rank, collect in enumerate(is_collector) if collect)
        if [dp_rank for dp_rank, _ in collectors] != list(range(max(dp_rank_of) + 1)):
            raise ValueError(
                f"mesh {self.mesh_name!r} needs exactly one collector (is_collect=True) per dp rank; the collectors "
                f"are ranks {[rank for _, rank in collectors]} with dp ranks {[dp for dp, _ in collectors]}. "
                "Usually is_collect is 'local rank 0 on every non-dp mesh dimension'"
            )
        return [rank for _, rank in collectors]

    def __call__(self, worker_group, output: list) -> DataProto:
        return collect_dp_compute_data_proto(worker_group, output)


def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> dict[str, Callable]:
    """The dispatch mode of a method that runs on the dp groups of the device mesh ``mesh_name`` (the workers
    register it with ``_register_dispatch_collect_info``): ``@register(dispatch_mode=make_nd_...("actor"))``."""
    return {
        "dispatch_fn": functools.partial(dispatch_nd_compute_data_proto, mesh_name),
        "collect_fn": NdCollect(mesh_name),
    }


def direct_call_only(worker_group, *args, **kwargs):
    """``Dispatch.DIRECT_ROLLOUT_METHOD``: such a method is called on the actor itself (an async rollout server
    calls ``ray.get_actor(name).<method>.remote()``), never through a WorkerGroup. A colocated class binds it from
    a role whose name contains "rollout" under its plain name (``ray/colocate.py``), as verl does."""
    raise TypeError(
        "this method is registered with Dispatch.DIRECT_ROLLOUT_METHOD: call it on the worker's actor directly "
        "(group.workers[i].<method>.remote(...)), not through the worker group"
    )


DISPATCH_MODE_FN_REGISTRY: dict[Dispatch, dict[str, Callable]] = {
    Dispatch.ONE_TO_ALL: {"dispatch_fn": dispatch_one_to_all, "collect_fn": collect_all_to_all},
    Dispatch.ALL_TO_ALL: {"dispatch_fn": dispatch_all_to_all, "collect_fn": collect_all_to_all},
    Dispatch.DP_COMPUTE: {"dispatch_fn": dispatch_dp_compute, "collect_fn": collect_dp_compute},
    Dispatch.DP_COMPUTE_PROTO: {
        "dispatch_fn": dispatch_dp_compute_data_proto,
        "collect_fn": collect_dp_compute_data_proto,
    },
    Dispatch.DP_COMPUTE_PROTO_WITH_FUNC: {
        "dispatch_fn": dispatch_dp_compute_data_proto_with_func,
        "collect_fn": collect_dp_compute_data_proto,
    },
    Dispatch.DP_COMPUTE_METRIC: {"dispatch_fn": dispatch_dp_compute_data_proto, "collect_fn": collect_dp_compute},
    Dispatch.DIRECT_ROLLOUT_METHOD: {"dispatch_fn": direct_call_only, "collect_fn": direct_call_only},
}


def register_dispatch_mode(name: str, dispatch_fn: Callable, collect_fn: Callable) -> Dispatch:
    """Add a new dispatch mode usable as ``Dispatch.<name>``."""
    mode = Dispatch.register(name)
    if mode in DISPATCH_MODE_FN_REGISTRY:
        raise ValueError(f"dispatch mode {name} already exists; use update_dispatch_mode to change it")
    DISPATCH_MODE_FN_REGISTRY[mode] = {"dispatch_fn": dispatch_fn, "collect_fn": collect_fn}
    return mode


def update_dispatch_mode(dispatch_mode: Dispatch, dispatch_fn: Callable, collect_fn: Callable) -> None:
    if dispatch_mode not in DISPATCH_MODE_FN_REGISTRY:
        raise ValueError(f"unknown dispatch mode {dispatch_mode}")
    DISPATCH_MODE_FN_REGISTRY[dispatch_mode] = {"dispatch_fn": dispatch_fn, "collect_fn": collect_fn}


def get_predefined_dispatch_fn(dispatch_mode) -> dict[str, Callable]:
    if isinstance(dispatch_mode, dict):
        missing = {"dispatch_fn", "collect_fn"} - set(dispatch_mode)
        if missing:
            raise ValueError(f"a dict dispatch mode needs 'dispatch_fn' and 'collect_fn'; missing {sorted(missing)}")
        return dispatch_mode
    if dispatch_mode not in DISPATCH_MODE_FN_REGISTRY:
        valid = sorted(m.name for m in DISPATCH_MODE_FN_REGISTRY)
        raise ValueError(f"unknown dispatch mode {dispatch_mode!r}; valid: {valid} or a dict")
    return DISPATCH_MODE_FN_REGISTRY[dispatch_mode]


def get_predefined_execute_fn(execute_mode: Execute) -> dict[str, str]:
    names = {Execute.ALL: "execute_all", Execute.RANK_ZERO: "execute_rank_zero"}
    if execute_mode not in names:
        raise ValueError(f"unknown execute mode {execute_mode!r}; valid: {[m.name for m in names]}")
    return {"execute_fn_name": names[execute_mode]}


# ----------------------------------------------------------------------------------------------- register
def _materialize(args: tuple, kwargs: dict) -> tuple[tuple, dict, int | None]:
    """Replace future shards by their DataProto chunk; return the padding rows they carry."""
    pad = None
    out_args = []
    for arg in args:
        if hasattr(arg, "materialize"):
            arg, pad = arg.materialize()
        out_args.append(arg)
    out_kwargs = {}
    for key, value in kwargs.items():
        if hasattr(value, "materialize"):
            value, pad = value.materialize()
        out_kwargs[key] = value
    return tuple(out_args), out_kwargs, pad


def _input_rows(args: tuple, kwargs: dict) -> int | None:
    for value in [*args, *kwargs.values()]:
        if isinstance(value, (DataProto, TensorDict)):
            return len(value)
    return None


def _unpad_output(output: Any, pad: int, input_rows: int | None, method: str):
    if not pad or not isinstance(output, (DataProto, TensorDict)) or not input_rows:
        return output
    if len(output) % input_rows:
        raise ValueError(
            f"{method} got {input_rows} rows (including {pad} rows of auto-padding) and returned {len(output)}; "
            "auto-padding can only be removed when each input row gives the same number of output rows, in order"
        )
    per_row = len(output) // input_rows
    return output[: len(output) - pad * per_row]


def register(
    dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.ALL, blocking: bool = True, materialize_futures: bool = True
):
    """Tag a Worker method so that WorkerGroups bind a distributed call for it (verl's signature)."""
    get_predefined_dispatch_fn(dispatch_mode)  # fail at class definition for an unknown mode
    get_predefined_execute_fn(execute_mode)

    def decorator(func):
        def prepare(args, kwargs):
            pad = kwargs.pop(PAD_KEY, 0)
            with_len = kwargs.pop(WITH_LEN_KEY, False)
            drop_output = kwargs.pop(DROP_OUTPUT_KEY, False)
            if materialize_futures:
                args, kwargs, future_pad = _materialize(args, kwargs)
                pad = future_pad if future_pad is not None else pad
            return args, kwargs, pad, with_len, drop_output

        def finish(output, pad, rows, with_len, drop_output):
            output = None if drop_output else _unpad_output(output, pad, rows, func.__qualname__)
            if with_len:
                return output, (len(output) if isinstance(output, (DataProto, TensorDict)) else None)
            return output

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def inner(self, *args, **kwargs):
                args, kwargs, pad, *flags = prepare(args, kwargs)
                return finish(await func(self, *args, **kwargs), pad, _input_rows(args, kwargs), *flags)
        else:

            @functools.wraps(func)
            def inner(self, *args, **kwargs):
                args, kwargs, pad, *flags = prepare(args, kwargs)
                return finish(func(self, *args, **kwargs), pad, _input_rows(args, kwargs), *flags)

        del inner.__wrapped__  # Ray checks calls against the signature; the hidden keywords must pass
        setattr(inner, MAGIC_ATTR, {"dispatch_mode": dispatch_mode, "execute_mode": execute_mode, "blocking": blocking})
        return inner

    return decorator
