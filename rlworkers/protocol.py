"""DataProto: the one batch type that crosses process boundaries.

A DataProto holds three things for a batch of ``B`` rows:

* ``batch``: a ``tensordict.TensorDict`` whose tensors all share the leading dimension ``B``;
* ``non_tensor_batch``: ``{name: np.ndarray}`` with ``dtype=object`` and length ``B`` (strings, uids, dicts);
* ``meta_info``: a free-form dict shared by all rows (temperature, ``metrics``, ...).

Method names and signatures follow verl's ``verl.protocol`` so that workers port by changing imports. What is
different, and why:

* ``save_to_disk`` / ``load_from_disk`` write one safetensors file (tensors) whose header carries the
  non-tensor columns and ``meta_info`` as JSON: no pickle, so loading a file never runs code.
* Ray serialisation (``__reduce__``) hands every tensor to Ray as a numpy view, which Ray moves out of band
  (pickle protocol 5 buffers, zero-copy into the object store) instead of pickling each tensor's bytes.
* Padding lives in two module functions beside the class (``pad_dataproto_to_divisor``, ``unpad_dataproto``);
  methods never pad implicitly.

``DataProtoFuture`` (the non-blocking result of a worker-group call) lives in
``rlworkers.single_controller.futures`` because it needs Ray; this module imports neither Ray nor Prefect.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import fsspec
import numpy as np
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save
from tensordict import TensorDict

__all__ = ["DataProto", "DataProtoItem", "DataProtoFuture", "plan_shard", "pad_dataproto_to_divisor", "unpad_dataproto",
           "union_two_dict"]

_FORMAT_VERSION = "rlflow.dataproto/1"


def union_two_dict(dict1: dict, dict2: dict) -> dict:
    """Merge ``dict2`` into ``dict1`` in place; a key present in both with different values is an error."""
    for key, value in dict2.items():
        if key in dict1 and not _values_equal(dict1[key], value):
            raise ValueError(f"cannot union: key {key!r} has different values ({dict1[key]!r} vs {value!r})")
        dict1[key] = value
    return dict1


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a_arr, b_arr = np.asarray(a, dtype=object), np.asarray(b, dtype=object)
        return a_arr.shape == b_arr.shape and all(_values_equal(x, y) for x, y in zip(a_arr.ravel(), b_arr.ravel()))
    try:
        return bool(a == b)
    except Exception:  # objects whose == is not a bool
        return a is b


def _as_object_array(values: Any, name: str) -> np.ndarray:
    if isinstance(values, np.ndarray) and values.dtype == object:
        return values
    array = np.empty(len(values), dtype=object)
    array[:] = list(values)
    return array


def _index_array(idxs: Any, length: int) -> np.ndarray:
    """Normalise an index (int array, list, tensor, or boolean mask) to a numpy int64 array."""
    if isinstance(idxs, torch.Tensor):
        idxs = idxs.detach().cpu().numpy()
    idxs = np.asarray(idxs)
    if idxs.dtype == bool:
        if idxs.shape != (length,):
            raise IndexError(f"boolean mask has shape {idxs.shape}, expected ({length},)")
        return np.nonzero(idxs)[0]
    if idxs.size and not np.issubdtype(idxs.dtype, np.integer):
        raise IndexError(f"index array must hold integers or booleans, got dtype {idxs.dtype}")
    return idxs.astype(np.int64).reshape(-1)


@dataclass
class DataProtoItem:
    """One row of a DataProto (what ``data[i]`` returns)."""

    batch: TensorDict | None = None
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)


@dataclass
class DataProto:
    """A batch of rows: tensors (``batch``), object columns (``non_tensor_batch``) and shared ``meta_info``."""

    batch: TensorDict | None = None
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.check_consistency()

    # ----------------------------------------------------------------------------------------------- building
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> "DataProto":
        """Build from ``{name: tensor [B, ...]}`` and ``{name: sequence of length B}``.

        ``auto_padding`` is accepted for verl compatibility; padding is decided by the dispatch mode here.
        """
        tensors = dict(tensors or {})
        non_tensors = {k: _as_object_array(v, k) for k, v in (non_tensors or {}).items()}
        if num_batch_dims != 1 and non_tensors:
            raise ValueError("non_tensors are only supported with num_batch_dims=1")
        batch = None
        if tensors:
            first = next(iter(tensors.values()))
            batch_size = list(first.shape[:num_batch_dims])
            for name, tensor in tensors.items():
                if not isinstance(tensor, torch.Tensor):
                    raise TypeError(f"tensors[{name!r}] is a {type(tensor).__name__}; put it in non_tensors instead")
                if list(tensor.shape[:num_batch_dims]) != batch_size:
                    raise ValueError(
                        f"tensors[{name!r}] has leading shape {list(tensor.shape[:num_batch_dims])}, "
                        f"expected {batch_size} like the first tensor"
                    )
            batch = TensorDict(tensors, batch_size=batch_size)
        return cls(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(meta_info or {}))

    @classmethod
    def from_single_dict(cls, data: dict[str, Any], meta_info: dict | None = None, auto_padding: bool = False):
        """Build from one dict: tensors go to ``batch``, everything else becomes a non-tensor column."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        non_tensors = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        return cls.from_dict(tensors, non_tensors, meta_info=meta_info)

    def check_consistency(self) -> None:
        """Raise if columns disagree on the batch size."""
        if self.batch is not None and len(self.batch.batch_size) == 0:
            raise ValueError("DataProto.batch must have a batch dimension")
        length = None if self.batch is None else self.batch.batch_size[0]
        for name, values in self.non_tensor_batch.items():
            if not isinstance(values, np.ndarray):
                raise TypeError(f"non_tensor_batch[{name!r}] must be a numpy array, got {type(values).__name__}")
            if length is None:
                length = len(values)
            elif len(values) != length:
                raise ValueError(f"non_tensor_batch[{name!r}] has {len(values)} rows, expected {length}")

    # ----------------------------------------------------------------------------------------------- access
    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        if self.non_tensor_batch:
            return len(next(iter(self.non_tensor_batch.values())))
        return 0

    def __getitem__(self, item):
        if isinstance(item, (int, np.integer)):
            batch = None if self.batch is None else self.batch[int(item)]
            row = {k: v[int(item)] for k, v in self.non_tensor_batch.items()}
            return DataProtoItem(batch=batch, non_tensor_batch=row, meta_info=self.meta_info)
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (list, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        raise TypeError(f"DataProto indices must be int, slice, list, array, tensor or bool mask, not {type(item)}")

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> "DataProto":
        """Rows ``start:end:step`` (views of the tensors, no copy)."""
        sl = slice(start, end, step)
        batch = None if self.batch is None else self.batch[sl]
        non_tensors = {k: v[sl] for k, v in self.non_tensor_batch.items()}
        return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(self.meta_info))

    def select_idxs(self, idxs) -> "DataProto":
        """Rows at integer positions or where a boolean mask is true, in that order."""
        positions = _index_array(idxs, len(self))
        batch = None if self.batch is None else self.batch[torch.from_numpy(positions)]
        non_tensors = {k: v[positions] for k, v in self.non_tensor_batch.items()}
        return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(self.meta_info))

    def select(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_batch_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
        deepcopy: bool = False,
    ) -> "DataProto":
        """A DataProto with only the named columns (all of a kind when its keys are None)."""
        batch = self.batch
        if batch is not None and batch_keys is not None:
            batch = batch.select(*batch_keys)
        non_tensors = self.non_tensor_batch
        if non_tensor_batch_keys is not None:
            non_tensors = {k: non_tensors[k] for k in non_tensor_batch_keys}
        meta = self.meta_info
        if meta_info_keys is not None:
            meta = {k: meta[k] for k in meta_info_keys}
        if deepcopy:
            batch = None if batch is None else batch.clone()
            non_tensors, meta = copy.deepcopy(non_tensors), copy.deepcopy(meta)
        return DataProto(batch=batch, non_tensor_batch=dict(non_tensors), meta_info=dict(meta))

    def pop(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_batch_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
    ) -> "DataProto":
        """Remove the named columns from this DataProto and return them as a new one."""
        tensors = {k: self.batch.pop(k) for k in (batch_keys or [])}
        non_tensors = {k: self.non_tensor_batch.pop(k) for k in (non_tensor_batch_keys or [])}
        meta = {k: self.meta_info.pop(k) for k in (meta_info_keys or [])}
        return DataProto.from_dict(tensors, non_tensors, meta_info=meta)

    def rename(self, old_keys: str | Sequence[str], new_keys: str | Sequence[str]) -> "DataProto":
        """Rename tensor columns in place."""
        old_keys = [old_keys] if isinstance(old_keys, str) else list(old_keys)
        new_keys = [new_keys] if isinstance(new_keys, str) else list(new_keys)
        if len(old_keys) != len(new_keys):
            raise ValueError(f"rename got {len(old_keys)} old keys and {len(new_keys)} new keys")
        for old, new in zip(old_keys, new_keys):
            self.batch.rename_key_(old, new)
        return self

    def union(self, other: "DataProto") -> "DataProto":
        """Add ``other``'s columns to this one in place. A column present in both must be equal."""
        if len(self) != len(other) and len(self) and len(other):
            raise ValueError(f"cannot union DataProtos of {len(self)} and {len(other)} rows")
        if other.batch is not None:
            if self.batch is None:
                self.batch = other.batch
            else:
                for key, tensor in other.batch.items():
                    if key in self.batch.keys() and not torch.equal(self.batch[key], tensor):
                        raise ValueError(f"cannot union: tensor column {key!r} differs between the two DataProtos")
                    self.batch[key] = tensor
        for key, values in other.non_tensor_batch.items():
            if key in self.non_tensor_batch and not _values_equal(self.non_tensor_batch[key], values):
                raise ValueError(f"cannot union: non-tensor column {key!r} differs between the two DataProtos")
            self.non_tensor_batch[key] = values
        union_two_dict(self.meta_info, other.meta_info)
        self.check_consistency()
        return self

    # ------------------------------------------------------------------------------------ splitting/joining
    def chunk(self, chunks: int) -> list["DataProto"]:
        """Split into ``chunks`` equal parts. Use ``pad_dataproto_to_divisor`` first for uneven batches."""
        if len(self) % chunks != 0:
            raise ValueError(
                f"cannot chunk {len(self)} rows into {chunks} equal parts; "
                f"pad first with pad_dataproto_to_divisor(data, {chunks})"
            )
        return self.split(len(self) // chunks) if len(self) else [self.slice(0, 0) for _ in range(chunks)]

    def split(self, split_size: int) -> list["DataProto"]:
        """Consecutive parts of ``split_size`` rows (the last may be shorter)."""
        if split_size <= 0:
            raise ValueError(f"split_size must be positive, got {split_size}")
        return [self.slice(start, start + split_size) for start in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: Sequence["DataProto"]) -> "DataProto":
        """Rows of all parts in order. ``meta_info["metrics"]`` is merged into lists; other meta must agree."""
        if not data:
            raise ValueError("DataProto.concat needs at least one DataProto")
        batches = [d.batch for d in data]
        batch = None
        if batches[0] is not None:
            batch = torch.cat(batches, dim=0) if len(batches) > 1 else batches[0]
        non_tensors = {
            key: np.concatenate([d.non_tensor_batch[key] for d in data]) for key in data[0].non_tensor_batch
        }
        return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=_merge_meta([d.meta_info for d in data]))

    def reorder(self, indices) -> None:
        """Permute rows in place."""
        reordered = self.select_idxs(indices)
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> "DataProto":
        """Each row ``repeat_times`` times: ``aabb`` when ``interleave`` else ``abab``."""
        n = len(self)
        positions = np.repeat(np.arange(n), repeat_times) if interleave else np.tile(np.arange(n), repeat_times)
        return self.select_idxs(positions)

    def padding(self, padding_size: int, padding_candidate: str = "") -> "DataProto":
        """Append ``padding_size`` copies of the last row (or the first, with ``padding_candidate="first"``)."""
        if padding_size == 0:
            return self
        row = 0 if padding_candidate == "first" else len(self) - 1
        return DataProto.concat([self, self.select_idxs(np.full(padding_size, row))])

    def to(self, device: str | torch.device) -> "DataProto":
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def nbytes(self) -> int:
        return 0 if self.batch is None else sum(t.numel() * t.element_size() for t in self.batch.values())

    # ----------------------------------------------------------------------------------------- persistence
    def save_to_disk(self, path: str) -> None:
        """Write one safetensors file (any fsspec path); non-tensors and meta travel as JSON in its header."""
        tensors = {} if self.batch is None else {k: v.contiguous() for k, v in self.batch.items()}
        header = {
            "format": _FORMAT_VERSION,
            "length": len(self),
            "non_tensor_batch": {k: _to_json(v.tolist(), f"non_tensor_batch[{k!r}]")
                                 for k, v in self.non_tensor_batch.items()},
            "meta_info": _to_json(self.meta_info, "meta_info"),
        }
        payload = safetensors_save(tensors, metadata={"rlflow": json.dumps(header)})
        with fsspec.open(path, "wb") as f:
            f.write(payload)

    @classmethod
    def load_from_disk(cls, path: str) -> "DataProto":
        with fsspec.open(path, "rb") as f:
            payload = f.read()
        tensors = safetensors_load(payload)
        header_len = int.from_bytes(payload[:8], "little")
        metadata = json.loads(payload[8 : 8 + header_len]).get("__metadata__", {})
        if "rlflow" not in metadata:
            raise ValueError(f"{path} is not a DataProto file written by DataProto.save_to_disk")
        header = json.loads(metadata["rlflow"])
        non_tensors = {k: _as_object_array(v, k) for k, v in header["non_tensor_batch"].items()}
        data = cls.from_dict(tensors, non_tensors, meta_info=header["meta_info"])
        if len(data) != header["length"] and (tensors or non_tensors):
            raise ValueError(f"{path}: header says {header['length']} rows, file holds {len(data)}")
        return data

    # ----------------------------------------------------------------------------------------- serialisation
    def __reduce__(self):
        # Tensors leave as numpy views so Ray (pickle protocol 5) moves their buffers out of band, zero-copy.
        tensors = {} if self.batch is None else {k: _tensor_to_numpy(v) for k, v in self.batch.items()}
        batch_size = None if self.batch is None else list(self.batch.batch_size)
        return _rebuild_dataproto, (tensors, batch_size, self.non_tensor_batch, self.meta_info)

    def __repr__(self) -> str:
        tensors = {} if self.batch is None else {k: (tuple(v.shape), str(v.dtype)) for k, v in self.batch.items()}
        return (
            f"DataProto(len={len(self)}, tensors={tensors}, non_tensors={list(self.non_tensor_batch)}, "
            f"meta_info_keys={list(self.meta_info)})"
        )


