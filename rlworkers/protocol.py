"""DataProto: the one batch type that crosses process boundaries.

A DataProto holds three things for a batch of ``B`` rows:

* ``batch``: a ``tensordict.TensorDict`` whose tensors all share the leading dimension ``B``;
* ``non_tensor_batch``: ``{name: np.ndarray}`` of length ``B`` (strings, uids, dicts; usually ``dtype=object``);
* ``meta_info``: a free-form dict shared by all rows (temperature, ``metrics``, ...).

Method names, signatures and behaviour follow verl 0.9's ``verl.protocol`` so that workers port by changing
imports (``from rlworkers import DataProto``). What is different, and why:

* ``save_to_disk`` / ``load_from_disk`` write one safetensors file (tensors) whose header carries the
  non-tensor columns and ``meta_info`` as JSON: no pickle, so loading a file never runs code.
* Ray serialisation (``__reduce__``) hands every tensor to Ray as a numpy view, which Ray moves out of band
  (pickle protocol 5 buffers, zero-copy into the object store) instead of pickling each tensor's bytes.
* A list given as a non-tensor column becomes a 1-D object array, one element per row, even when the rows are
  equal-length lists (verl's ``np.array(v, dtype=object)`` would turn chat messages into a 2-D array). Pass an
  ``np.ndarray`` to get an N-D column; arrays are kept as they are.
* Validation errors raise ``ProtocolError``, both a ``ValueError`` and an ``AssertionError``, so rlflow's
  ``except ValueError`` and verl's ``pytest.raises(AssertionError)`` both catch them.
* Padding for dispatch lives in two module functions beside the class (``pad_dataproto_to_divisor``,
  ``unpad_dataproto``). ``DataProtoConfig.auto_padding`` only lets ``chunk`` split unevenly; rlflow's
  ``Dispatch.DP_COMPUTE_PROTO`` always pads, whatever the switch says.
* ``DataProtoFuture`` (the non-blocking result of a worker-group call) lives in
  ``rlworkers.single_controller.futures``, not here: it waits on workers through the single controller, and
  this module imports neither Ray, Prefect nor the single controller.

Over 450 lines on purpose: one class, verl's DataProto API surface (construction, slicing, splitting, padding,
union, serialization), which ported workers call method by method.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import fsspec
import numpy as np
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save
from tensordict import NonTensorData, NonTensorStack, TensorDict
from torch.utils.data import DataLoader

__all__ = [
    "DataProto",
    "DataProtoItem",
    "DataProtoConfig",
    "ProtocolError",
    "pad_dataproto_to_divisor",
    "unpad_dataproto",
    "union_two_dict",
    "union_tensor_dict",
    "union_numpy_dict",
    "list_of_dict_to_dict_of_list",
    "fold_batch_dim",
    "unfold_batch_dim",
    "collate_fn",
    "serialize_single_tensor",
    "deserialize_single_tensor",
    "serialize_tensordict",
    "deserialize_tensordict",
    "all_gather_data_proto",
]

logger = logging.getLogger(__name__)

_FORMAT_VERSION = "rlflow.dataproto/1"


class ProtocolError(ValueError, AssertionError):
    """A DataProto that breaks the protocol's rules (sizes, keys, conflicting values)."""


