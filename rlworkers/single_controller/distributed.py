"""torch.distributed set-up for workers: gloo on CPU, nccl on CUDA, chosen by config or by the device.

Workers started by a WorkerGroup already have the rendezvous environment (see ``base/worker.py``), so joining the
world is one call: ``init_process_group()``.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def default_backend(device: str | None = None) -> str:
    """``nccl`` for CUDA devices, ``gloo`` otherwise."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return "nccl" if device.startswith("cuda") else "gloo"


def init_process_group(backend: str | None = None, timeout_s: float = 300.0) -> str:
    """Join the default process group once per process; later calls return the backend in use."""
    if dist.is_initialized():
        return dist.get_backend()
    backend = backend or default_backend()
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend 'nccl' needs CUDA, and none is available here; use backend='gloo' on CPU")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return backend


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
