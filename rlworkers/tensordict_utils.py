"""TensorDict helpers for verl 0.9's engine workers, whose batches are plain ``tensordict.TensorDict``s.

Such a batch holds, for ``B`` rows: dense tensors ``[B, ...]``; jagged nested tensors (``layout=torch.jagged``), one
variable-length row per sample (``input_ids`` ``[B, j]``, Qwen-VL's 3-D ``position_ids`` ``[B, 4, j]``);
``NonTensorStack`` columns (one Python object per row: strings, dicts, lists of chat messages); and
``NonTensorData`` metadata shared by all rows (``temperature``, ``global_steps``).

The functions mirror verl's ``verl.utils.tensordict_utils`` (names, signatures, behaviour), so that code ports by
changing ``from verl.utils import tensordict_utils as tu`` to ``from rlworkers import tensordict_utils as tu``.
What is different, and why:

* Where verl asserts, these raise ``rlworkers.protocol.ProtocolError`` (a ``ValueError`` and an ``AssertionError``)
  naming the key or sizes and the fix.
* verl pins tensordict <= 0.10; rlflow runs 0.15, whose ``TensorDict.cat`` stacks ``NonTensorData`` that differ
  between the parts. ``concat_tensordict`` keeps the first part's metadata itself, as verl's tests expect.
* Jagged tensors are rebuilt with their source's ragged dimension. ``torch.nested.as_nested_tensor`` (what verl
  calls) guesses it from the rows: a chunk whose 3-D rows all have the same length comes out ``[n, j, L]``
  (ragged along dim 1) instead of ``[n, 4, j]``.
* Non-tensor values are compared as DataProto compares them (``protocol._deep_equal``: equal types, NaN equals
  NaN, containers recursively), by ``union_tensor_dict`` and ``assert_tensordict_eq``.
* ``pad_to_divisor`` repeats rows through ``index_select_tensor_dict``, so jagged tensors of 3+ dims pad too;
  ``pop_keys`` checks every key before popping any; ``contiguous`` keeps the input's batch size.

Over 450 lines on purpose: verl 0.9's ``tensordict_utils`` module, ported as one so that engine workers change
only their imports.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Iterator, Sequence

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict
from torch.utils.data import DataLoader

from rlworkers.protocol import ProtocolError, _deep_equal, jagged_from_rows, ragged_dim

__all__ = [
    "assign_non_tensor_data",
    "assign_non_tensor_stack",
    "assign_non_tensor",
    "unwrap_non_tensor_data",
    "get_non_tensor_data",
    "concat_nested_tensors",
    "concat_tensordict_with_none_bsz",
    "concat_tensordict",
    "chunk_tensordict",
    "get_tensordict",
    "index_select_tensor_dict",
    "union_tensor_dict",
    "make_iterator",
    "assert_tensordict_eq",
    "get",
    "get_keys",
    "pop",
    "pop_keys",
    "pad_to_divisor",
    "unpad",
    "contiguous",
    "maybe_fix_3d_position_ids",
]

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------------- helpers
def _require_tensordict(value: Any, what: str) -> None:
    if not isinstance(value, TensorDict):
        raise ProtocolError(f"{what} takes a TensorDict, got {type(value).__name__}")


def _is_nested(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_nested


def _stack(values: Sequence) -> NonTensorStack:
    """One ``NonTensorData`` per row, so nested lists and dicts stay whole objects (never become tensors)."""
    return NonTensorStack.from_list([NonTensorData(value) for value in values])


def _native(value: Any) -> Any:
    """A TensorDict entry as plain Python: tensors as they are, a NonTensorStack as a list, NonTensorData unwrapped."""
    if isinstance(value, NonTensorStack):
        return value.tolist()
    if isinstance(value, NonTensorData):
        return value.data
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _difference(a: Any, b: Any) -> str | None:
    """Why two entries of a TensorDict (as ``TensorDict.get`` returns them) differ; None when they are equal."""
    if type(a) is not type(b):
        return f"types differ ({type(a).__name__} vs {type(b).__name__})"
    if _is_nested(a) != _is_nested(b):
        return f"only one is a nested tensor (is_nested {a.is_nested} vs {b.is_nested})"
    if _is_nested(a):
        rows_a, rows_b = a.unbind(), b.unbind()
        if len(rows_a) != len(rows_b):
            return f"nested tensors have {len(rows_a)} vs {len(rows_b)} rows"
        for i, (row_a, row_b) in enumerate(zip(rows_a, rows_b)):
            if not _deep_equal(row_a, row_b):
                return f"row {i} of the nested tensors differs ({_short(row_a)} vs {_short(row_b)})"
        return None
    a, b = _native(a), _native(b)
    if _deep_equal(a, b):
        return None
    if isinstance(a, torch.Tensor):
        return f"tensors differ (shape {list(a.shape)} {a.dtype} vs {list(b.shape)} {b.dtype})"
    return f"{_short(a)} vs {_short(b)}"


def _check_stack_rows(tensor_dict: TensorDict, key: str, rows: int) -> None:
    # RuntimeError, the type tensordict itself raises here, so verl's pytest.raises(RuntimeError) still holds.
    if tensor_dict.batch_dims and rows != tensor_dict.batch_size[0]:
        raise RuntimeError(
            f"{key!r} has {rows} entries but the TensorDict has {tensor_dict.batch_size[0]} rows: a list or "
            "NonTensorStack needs one entry per row (for one value shared by all rows, use assign_non_tensor_data)"
        )


# ------------------------------------------------------------------------------------------ non-tensor entries
def assign_non_tensor_data(tensor_dict: TensorDict, key: str, val: Any) -> None:
    """Store ``val`` under ``key`` as ``NonTensorData``: one value shared by all rows (a name, a config dict)."""
    _require_tensordict(tensor_dict, "assign_non_tensor_data")
    tensor_dict[key] = NonTensorData(val)


def assign_non_tensor_stack(tensor_dict: TensorDict, key: str, val: list) -> None:
    """Store ``val`` (one entry per row) under ``key`` as a ``NonTensorStack``; entries may be nested lists and
    dicts (``[[], [0.5, 0.8], [0.9]]``, ``[[{"role": "user", "content": "..."}]]``) and are kept whole.

    Raises:
        RuntimeError: ``len(val)`` is not the TensorDict's number of rows."""
    _require_tensordict(tensor_dict, "assign_non_tensor_stack")
    _check_stack_rows(tensor_dict, key, len(val))
    tensor_dict[key] = _stack(val)