class _DataProtoConfigMeta(type):
    auto_padding_key = "_verl_auto_padding"
    _auto_padding = False

    @property
    def auto_padding(cls) -> bool:
        enabled_by_env = os.getenv("VERL_AUTO_PADDING", "FALSE").upper() in ("TRUE", "1")
        return enabled_by_env or cls._auto_padding

    @auto_padding.setter
    def auto_padding(cls, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise ProtocolError(f"DataProtoConfig.auto_padding must be a bool, got {enabled!r}")
        cls._auto_padding = enabled


class DataProtoConfig(metaclass=_DataProtoConfigMeta):
    """Process-wide switch, as in verl: ``DataProtoConfig.auto_padding = True`` (or env ``VERL_AUTO_PADDING=1``)
    lets every ``DataProto.chunk`` split unevenly; ``from_dict(auto_padding=True)`` does it for one DataProto."""


# --------------------------------------------------------------------------------------- dict and value helpers
def _deep_equal(a: Any, b: Any, visited: set[int] | None = None) -> bool:
    """Equality used by every union and concat check: same type, NaN equals NaN, arrays and tensors compared by
    dtype, shape and elements, containers recursively. A reference cycle counts as equal when both sides reach it."""
    if type(a) is not type(b):
        return False
    visited = set() if visited is None else visited
    if id(a) in visited:
        return True
    visited.add(id(a))
    try:
        if isinstance(a, float):
            return a == b or (math.isnan(a) and math.isnan(b))
        if isinstance(a, torch.Tensor):
            return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        if isinstance(a, np.ndarray):
            if a.dtype != b.dtype or a.shape != b.shape:
                return False
            if a.dtype != object:
                return np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
            return all(_deep_equal(x, y, visited) for x, y in zip(a.flat, b.flat))
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(_deep_equal(x, y, visited) for x, y in zip(a, b))
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(_deep_equal(a[k], b[k], visited) for k in a)
        try:
            return bool(a == b)
        except Exception:  # objects whose == is not a bool
            return a is b
    finally:
        visited.discard(id(a))


def union_two_dict(dict1: dict, dict2: dict) -> dict:
    """Merge ``dict2`` into ``dict1`` in place; a key present in both with different values is an error."""
    for key, value in dict2.items():
        if key in dict1 and not _deep_equal(dict1[key], value):
            raise ProtocolError(f"cannot union: key {key!r} has different values ({dict1[key]!r} vs {value!r})")
        dict1[key] = value
    return dict1


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add ``tensor_dict2``'s tensors to ``tensor_dict1`` in place; a key in both must hold equal tensors."""
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise ProtocolError(
            f"cannot union TensorDicts of batch size {list(tensor_dict1.batch_size)} and "
            f"{list(tensor_dict2.batch_size)}"
        )
    for key, tensor in tensor_dict2.items():
        if key in tensor_dict1.keys() and not tensor_dict1[key].equal(tensor):
            raise ProtocolError(f"cannot union: tensor column {key!r} differs between the two DataProtos")
        tensor_dict1[key] = tensor
    return tensor_dict1


def union_numpy_dict(tensor_dict1: dict[str, np.ndarray], tensor_dict2: dict[str, np.ndarray]) -> dict:
    """Add ``tensor_dict2``'s arrays to ``tensor_dict1`` in place; a key in both must hold equal arrays (same
    dtype and shape; NaN equals NaN; object elements compared recursively)."""
    for key, values in tensor_dict2.items():
        if key in tensor_dict1 and not _deep_equal(tensor_dict1[key], values):
            raise ProtocolError(f"cannot union: non-tensor column {key!r} differs between the two DataProtos")
        tensor_dict1[key] = values
    return tensor_dict1


def list_of_dict_to_dict_of_list(list_of_dict: Sequence[dict]) -> dict[str, list]:
    """``[{"a": 1}, {"a": 2}]`` -> ``{"a": [1, 2]}``. Keys come from the first dict; later dicts may miss some."""
    if not list_of_dict:
        return {}
    output: dict[str, list] = {key: [] for key in list_of_dict[0]}
    for i, entry in enumerate(list_of_dict):
        for key, value in entry.items():
            if key not in output:
                raise ProtocolError(f"dict {i} has key {key!r}, which the first dict lacks (keys: {list(output)})")
            output[key].append(value)
    return output


def _as_object_array(values: Any) -> np.ndarray:
    """A non-tensor column: arrays stay as they are; any other sequence becomes a 1-D object array, one row each."""
    if isinstance(values, np.ndarray):
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


def _type_info(value: Any) -> str:
    """``list[int]``, ``dict[str: float]``, ``ndarray(3,) (object)``: what ``get_data_info`` prints for meta."""
    if isinstance(value, list):
        return f"list[{'|'.join(sorted({_type_info(v) for v in value[:3]})) or '...'}]"
    if isinstance(value, tuple):
        return f"tuple({', '.join(_type_info(v) for v in value)})"
    if isinstance(value, dict):
        if not value:
            return "dict"
        key, item = next(iter(value.items()))
        return f"dict[{_type_info(key)}: {_type_info(item)}]"
    if isinstance(value, np.ndarray):
        return f"ndarray{value.shape} ({value.dtype})"
    return type(value).__name__


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
        if self.non_tensor_batch is None:
            self.non_tensor_batch = {}
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
        """Build from ``{name: tensor [B, ...]}`` and ``{name: array or sequence of length B}``.

        ``auto_padding=True`` marks this DataProto so that ``chunk`` may split it unevenly (see ``DataProtoConfig``).
        """
        tensors = dict(tensors or {})
        non_tensors = {k: _as_object_array(v) for k, v in (non_tensors or {}).items()}
        if num_batch_dims != 1:
            raise ProtocolError(
                f"num_batch_dims must be 1, got {num_batch_dims}: a DataProto has one batch dimension "
                "(use fold_batch_dim / unfold_batch_dim to reshape rows)"
            )
        batch = None
        if tensors:
            first = next(iter(tensors.values()))
            batch_size = list(first.shape[:1])
            for name, tensor in tensors.items():
                if not isinstance(tensor, torch.Tensor):
                    raise TypeError(f"tensors[{name!r}] is a {type(tensor).__name__}; put it in non_tensors instead")
                if list(tensor.shape[:1]) != batch_size:
                    raise ProtocolError(
                        f"tensors[{name!r}] has leading shape {list(tensor.shape[:1])}, "
                        f"expected {batch_size} like the first tensor"
                    )
            batch = TensorDict(tensors, batch_size=batch_size)
        meta_info = dict(meta_info or {})
        if auto_padding:
            meta_info[DataProtoConfig.auto_padding_key] = True
        return cls(batch=batch, non_tensor_batch=non_tensors, meta_info=meta_info)

    @classmethod
    def from_single_dict(cls, data: dict[str, Any], meta_info: dict | None = None, auto_padding: bool = False):
        """Build from one dict: tensors go to ``batch``, everything else becomes a non-tensor column."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        non_tensors = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        return cls.from_dict(tensors, non_tensors, meta_info=meta_info, auto_padding=auto_padding)

    @classmethod
    def from_tensordict(cls, tensor_dict: TensorDict, meta_info: dict | None = None, num_batch_dims: int = 1):
        """Build from a TensorDict: tensors -> ``batch``, ``NonTensorStack`` -> a non-tensor column,
        ``NonTensorData`` -> ``meta_info`` (the inverse of ``to_tensordict``)."""
        tensors, non_tensors, meta = {}, {}, dict(meta_info or {})
        for key, value in tensor_dict.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, NonTensorStack):
                non_tensors[key] = value.tolist()
            elif isinstance(value, NonTensorData):
                meta[key] = value.data
        return cls.from_dict(tensors, non_tensors, meta_info=meta, num_batch_dims=num_batch_dims)

    def to_tensordict(self) -> TensorDict:
        """One TensorDict: tensors as they are, each non-tensor column as a ``NonTensorStack`` (nested lists and
        dicts survive), each ``meta_info`` entry as ``NonTensorData``."""
        tensors = {} if self.batch is None else dict(self.batch.items())
        clashes = (set(tensors) | set(self.non_tensor_batch)) & set(self.meta_info) | (
            set(tensors) & set(self.non_tensor_batch)
        )
        if clashes:
            raise ProtocolError(
                f"cannot convert to a TensorDict: keys {sorted(clashes)} name more than one of "
                "batch, non_tensor_batch and meta_info; rename them first"
            )
        source = {
            **tensors,
            **{k: NonTensorStack.from_list([NonTensorData(x) for x in v]) for k, v in self.non_tensor_batch.items()},
            **{k: NonTensorData(v) for k, v in self.meta_info.items()},
        }
        return TensorDict(source, batch_size=[len(self)])

    def check_consistency(self) -> None:
        """Raise if the batch has other than one batch dimension or columns disagree on the batch size."""
        if self.batch is not None and len(self.batch.batch_size) != 1:
            raise ProtocolError(
                f"DataProto.batch must have exactly one batch dimension, got batch_size "
                f"{list(self.batch.batch_size)}; fold_batch_dim / unfold_batch_dim reshape rows"
            )
        length = None if self.batch is None else self.batch.batch_size[0]
        for name, values in self.non_tensor_batch.items():
            if not isinstance(values, np.ndarray):
                raise TypeError(f"non_tensor_batch[{name!r}] must be a numpy array, got {type(values).__name__}")
            if length is None:
                length = len(values)
            elif len(values) != length:
                raise ProtocolError(f"non_tensor_batch[{name!r}] has {len(values)} rows, expected {length}")

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
        return type(self)(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(self.meta_info))

    def select_idxs(self, idxs) -> "DataProto":
        """Rows at integer positions or where a boolean mask is true, in that order."""
        positions = _index_array(idxs, len(self))
        batch = None if self.batch is None else self.batch[torch.from_numpy(positions)]
        non_tensors = {k: v[positions] for k, v in self.non_tensor_batch.items()}
        return type(self)(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(self.meta_info))

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
        return type(self)(batch=batch, non_tensor_batch=dict(non_tensors), meta_info=dict(meta))

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
            raise ProtocolError(f"rename got {len(old_keys)} old keys and {len(new_keys)} new keys")
        for old, new in zip(old_keys, new_keys):
            self.batch.rename_key_(old, new)
        return self

    def union(self, other: "DataProto") -> "DataProto":
        """Add ``other``'s columns and meta to this one in place. A key present in both must hold equal values."""
        if len(self) != len(other) and len(self) and len(other):
            raise ProtocolError(f"cannot union DataProtos of {len(self)} and {len(other)} rows")
        if self.batch is None:
            self.batch = other.batch
        elif other.batch is not None:
            union_tensor_dict(self.batch, other.batch)
        union_numpy_dict(self.non_tensor_batch, other.non_tensor_batch)
        union_two_dict(self.meta_info, other.meta_info)
        self.check_consistency()
        return self

    def make_iterator(
        self, mini_batch_size: int, epochs: int, seed: int | None = None, dataloader_kwargs: dict | None = None
    ) -> Iterator["DataProto"]:
        """Mini-batches of ``mini_batch_size`` rows for ``epochs`` passes, through a torch DataLoader over the rows
        (pass ``{"shuffle": True}`` in ``dataloader_kwargs`` to shuffle; ``seed`` makes the order repeatable).
        Each mini-batch carries this DataProto's ``meta_info``."""
        if len(self) % mini_batch_size:
            raise ProtocolError(
                f"make_iterator needs the batch size ({len(self)}) to be a multiple of "
                f"mini_batch_size ({mini_batch_size})"
            )
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        loader = DataLoader(
            self, batch_size=mini_batch_size, collate_fn=collate_fn, generator=generator, **(dataloader_kwargs or {})
        )

        def mini_batches():
            for _ in range(epochs):
                for mini_batch in loader:
                    mini_batch.meta_info = self.meta_info
                    yield mini_batch

        return mini_batches()

    # ------------------------------------------------------------------------------------ splitting/joining
    def is_padding_enabled(self) -> bool:
        """Whether ``chunk`` may split unevenly: this DataProto's ``from_dict(auto_padding=True)`` mark or the
        process-wide ``DataProtoConfig.auto_padding``."""
        return bool(self.meta_info.get(DataProtoConfig.auto_padding_key, False)) or DataProtoConfig.auto_padding

    def padding(self, padding_size: int, padding_candidate: str = "") -> "DataProto":
        """Append, in place, ``padding_size`` copies of the last row (the first with ``padding_candidate="first"``).
        Returns ``self`` too, so ``data = data.padding(n)`` also works."""
        if padding_size == 0:
            return self
        if len(self) == 0:
            raise ProtocolError("cannot pad an empty DataProto: there is no row to repeat")
        row = 0 if padding_candidate == "first" else len(self) - 1
        padded = self.select_idxs(np.concatenate([np.arange(len(self)), np.full(padding_size, row)]))
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch
        return self

    def chunk(self, chunks: int) -> list["DataProto"]:
        """Split into ``chunks`` consecutive parts. They must be equal unless padding is enabled
        (``is_padding_enabled``); then, as in verl, each part has ``ceil(len / chunks)`` rows and the last ones
        fewer (where verl would return fewer parts, the missing ones are empty)."""
        if len(self) % chunks and not self.is_padding_enabled():
            raise ProtocolError(
                f"cannot chunk {len(self)} rows into {chunks} equal parts; pad first with "
                f"pad_dataproto_to_divisor(data, {chunks}), or enable DataProtoConfig.auto_padding for uneven parts"
            )
        size = -(-len(self) // chunks)
        return [self.slice(min(i * size, len(self)), min((i + 1) * size, len(self))) for i in range(chunks)]

    def split(self, split_size: int) -> list["DataProto"]:
        """Consecutive parts of ``split_size`` rows (the last may be shorter)."""
        if split_size <= 0:
            raise ProtocolError(f"split_size must be positive, got {split_size}")
        return [self.slice(start, start + split_size) for start in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: Sequence["DataProto"]) -> "DataProto":
        """Rows of all parts in order, as ``type(data[0])``. Every part must have the same columns.

        ``meta_info["metrics"]`` of each part (a dict, or a list of dicts, e.g. one per worker; None is skipped)
        is gathered into a dict of lists: ``{"loss": 1.0}`` and ``{"loss": 2.0}`` give ``{"loss": [1.0, 2.0]}``.
        Other meta keys are merged and must agree where parts share them.
        """
        if not data:
            raise ProtocolError("DataProto.concat needs at least one DataProto")
        for i, part in enumerate(data):
            if _column_layout(part) != _column_layout(data[0]):
                raise ProtocolError(
                    f"cannot concat: part {i} has (tensors, non-tensor columns) {_column_layout(part)}, "
                    f"part 0 has {_column_layout(data[0])}; every part needs the same columns"
                )
        batch = None
        if data[0].batch is not None:
            batch = torch.cat([d.batch for d in data], dim=0) if len(data) > 1 else data[0].batch
        non_tensors = {key: np.concatenate([d.non_tensor_batch[key] for d in data]) for key in data[0].non_tensor_batch}
        return type(data[0])(
            batch=batch, non_tensor_batch=non_tensors, meta_info=_merge_meta([d.meta_info for d in data])
        )

    def reorder(self, indices) -> None:
        """Permute rows in place."""
        reordered = self.select_idxs(indices)
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> "DataProto":
        """Each row ``repeat_times`` times: ``aabb`` when ``interleave`` else ``abab``."""
        n = len(self)
        positions = np.repeat(np.arange(n), repeat_times) if interleave else np.tile(np.arange(n), repeat_times)
        return self.select_idxs(positions)

    def sample_level_repeat(self, repeat_times) -> "DataProto":
        """Row ``i`` repeated ``repeat_times[i]`` times, in order (a list, tuple, 1-D array or 1-D tensor)."""
        if isinstance(repeat_times, torch.Tensor):
            repeat_times = repeat_times.detach().cpu().numpy()
        counts = np.asarray(repeat_times, dtype=np.int64)
        if counts.shape != (len(self),):
            raise ProtocolError(
                f"sample_level_repeat needs one count per row: {len(self)} rows, repeat_times has shape {counts.shape}"
            )
        return self.select_idxs(np.repeat(np.arange(len(self)), counts))

    def unfold_column_chunks(self, n_split: int, split_keys: Sequence[str] | None = None) -> "DataProto":
        """Cut dim 1 of each column in ``split_keys`` into ``n_split`` pieces and make each piece a row (``[B, n*k]``
        -> ``[B*n, k]``); every other column repeats each row ``n_split`` times to match. Keeps grouped rows
        together where a later shuffle would separate them."""
        split_keys = set(split_keys or [])

        def unfold(values):
            return values.reshape(values.shape[0] * n_split, values.shape[1] // n_split, *values.shape[2:])

        batch = None
        if self.batch is not None:
            columns = {
                k: unfold(v) if k in split_keys else v.repeat_interleave(n_split, dim=0) for k, v in self.batch.items()
            }
            batch = TensorDict(columns, batch_size=[len(self) * n_split], device=self.batch.device)
        non_tensors = {
            k: unfold(v) if k in split_keys else np.repeat(v, n_split, axis=0) for k, v in self.non_tensor_batch.items()
        }
        return type(self)(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(self.meta_info))

    def to(self, device: str | torch.device) -> "DataProto":
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    # ----------------------------------------------------------------------------------------------- sizes
    def nbytes(self) -> int:
        return 0 if self.batch is None else sum(t.numel() * t.element_size() for t in self.batch.values())

    def print_size(self, prefix: str = "") -> str:
        """Log (INFO, logger ``rlworkers.protocol``) and return the size of the tensors and non-tensor arrays."""
        non_tensor_bytes = sum(v.nbytes for v in self.non_tensor_batch.values())
        message = (
            f"Size of tensordict: {self.nbytes() / 1024**3} GB, "
            f"size of non_tensor_batch: {non_tensor_bytes / 1024**3} GB"
        )
        message = f"{prefix}, {message}" if prefix else message
        logger.info(message)
        return message

    def get_data_info(self) -> str:
        """One line per column (shape, dtype, device) and per meta key (its type, nested types spelled out)."""
        info = ["batch"]
        for key, tensor in ({} if self.batch is None else self.batch).items():
            info.append(f"  {key}: {tuple(tensor.shape)} ({tensor.dtype}) {tensor.device}")
        info.append("non_tensor_batch")
        info += [f"  {key}: ndarray{array.shape} ({array.dtype})" for key, array in self.non_tensor_batch.items()]
        info.append("meta_info")
        info += [f"  {key}: {_type_info(value)}" for key, value in self.meta_info.items()]
        return "\n".join(info)

    # ----------------------------------------------------------------------------------------- persistence
    def save_to_disk(self, path: str) -> None:
        """Write one safetensors file (any fsspec path); non-tensors and meta travel as JSON in its header."""
        tensors = {} if self.batch is None else {k: v.contiguous() for k, v in self.batch.items()}
        header = {
            "format": _FORMAT_VERSION,
            "length": len(self),
            "non_tensor_batch": {
                k: _to_json(v.tolist(), f"non_tensor_batch[{k!r}]") for k, v in self.non_tensor_batch.items()
            },
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
        data = cls.from_dict(tensors, header["non_tensor_batch"], meta_info=header["meta_info"])
        if len(data) != header["length"] and (tensors or header["non_tensor_batch"]):
            raise ValueError(f"{path}: header says {header['length']} rows, file holds {len(data)}")
        return data

    # ----------------------------------------------------------------------------------------- serialisation
    def __reduce__(self):
        # Tensors leave as numpy views so Ray (pickle protocol 5) moves their buffers out of band, zero-copy.
        batch = None if self.batch is None else serialize_tensordict(self.batch)
        return _rebuild_dataproto, (type(self), batch, self.non_tensor_batch, self.meta_info)

    def __repr__(self) -> str:
        tensors = {} if self.batch is None else {k: (tuple(v.shape), str(v.dtype)) for k, v in self.batch.items()}
        return (
            f"{type(self).__name__}(len={len(self)}, tensors={tensors}, non_tensors={list(self.non_tensor_batch)}, "
            f"meta_info_keys={list(self.meta_info)})"
        )


def serialize_single_tensor(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], np.ndarray]:
    """``(dtype name, shape, raw bytes as a uint8 numpy view)`` of a CPU copy of ``tensor``, as in verl."""
    tensor = tensor.detach().cpu().contiguous()
    # numpy has no bfloat16 (and friends): ship the raw bytes and the dtype name.
    return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), tensor.reshape(-1).view(torch.uint8).numpy()


def deserialize_single_tensor(serialized: tuple[str, tuple[int, ...], Any]) -> torch.Tensor:
    """The inverse of ``serialize_single_tensor``; copies only a read-only buffer (as Ray's object store gives)."""
    dtype, shape, raw = serialized
    raw = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw
    if raw.size == 0:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    if not raw.flags.writeable:
        raw = raw.copy()
    return torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)


def jagged_from_rows(rows: Sequence[torch.Tensor], ragged_idx: int = 1) -> torch.Tensor:
    """A jagged nested tensor ``[len(rows), ...]`` ragged along dim ``ragged_idx`` (1 is the dim after the batch).

    Naming the ragged dim keeps a ``[B, 4, j]`` tensor ``[n, 4, j]`` even when the ``n`` rows share one length,
    where ``torch.nested.as_nested_tensor`` would guess ``[n, j, L]``."""
    if not rows:
        raise ProtocolError("cannot build a jagged tensor with no rows")
    packed = ragged_idx - 1  # the ragged dim inside one row
    lengths = torch.tensor([row.shape[packed] for row in rows], dtype=torch.int64, device=rows[0].device)
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    values = torch.cat(list(rows), dim=packed)
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets, jagged_dim=ragged_idx)


