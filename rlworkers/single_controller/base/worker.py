"""Worker: the base class of every role (actor, rollout, critic, reward, ...) run by a WorkerGroup.

A WorkerGroup starts each worker with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` in its environment; ``Worker.__init__`` reads them.

Rendezvous without a port race: rank 0 starts torch's TCPStore on port 0 (the kernel picks a free port and the
socket stays bound), and the group hands that port to the other ranks when it creates them. With
``TORCHELASTIC_USE_AGENT_STORE=True`` every rank's ``init_process_group(init_method="env://")`` connects to that
store as a client, exactly as under torchrun's agent, so user code that calls
``torch.distributed.init_process_group()`` itself keeps working.
"""

from __future__ import annotations

import os

import torch

_ENV_KEYS = ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_RENDEZVOUS_STORE = None  # one per process: colocated roles share it


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def _start_rendezvous_store(world_size: int) -> tuple[str, int]:
    global _RENDEZVOUS_STORE
    if _RENDEZVOUS_STORE is None:
        host = _node_ip()
        _RENDEZVOUS_STORE = torch.distributed.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False)
        os.environ["MASTER_ADDR"] = host
        os.environ["MASTER_PORT"] = str(_RENDEZVOUS_STORE.port)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    os.environ.setdefault("TORCHELASTIC_RESTART_COUNT", "0")
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


class Worker:
    """Base class for workers. Outside a WorkerGroup it behaves as rank 0 of a world of 1."""

    def __init__(self, cuda_visible_devices: str | None = None):
        self._rank = int(os.environ.get("RANK", 0))
        self._world_size = int(os.environ.get("WORLD_SIZE", 1))
        self._local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self._local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if cuda_visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        if self._rank == 0 and not os.environ.get("MASTER_PORT"):  # a group's rank 0 gets it empty: see below
            _start_rendezvous_store(self._world_size)
        elif os.environ.get("MASTER_PORT"):
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
            os.environ.setdefault("TORCHELASTIC_RESTART_COUNT", "0")
        self._master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        self._master_port = os.environ.get("MASTER_PORT")

    @classmethod
    def env_keys(cls) -> list[str]:
        return list(_ENV_KEYS)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_rank(self) -> int:
        return self._local_rank

    def get_master_addr_port(self) -> tuple[str, str | None]:
        return self._master_addr, self._master_port

    def get_cuda_visible_devices(self) -> str:
        return os.environ.get("CUDA_VISIBLE_DEVICES", "not set")

    def describe_process(self) -> dict:
        """pid, node and log file of this worker's process (the controller names them when it fails)."""
        import ray

        try:
            log_file = os.readlink("/proc/self/fd/1")  # Ray points a worker's stdout at its log file
        except OSError:
            log_file = None
        return {"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "log_file": log_file if log_file and log_file.startswith("/") else None}

    def getenv(self, key: str) -> str | None:
        return os.environ.get(key)

    def execute_with_func_generator(self, func, *args, **kwargs):
        """Run ``func(self, *args, **kwargs)`` (the worker side of DP_COMPUTE_PROTO_WITH_FUNC)."""
        return func(self, *args, **kwargs)

    def init_process_group(self, backend: str | None = None, timeout_s: float = 300.0) -> str:
        """Join this group's torch.distributed world (gloo on CPU, nccl when CUDA is used). Returns the backend."""
        from rlworkers.single_controller.distributed import init_process_group

        return init_process_group(backend=backend, timeout_s=timeout_s)