def assign_non_tensor(tensor_dict: TensorDict, **kwargs: Any) -> TensorDict:
    """Store each keyword: a list as a ``NonTensorStack`` (one entry per row), a ``NonTensorData`` or
    ``NonTensorStack`` as it is, anything else as ``NonTensorData``. Returns ``tensor_dict``, changed in place."""
    _require_tensordict(tensor_dict, "assign_non_tensor")
    for key, val in kwargs.items():
        if isinstance(val, NonTensorStack):
            _check_stack_rows(tensor_dict, key, len(val))
            tensor_dict[key] = val
        elif isinstance(val, NonTensorData):
            tensor_dict[key] = val
        elif isinstance(val, list):
            assign_non_tensor_stack(tensor_dict, key, val)
        else:
            assign_non_tensor_data(tensor_dict, key, val)
    return tensor_dict


def unwrap_non_tensor_data(data: Any) -> Any:
    """The value inside a ``NonTensorData``; anything else is returned as it is."""
    return data.data if isinstance(data, NonTensorData) else data


def get_non_tensor_data(data: TensorDict, key: str, default: Any) -> Any:
    """``data.get(key, default)``, unwrapped when it is ``NonTensorData`` (a NonTensorStack is returned as it is)."""
    return unwrap_non_tensor_data(data.get(key, default))