def ragged_dim(tensor: torch.Tensor) -> int:
    """The ragged dimension of a jagged nested tensor (1: the one after the batch)."""
    return getattr(tensor, "_ragged_idx", 1)


def serialize_tensordict(batch: TensorDict) -> tuple[tuple[int, ...], str | None, dict[str, tuple]]:
    """``(batch size, device, {key: serialized tensor})`` as in verl: a dense tensor as ``serialize_single_tensor``
    gives it, a jagged tensor as ``(layout name, [each row serialized], ragged dim)`` (verl's has no ragged dim and
    guesses it when it rebuilds, wrongly for ``[B, 4, j]`` rows of one length)."""
    items = {}
    for key, tensor in batch.items():
        if tensor.is_nested:
            rows = [serialize_single_tensor(row) for row in tensor.unbind()]
            items[key] = (str(tensor.layout).removeprefix("torch."), rows, ragged_dim(tensor))
        else:
            items[key] = serialize_single_tensor(tensor)
    return tuple(batch.batch_size), None if batch.device is None else str(batch.device), items


def deserialize_tensordict(serialized: tuple[tuple[int, ...], str | None, dict[str, tuple]]) -> TensorDict:
    """The inverse of ``serialize_tensordict`` (also reads verl's, whose jagged tensors are ragged along dim 1)."""
    batch_size, device, items = serialized
    tensors = {}
    for key, item in items.items():
        if isinstance(item[1], list):  # (layout, rows[, ragged dim]); a dense tensor is (dtype, shape, bytes)
            layout, rows = item[0], [deserialize_single_tensor(row) for row in item[1]]
            if layout == "jagged":
                tensors[key] = jagged_from_rows(rows, item[2] if len(item) == 3 else 1)
            else:
                tensors[key] = torch.nested.as_nested_tensor(rows, layout=getattr(torch, layout))
        else:
            tensors[key] = deserialize_single_tensor(item)
    return TensorDict(tensors, batch_size=batch_size, device=device)


