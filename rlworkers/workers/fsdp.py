"""FSDP2 (``strategy: fsdp2``): a model's parameters, gradients and optimizer state sharded over the workers' process
group with torch's ``fully_shard``, and what the workers need around it.

* ``shard_model``: each decoder layer one unit (the model's ``_no_split_modules``, or ``fsdp_config.wrap_policy``),
  then the root (embeddings, final norm, head); ``model.autocast`` becomes the ``MixedPrecisionPolicy`` (compute in
  bf16/fp16, gradients reduced in float32, float32 master shards), ``offload_policy`` FSDP2's ``CPUOffloadPolicy``.
  Every collective below is called by every rank in the same order: the single controller calls every worker.
* ``gathered``: HF generation on the policy's parameters gathered once per call (no collective per token, so each
  rank stops when its own rows end); ``fsdp_config.gather_for_generation=false`` generates a layer at a time instead.
* ``full_weights``: the whole model one tensor at a time (each gathered from its shards and dropped before the
  next), for vLLM's ``load_weights``: no second full model in one process.
* ``save_sharded`` / ``load_sharded``: ``torch.distributed.checkpoint`` (each rank writes its own shard; a checkpoint
  saved by N workers loads on M, DCP reshards) through fsspec, so local paths and ``s3://`` work alike. DCP's
  ``.metadata`` file is a pickle: it is read with an unpickler that builds DCP's own metadata classes and nothing
  else (the tensor files are read by DCP with ``torch.load(weights_only=True)``).
* ``full_state_dict``: the whole model gathered on rank 0 once, for the published HF folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import pickle
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter  # not re-exported in 2.13
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rlworkers.workers.config import FSDPConfig

SHARDS = "shards"  # a sharded checkpoint's torch.distributed.checkpoint folder, inside the role's


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def shard_model(
    model: torch.nn.Module, config: FSDPConfig, device: str, compute_dtype: torch.dtype | None
) -> torch.nn.Module:
    """``model`` (whole, on the CPU) sharded in place over the default process group; returns it."""
    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    unit_classes = set(config.wrap_policy or getattr(model, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in unit_classes]
    if not layers:
        raise ValueError(
            f"fsdp_config.wrap_policy: {type(model).__name__} has no module of the classes {sorted(unit_classes)}; "
            "name its decoder layer class (e.g. [LlamaDecoderLayer])"
        )
    settings = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        if compute_dtype is not None
        else MixedPrecisionPolicy(),
        "offload_policy": CPUOffloadPolicy() if config.offload_policy else OffloadPolicy(),
        "reshard_after_forward": config.reshard_after_forward,
    }
    for layer in layers:
        fully_shard(layer, **settings)
    fully_shard(model, **settings)
    model._rlflow_reshard_after_forward = config.reshard_after_forward  # what gathered() restores
    return model


@contextlib.contextmanager
def gathered(model: torch.nn.Module):
    """Inside, a sharded ``model``'s parameters stay gathered after its first forward (in the compute dtype), so
    each rank generates on its own, with no collective per token and however many tokens its rows take; outside, they
    are sharded again. A plain model: nothing."""
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    if not units:
        yield
        return
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            if unit is not model:  # the root never reshards after forward (FSDP2 sets it so at its first forward)
                unit.set_reshard_after_forward(model._rlflow_reshard_after_forward, recurse=False)


def full_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, whole tensor)`` of ``model``'s state dict, one at a time (a collective per sharded tensor: every rank
    must consume the whole iterator)."""
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, DTensor):
            tensor = tensor.to(tensor.device_mesh.device_type).full_tensor()  # an offloaded shard gathers on device
        yield name, tensor.detach()


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model on rank 0's CPU (an empty dict elsewhere); every rank calls it. A tied parameter (SmolLM2's
    lm_head is its embedding) appears once, under its first name, as ``save_pretrained`` writes an unsharded one."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    first_names = {name for name, _ in model.named_parameters()}
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - first_names
    return {name: tensor for name, tensor in state.items() if name not in tied}


def save_sharded(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Every rank writes its shard of the model (and of the optimizer state) under ``path`` (any fsspec path)."""
    dcp.save(_state(model, optimizer), storage_writer=FsspecWriter(path))


def load_sharded(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """The state ``save_sharded`` wrote, resharded to this group's size when it differs."""
    state = _state(model, optimizer)  # the templates: this group's shapes and placements
    dcp.load(state, storage_reader=MetadataCheckingReader(path))
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _state(model, optimizer) -> dict:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optimizer_state = get_state_dict(model, optimizer)  # an unstepped optimizer gets its state made
    return {"model": model_state, "optimizer": optimizer_state}


# ---------------------------------------------------------------------------------------------- DCP's metadata
def _allowed_globals() -> dict[tuple[str, str], object]:
    allowed = {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
    }
    for name, value in vars(dcp_metadata).items():
        if (isinstance(value, type) and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum))) or (
            name == "_MEM_FORMAT_ENCODING"
        ):
            allowed[(dcp_metadata.__name__, name)] = value
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    import pathlib

    for name in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
        allowed[("pathlib", name)] = getattr(pathlib, name)
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    allowed = _allowed_globals()

    def find_class(self, module: str, name: str):
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"checkpoint metadata refers to {module}.{name}, which is not part of torch.distributed.checkpoint's "
                "metadata: refusing to load it (the file was not written by DCP, or was tampered with)"
            ) from None


class MetadataCheckingReader(FsspecReader):
    """DCP's fsspec reader, its ``.metadata`` pickle read by ``_MetadataUnpickler``."""

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