def _tensor_to_numpy(tensor: torch.Tensor) -> tuple[np.ndarray, str, tuple[int, ...]]:
    tensor = tensor.detach().cpu().contiguous()
    # numpy has no bfloat16 (and friends): ship the raw bytes and the dtype name.
    return tensor.reshape(-1).view(torch.uint8).numpy(), str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)


def _numpy_to_tensor(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    if raw.size == 0:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    if not raw.flags.writeable:  # buffers from Ray's object store are read-only
        raw = raw.copy()
    return torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)


def _rebuild_dataproto(tensors, batch_size, non_tensor_batch, meta_info) -> DataProto:
    batch = None
    if batch_size is not None:
        batch = TensorDict({k: _numpy_to_tensor(*v) for k, v in tensors.items()}, batch_size=batch_size)
    return DataProto(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=meta_info)


def _merge_meta(metas: Sequence[dict]) -> dict:
    merged: dict = {}
    metrics: dict[str, list] = {}
    for meta in metas:
        for key, value in meta.items():
            if key == "metrics":
                for name, metric in value.items():
                    metrics.setdefault(name, []).extend(metric if isinstance(metric, list) else [metric])
            elif key in merged and not _values_equal(merged[key], value):
                raise ValueError(f"cannot concat: meta_info[{key!r}] differs between parts "
                                 f"({merged[key]!r} vs {value!r})")
            else:
                merged[key] = value
    if metrics:
        merged["metrics"] = metrics
    return merged