def _rebuild_dataproto(cls, batch, non_tensor_batch, meta_info) -> DataProto:
    batch = None if batch is None else deserialize_tensordict(batch)
    return cls(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=meta_info)


def _column_layout(data: DataProto) -> tuple[bool, list[str]]:
    return data.batch is not None, sorted(data.non_tensor_batch)


def _merge_meta(metas: Sequence[dict]) -> dict:
    """``concat``'s meta rule (verl's): metrics gathered into a dict of lists, every other key must agree."""
    merged: dict = {}
    metrics: list[dict] = []
    for meta in metas:
        for key, value in meta.items():
            if key == "metrics":
                if value is not None:
                    metrics.extend(value if isinstance(value, list) else [value])
            elif key in merged and not _deep_equal(merged[key], value):
                raise ProtocolError(
                    f"Conflicting values for meta_info key {key!r} in DataProto.concat "
                    f"({merged[key]!r} vs {value!r}); every part must agree on it"
                )
            else:
                merged[key] = value
    if metrics:
        merged["metrics"] = list_of_dict_to_dict_of_list(metrics)
    return merged


def _to_json(value: Any, what: str) -> Any:
    try:
        json.dumps(value)
    except TypeError as exc:
        raise TypeError(f"{what} cannot be saved: {exc}. Only JSON-serialisable values can be saved.") from exc
    return value