# ---------------------------------------------------------------------------------------- building and reading
def get_tensordict(tensor_dict: dict[str, torch.Tensor | list], non_tensor_dict: dict | None = None) -> TensorDict:
    """Build a batch: ``tensor_dict`` maps keys to row-aligned columns, ``non_tensor_dict`` to shared metadata.

    A column is a tensor ``[B, ...]``, a contiguous jagged nested tensor, a ``NonTensorStack``, or a list of ``B``
    Python objects (nested lists and dicts included), stored as a ``NonTensorStack``. Each metadata value is stored
    as ``NonTensorData``. The batch size is ``[B]``, or ``[]`` when there are no columns.

    Raises:
        ProtocolError: columns of different lengths, a list holding tensors, a non-jagged or non-contiguous nested
            tensor, a column of another type, or a key in both dicts."""
    source: dict[str, Any] = {}
    batch_size = None
    for key, val in tensor_dict.items():
        if isinstance(val, list):
            if any(isinstance(item, torch.Tensor) for item in val):
                raise ProtocolError(
                    f"column {key!r} is a list holding torch.Tensors: a list becomes a NonTensorStack, which cannot "
                    "hold tensors; stack them into one tensor, make a jagged nested tensor, or convert them to numpy"
                )
            val = _stack(val)
        elif isinstance(val, torch.Tensor):
            if val.dim() == 0:
                raise ProtocolError(
                    f"column {key!r} is a 0-d tensor: put a value shared by all rows in non_tensor_dict"
                )
            if val.is_nested and not (val.layout == torch.jagged and val.is_contiguous()):
                raise ProtocolError(
                    f"nested tensor {key!r} must be contiguous with layout=torch.jagged (got {val.layout}): build it "
                    "with torch.nested.as_nested_tensor(rows, layout=torch.jagged)"
                )
        elif not isinstance(val, NonTensorStack):
            raise ProtocolError(
                f"column {key!r} is a {type(val).__name__}: columns are tensors, lists or NonTensorStacks "
                "(a value shared by all rows goes in non_tensor_dict)"
            )
        rows = len(val)
        if batch_size is not None and rows != batch_size:
            raise ProtocolError(
                f"column {key!r} has {rows} rows, the columns before it have {batch_size}: every column needs one "
                "entry per row"
            )
        batch_size = rows
        source[key] = val
    for key, val in (non_tensor_dict or {}).items():
        if key in source:
            raise ProtocolError(f"key {key!r} is in both tensor_dict and non_tensor_dict: rename one of them")
        source[key] = NonTensorData(unwrap_non_tensor_data(val))
    return TensorDict(source, batch_size=[] if batch_size is None else [batch_size])


def get(tensordict: TensorDict, key: str, default: Any = None) -> Any:
    """The entry under ``key`` as plain Python (a tensor as it is, a NonTensorStack as a list, NonTensorData
    unwrapped), or ``default`` when the key is missing."""
    if key not in tensordict.keys():
        return default
    return _native(tensordict.get(key))


def pop(tensordict: TensorDict, key: str, default: Any = None) -> Any:
    """Like ``get``, and removes the key from ``tensordict``."""
    if key not in tensordict.keys():
        return default
    return _native(tensordict.pop(key))


def _missing_keys(tensordict: TensorDict, keys: Iterable[str]) -> None:
    for key in keys:
        if key not in tensordict.keys():
            raise KeyError(f"key {key!r} not in tensordict (its keys: {sorted(tensordict.keys())})")


def _rebuild(entries: dict[str, Any]) -> TensorDict:
    """A new batch from ``TensorDict.get`` entries: NonTensorData becomes metadata, the rest columns."""
    columns = {key: _native(val) for key, val in entries.items() if not isinstance(val, NonTensorData)}
    metadata = {key: val.data for key, val in entries.items() if isinstance(val, NonTensorData)}
    return get_tensordict(columns, metadata)


def get_keys(tensordict: TensorDict, keys: Iterable[str]) -> TensorDict:
    """A new batch holding only ``keys`` (built with ``get_tensordict``, so its batch size is ``[]`` when it keeps
    only metadata).

    Raises:
        KeyError: a key is missing."""
    keys = list(keys)
    _missing_keys(tensordict, keys)
    return _rebuild({key: tensordict.get(key) for key in keys})


def pop_keys(tensordict: TensorDict, keys: Iterable[str]) -> TensorDict:
    """Like ``get_keys``, and removes the keys from ``tensordict``.

    Raises:
        KeyError: a key is missing (checked before anything is removed)."""
    keys = list(keys)
    _missing_keys(tensordict, keys)
    return _rebuild({key: tensordict.pop(key) for key in keys})