def _to_json(value: Any, what: str) -> Any:
    try:
        json.dumps(value)
    except TypeError as exc:
        raise TypeError(f"{what} cannot be saved: {exc}. Only JSON-serialisable values can be saved.") from exc
    return value


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad to a multiple of ``size_divisor`` by repeating leading rows; returns ``(padded, pad_size)``."""
    pad_size = (-len(data)) % size_divisor
    if pad_size == 0:
        return data, 0
    if len(data) == 0:
        raise ValueError("cannot pad an empty DataProto")
    positions = np.arange(pad_size) % len(data)
    return DataProto.concat([data, data.select_idxs(positions)]), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last ``pad_size`` rows (the inverse of ``pad_dataproto_to_divisor``)."""
    return data.slice(0, len(data) - pad_size) if pad_size else data


# --------------------------------------------------------------------------------------------------- futures
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

    @staticmethod
    def concat(data: Sequence["DataProtoFuture"]) -> "DataProtoFuture":
        return DataProtoFuture(
            [f for d in data for f in d.futures], [n for d in data for n in d.lengths],
            method="+".join(d.method for d in data), ranks=[r for d in data for r in d.ranks],
        )

    def get(self) -> DataProto:
        from rlworkers.single_controller.errors import get_with_rank

        return DataProto.concat(get_with_rank(self.futures, self.ranks, self.method))

    def materialize(self) -> tuple[DataProto, None]:
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

    def materialize(self) -> tuple[DataProto, int]:
        import ray

        lengths = [n if isinstance(n, int) else None for n in self.future.lengths]
        pending = [i for i, n in enumerate(lengths) if n is None]
        for i, n in zip(pending, ray.get([self.future.lengths[i] for i in pending])):
            lengths[i] = n
        plan, pad = plan_shard(lengths, self.rank, self.world_size, self.auto_padding)
        needed = sorted({chunk for chunk, _, _ in plan})
        fetched = dict(zip(needed, ray.get([self.future.futures[i] for i in needed])))
        parts = [fetched[chunk].slice(lo, hi) for chunk, lo, hi in plan]
        return DataProto.concat(parts), pad

    def get(self) -> DataProto:
        return self.materialize()[0]