def collate_fn(items: Sequence[DataProtoItem]) -> DataProto:
    """Rows (``DataProtoItem``) back into a DataProto, without meta_info: the DataLoader's ``collate_fn``."""
    batch = None if items[0].batch is None else torch.stack([item.batch for item in items]).contiguous()
    columns = list_of_dict_to_dict_of_list([item.non_tensor_batch for item in items])
    return DataProto(batch=batch, non_tensor_batch={k: _as_object_array(v) for k, v in columns.items()})


def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
    """Group consecutive rows: every column ``[B, ...]`` becomes ``[new_batch_size, B // new_batch_size, ...]``."""
    if len(data) % new_batch_size:
        raise ProtocolError(f"cannot fold {len(data)} rows into {new_batch_size} groups of equal size")

    def fold(values):
        return values.reshape(new_batch_size, -1, *values.shape[1:])

    batch = (
        None
        if data.batch is None
        else TensorDict({k: fold(v) for k, v in data.batch.items()}, batch_size=[new_batch_size])
    )
    non_tensors = {k: fold(v) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensors, meta_info=data.meta_info)


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
    """The inverse of ``fold_batch_dim``: the first ``batch_dims`` dimensions of every column become the rows."""
    columns = [*({} if data.batch is None else data.batch).values(), *data.non_tensor_batch.values()]
    rows = math.prod(columns[0].shape[:batch_dims]) if columns else 0

    def unfold(values):
        return values.reshape(rows, *values.shape[batch_dims:])

    batch = None if data.batch is None else TensorDict({k: unfold(v) for k, v in data.batch.items()}, batch_size=[rows])
    non_tensors = {k: unfold(v) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensors, meta_info=data.meta_info)