# ------------------------------------------------------------------------------------- concatenating and splitting
def concat_nested_tensors(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The rows of jagged nested tensors (each contiguous, 2+ dims), one after another: ``[sum(B_i), ...]``.

    The result is ragged along the parts' ragged dim when they agree (torch guesses it when they do not).

    Raises:
        ProtocolError: no tensors, or one that is not a contiguous nested tensor of 2+ dims."""
    if not tensors:
        raise ProtocolError("concat_nested_tensors needs at least one nested tensor")
    for i, tensor in enumerate(tensors):
        if not (_is_nested(tensor) and tensor.is_contiguous()):
            raise ProtocolError(
                f"tensor {i} is not a contiguous nested tensor: build it with "
                "torch.nested.as_nested_tensor(rows, layout=torch.jagged)"
            )
        if tensor.dim() < 2:
            raise ProtocolError(f"nested tensor {i} must have 2 or more dimensions, got shape {tensor.shape}")
    rows = [row for tensor in tensors for row in tensor.unbind(0)]
    ragged = {ragged_dim(tensor) for tensor in tensors}
    if len(ragged) == 1:
        return jagged_from_rows(rows, ragged.pop())
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def concat_tensordict_with_none_bsz(data: list[TensorDict]) -> TensorDict:
    """Concatenate TensorDicts that hold only metadata (batch size ``[]``): the first one is the result.

    Raises:
        ProtocolError: no TensorDicts, or one with a batch dimension."""
    if not data:
        raise ProtocolError("concat_tensordict_with_none_bsz needs at least one TensorDict")
    for i, td in enumerate(data):
        if td.batch_dims:
            raise ProtocolError(f"TensorDict {i} has batch size {list(td.batch_size)}; expected [] (metadata only)")
    return data[0]


def concat_tensordict(data: list[TensorDict]) -> TensorDict:
    """Concatenate batches along dim 0: tensors and NonTensorStacks row after row, jagged nested tensors through
    ``concat_nested_tensors``, metadata (NonTensorData) from the first batch. The inputs are left unchanged.

    Raises:
        ProtocolError: no batches, or batches whose keys (or nested-tensor keys) differ."""
    if not data:
        raise ProtocolError("concat_tensordict needs at least one TensorDict")
    first = data[0]
    if not first.batch_dims:
        return concat_tensordict_with_none_bsz(data)
    keys = set(first.keys())
    nested = {key for key, val in first.items() if _is_nested(val)}
    metadata = [key for key, val in first.items() if isinstance(val, NonTensorData)]
    for i, td in enumerate(data[1:], start=1):
        if set(td.keys()) != keys:
            raise ProtocolError(
                f"TensorDict {i} has keys {sorted(td.keys())}, TensorDict 0 has {sorted(keys)}: "
                "every part needs the same keys"
            )
        td_nested = {key for key, val in td.items() if _is_nested(val)}
        if td_nested != nested:
            raise ProtocolError(
                f"TensorDict {i} has nested tensors {sorted(td_nested)}, TensorDict 0 has {sorted(nested)}: "
                "all tensordicts must have the same set of nested tensors"
            )
    output = TensorDict.cat([td.exclude(*nested, *metadata) for td in data], dim=0)
    for key in nested:
        output[key] = concat_nested_tensors([td.get(key) for td in data])
    for key in metadata:
        output[key] = NonTensorData(first.get(key).data)
    return output


def chunk_tensordict(td: TensorDict, chunks: int) -> list[TensorDict]:
    """Split a batch into ``chunks`` equal parts along dim 0 (views where tensordict gives them).

    Jagged nested tensors of 3+ dims (Qwen-VL's ``position_ids`` ``[B, 4, j]``) are split row by row and rebuilt,
    since ``torch.chunk`` rejects them (https://github.com/pytorch/pytorch/issues/153238, still so in torch 2.13).

    Raises:
        ProtocolError: ``td`` is not a TensorDict with a batch dimension, or ``chunks`` does not divide its rows."""
    _require_tensordict(td, "chunk_tensordict")
    if not td.batch_dims:
        raise ProtocolError("chunk_tensordict needs a TensorDict with a batch dimension, got batch size []")
    if not isinstance(chunks, int) or chunks <= 0 or len(td) % chunks:
        raise ProtocolError(
            f"expecting td with length divisible by chunks, but got {len(td)} and {chunks}: "
            f"pad it first with pad_to_divisor(td, {chunks}), then unpad the merged result"
        )
    size = len(td) // chunks
    jagged_3d = [key for key, val in td.items() if _is_nested(val) and val.dim() >= 3]
    parts = list(td.exclude(*jagged_3d).chunk(chunks))
    for key in jagged_3d:
        tensor = td.get(key)
        rows = tensor.unbind(0)
        for i, part in enumerate(parts):
            part[key] = jagged_from_rows(rows[i * size : (i + 1) * size], ragged_dim(tensor))
    return parts


def index_select_tensor_dict(batch: TensorDict | None, indices: torch.Tensor | list[int]) -> TensorDict | None:
    """The rows ``indices`` (a 1-D int tensor or list) of ``batch``, in that order, as a new TensorDict; ``None``
    for ``None``. Jagged tensors are rebuilt from their rows; metadata (NonTensorData) is kept as it is.

    Raises:
        ProtocolError: ``indices`` is not 1-D or not integers."""
    indices = torch.as_tensor(indices)
    if indices.numel() == 0:
        indices = indices.long()
    if indices.dim() != 1:
        raise ProtocolError(f"indices must be a 1D tensor, got shape {list(indices.shape)}")
    if indices.is_floating_point() or indices.dtype == torch.bool:
        raise ProtocolError(
            f"indices must be integers, got {indices.dtype} (for a mask, pass mask.nonzero().flatten())"
        )
    if batch is None:
        return None
    rows = indices.tolist()
    selected = {}
    for key, val in batch.items():
        if _is_nested(val):
            unbound = val.unbind()  # once, not once per row
            selected[key] = jagged_from_rows([unbound[i] for i in rows], ragged_dim(val))
        elif isinstance(val, NonTensorData):
            selected[key] = NonTensorData(val.data)
        else:
            selected[key] = val[indices]
    return TensorDict(selected, batch_size=[len(rows)], device=batch.device)


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add ``tensor_dict2``'s entries to ``tensor_dict1`` in place and return it; a key in both must hold equal
    values.

    Unlike ``rlworkers.protocol.union_tensor_dict`` (DataProto's batch, tensors only), this takes every entry of
    a verl 0.9 batch: NonTensorData and NonTensorStack are compared by value (as DataProto compares its
    non-tensor columns), jagged tensors row by row; new entries keep their wrapping.

    Raises:
        ProtocolError: the batch sizes differ, or a key in both holds different values."""
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise ProtocolError(
            f"Two tensor dict must have identical batch size. Got {list(tensor_dict1.batch_size)} and "
            f"{list(tensor_dict2.batch_size)}"
        )
    for key in tensor_dict2.keys():
        incoming = tensor_dict2.get(key)
        if key not in tensor_dict1.keys():
            tensor_dict1[key] = incoming
            continue
        why = _difference(tensor_dict1.get(key), incoming)
        if why is not None:
            raise ProtocolError(f"cannot union: {key!r} differs between the two TensorDicts ({why}); pop or rename one")
    return tensor_dict1


def make_iterator(
    tensordict: TensorDict,
    mini_batch_size: int,
    epochs: int,
    seed: int | None = None,
    dataloader_kwargs: dict | None = None,
) -> Iterator[TensorDict]:
    """Mini-batches of ``mini_batch_size`` rows, ``epochs`` passes over the batch. ``dataloader_kwargs`` go to the
    ``torch.utils.data.DataLoader`` over row indices (``{"shuffle": True}``); ``seed`` fixes its shuffling.

    Raises:
        ProtocolError: ``mini_batch_size`` does not divide the rows, or ``dataloader_kwargs`` is not a dict."""
    rows = tensordict.batch_size[0]
    if mini_batch_size <= 0 or rows % mini_batch_size:
        raise ProtocolError(
            f"{rows} % {mini_batch_size} != 0: the rows must be a multiple of mini_batch_size "
            "(pad with pad_to_divisor or pick another mini_batch_size)"
        )
    if dataloader_kwargs is not None and not isinstance(dataloader_kwargs, dict):
        raise ProtocolError(f"dataloader_kwargs must be a dict, got {type(dataloader_kwargs).__name__}")
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    loader = DataLoader(
        torch.arange(rows), batch_size=mini_batch_size, generator=generator, **(dataloader_kwargs or {})
    )

    def mini_batches() -> Iterator[TensorDict]:
        for _ in range(epochs):
            for indices in loader:
                yield index_select_tensor_dict(tensordict, indices)

    return mini_batches()


def assert_tensordict_eq(tensordict1: TensorDict, tensordict2: TensorDict) -> None:
    """Check that two batches hold the same keys with equal values (jagged tensors row by row, non-tensor entries
    by value).

    Raises:
        ProtocolError: the first difference found, naming the key."""
    keys1, keys2 = set(tensordict1.keys()), set(tensordict2.keys())
    if keys1 != keys2:
        raise ProtocolError(
            f"key set diffs: only in the first {sorted(keys1 - keys2)}, only in the second {sorted(keys2 - keys1)}"
        )
    for key in tensordict1.keys():
        why = _difference(tensordict1.get(key), tensordict2.get(key))
        if why is not None:
            raise ProtocolError(f"the TensorDicts differ at {key!r}: {why}")


# ------------------------------------------------------------------------------------------- padding and layout
def pad_to_divisor(data: TensorDict, size_divisor: int) -> tuple[TensorDict, int]:
    """Repeat rows from the start until the row count is a multiple of ``size_divisor``: ``(padded, pad_size)``.
    ``data`` itself comes back when no row is needed. ``unpad(padded, pad_size)`` undoes it.

    Raises:
        ProtocolError: ``data`` is not a TensorDict, or ``size_divisor`` is not a positive int."""
    _require_tensordict(data, "pad_to_divisor")
    if not isinstance(size_divisor, int) or size_divisor <= 0:
        raise ProtocolError(f"size_divisor must be a positive int, got {size_divisor!r}")
    rows = len(data)
    if rows == 0:
        logger.warning("padding a TensorDict with no rows: nothing to repeat, returned unchanged")
        return data, 0
    pad_size = -rows % size_divisor
    if pad_size == 0:
        return data, 0
    return index_select_tensor_dict(data, torch.arange(rows + pad_size) % rows), pad_size


def unpad(data: TensorDict, pad_size: int) -> TensorDict:
    """Drop the last ``pad_size`` rows (what ``pad_to_divisor`` added); ``data`` itself when ``pad_size`` is 0.

    Raises:
        ProtocolError: ``pad_size`` is negative or larger than the row count."""
    if not 0 <= pad_size <= len(data):
        raise ProtocolError(f"pad_size must be between 0 and the {len(data)} rows, got {pad_size}")
    return data[:-pad_size] if pad_size else data


def contiguous(data: TensorDict) -> TensorDict:
    """A new TensorDict with every tensor made contiguous (what ``consolidate`` needs); NonTensorData and
    NonTensorStack entries kept as they are (``TensorDict.contiguous`` would turn the batch into a stack).

    Raises:
        ProtocolError: an entry that is neither a tensor nor non-tensor data."""
    entries = {}
    for key, val in data.items():
        if isinstance(val, (NonTensorData, NonTensorStack)):
            entries[key] = val
        elif isinstance(val, torch.Tensor):
            entries[key] = val.contiguous()
        else:
            raise ProtocolError(f"Expect {key!r} to be a torch.Tensor or non-tensor data. Got {type(val).__name__}")
    return TensorDict(entries, batch_size=data.batch_size, device=data.device)


def maybe_fix_3d_position_ids(data: TensorDict) -> None:
    """Set a 3-D jagged ``position_ids``' ragged dim back to 2 (``[B, 4, j]``), in place.

    verl calls it on a batch that went through ``consolidate`` and pickling, after which (tensordict <= 0.10) the
    tensor lost its ragged dim and indexing failed. tensordict 0.15 keeps it, so here it only matters for ported
    code; a tensor already ragged along dim 2 is left as it is."""
    position_ids = data.get("position_ids", None)
    if _is_nested(position_ids) and position_ids.dim() == 3:
        position_ids._ragged_idx = 2