def all_gather_data_proto(data: DataProto, process_group=None) -> None:
    """In place, like ``torch.distributed.all_gather``: every rank of ``process_group`` ends with the rows of all
    ranks, in rank order. Every rank must hold the same number of rows, with tensors on the device its backend
    uses (CPU for gloo, CUDA for nccl)."""
    import torch.distributed as dist

    world_size = dist.get_world_size(group=process_group)
    if data.batch is not None:
        gathered = {}
        for key, tensor in data.batch.items():
            parts = [torch.empty_like(tensor) for _ in range(world_size)]
            dist.all_gather(parts, tensor.contiguous(), group=process_group)
            gathered[key] = torch.cat(parts)
        data.batch = TensorDict(gathered, batch_size=[len(data) * world_size])
    columns = [None] * world_size
    dist.all_gather_object(columns, data.non_tensor_batch, group=process_group)
    data.non_tensor_batch = {k: np.concatenate([part[k] for part in columns]) for k in data.non_tensor_batch}


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad to a multiple of ``size_divisor`` by repeating leading rows; returns ``(padded, pad_size)``."""
    pad_size = (-len(data)) % size_divisor
    if pad_size == 0:
        return data, 0
    if len(data) == 0:
        raise ProtocolError("cannot pad an empty DataProto")
    positions = np.arange(pad_size) % len(data)
    return DataProto.concat([data, data.select_idxs(positions)]), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last ``pad_size`` rows (the inverse of ``pad_dataproto_to_divisor``)."""
    return data.slice(0, len(data) - pad_size) if pad_size else data
