"""Worker: the base class of every role (actor, rollout, critic, reward, ...) run by a WorkerGroup.

A WorkerGroup starts each worker with verl's environment: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``WG_PREFIX``, ``WG_BACKEND=ray``, ``RAY_LOCAL_WORLD_SIZE`` (workers on this node), and
``LOCAL_RANK=0``, ``LOCAL_WORLD_SIZE=1``: Ray shows each GPU actor only its own GPU, so its device is ``cuda:0``
(unless ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` is set: then ``LOCAL_RANK`` is the GPU Ray assigned).
``Worker.__init__`` reads them.

Rendezvous without a port race: rank 0 starts torch's TCPStore on port 0 (the kernel picks a free port and the
socket stays bound) at the start of its ``__init__`` and publishes it; the group hands that port to the other
ranks when it creates them, so a subclass may join the process group (or build a device mesh) in ``__init__``. With
``TORCHELASTIC_USE_AGENT_STORE=True`` every rank's ``init_process_group(init_method="env://")`` connects to that
store as a client, exactly as under torchrun's agent, so user code that calls
``torch.distributed.init_process_group()`` itself keeps working.
"""

from __future__ import annotations

import ctypes
import gc
import os
import time

import torch

from rlworkers.process_start import resume_gc
from rlworkers.single_controller.base.decorator import Dispatch, Execute, register

_ENV_KEYS = ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_RENDEZVOUS_STORE = None  # one per process: colocated roles share it
# Rank 0 publishes its store's "host:port" under this key in Ray's KV store as soon as Worker.__init__ binds it:
# the rest of a subclass's __init__ may call init_process_group, which waits for ranks not yet started.
RENDEZVOUS_KEY_ENV = "RLFLOW_RENDEZVOUS_KEY"
# The environment this process started with (a group's worker: Ray's, plus the group's per-rank variables): where a
# worker built again in the same process (``Worker.reinitialize``) starts from, whatever the one before changed.
_PROCESS_ENV = dict(os.environ)
# the controller's working directory, given to a worker that runs in a Ray started elsewhere (a local Ray that
# outlives the runs, a cluster), where a process starts in the Ray's own directory
WORKING_DIR_ENV = "RLFLOW_WORKING_DIR"


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def _assigned_gpu() -> int:
    import ray

    gpu_ids = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
    if not gpu_ids:
        raise RuntimeError(
            "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES is set but Ray assigned this worker no GPU; "
            "unset it, or give the worker a GPU (RayResourcePool(..., use_gpu=True))"
        )
    return int(gpu_ids[0])


def _start_rendezvous_store(world_size: int) -> tuple[str, int]:
    global _RENDEZVOUS_STORE
    if _RENDEZVOUS_STORE is None:
        host = _node_ip()
        _RENDEZVOUS_STORE = torch.distributed.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False)
        os.environ["MASTER_ADDR"] = host
        os.environ["MASTER_PORT"] = str(_RENDEZVOUS_STORE.port)
        if os.environ.get(RENDEZVOUS_KEY_ENV):  # the other ranks wait for it (_await_rendezvous_store)
            from ray.experimental.internal_kv import _internal_kv_put

            _internal_kv_put(os.environ[RENDEZVOUS_KEY_ENV], f"{host}:{_RENDEZVOUS_STORE.port}")
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    os.environ.setdefault("TORCHELASTIC_RESTART_COUNT", "0")
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def _await_rendezvous_store(key: str, timeout_s: float = 600.0, poll_s: float = 0.02, max_poll_s: float = 0.25) -> None:
    """A group's rank > 0: the address rank 0's store was bound to, once rank 0 publishes it under ``key`` (the
    group starts every rank at once; each waits only here, for rank 0's process to get this far). The poll backs off
    to ``max_poll_s``: each is a request to Ray's GCS, which rank 0 (still importing) competes with for the CPU."""
    from ray.experimental.internal_kv import _internal_kv_get

    deadline = time.monotonic() + timeout_s
    while (published := _internal_kv_get(key)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 of this worker group published no rendezvous address within {timeout_s:.0f} s")
        time.sleep(poll_s)
        poll_s = min(2 * poll_s, max_poll_s)
    host, port = published.decode().rsplit(":", 1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, port


class Worker:
    """Base class for workers. Outside a WorkerGroup it behaves as rank 0 of a world of 1."""

    def __init__(self, cuda_visible_devices: str | None = None):
        resume_gc()  # the imports of this process are done (rlworkers/process_start.py)
        if os.environ.get(WORKING_DIR_ENV):  # relative paths mean what they mean to the controller
            os.chdir(os.environ[WORKING_DIR_ENV])
        self._rank = int(os.environ.get("RANK", 0))
        self._world_size = int(os.environ.get("WORLD_SIZE", 1))
        if os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"):  # every GPU is visible: pick Ray's
            os.environ["LOCAL_RANK"] = str(_assigned_gpu())
        if cuda_visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        if self._rank == 0 and not os.environ.get("MASTER_PORT"):  # a group's rank 0 gets it empty: see below
            _start_rendezvous_store(self._world_size)
        else:
            if not os.environ.get("MASTER_PORT") and os.environ.get(RENDEZVOUS_KEY_ENV):
                _await_rendezvous_store(os.environ[RENDEZVOUS_KEY_ENV])
            if os.environ.get("MASTER_PORT"):
                os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
                os.environ.setdefault("TORCHELASTIC_RESTART_COUNT", "0")
        self._master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        self._master_port = os.environ.get("MASTER_PORT")
        self.__dispatch_dp_rank: dict[str, int] = {}
        self.__collect_dp_rank: dict[str, bool] = {}
        self.fused_worker_dict: dict[str, Worker] = {}  # the roles colocated with this one (ray/colocate.py)

    # --------------------------------------------------------------------------------- reuse of the process
    def end_for_reuse(self) -> None:
        """Drop this worker's state (model, optimizer, engine, caches) and leave its torch.distributed world: the
        process then waits, idle, for ``reinitialize``. A module-level cache of what a constructor argument names
        outlives it: key it by what can change (rlworkers/workers/reward.py keys reward files by their mtime)."""
        global _RENDEZVOUS_STORE
        from rlworkers.single_controller.distributed import destroy_process_group

        self.__dict__.clear()
        destroy_process_group()
        _RENDEZVOUS_STORE = None
        gc.collect()
        try:  # give the freed heap back to the system: an idle process should not hold a model's worth
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass

    def reinitialize(self, env: dict[str, str], args: tuple, kwargs: dict) -> None:
        """Become a new worker of this class, built with ``args`` and ``kwargs``, as one in a new process started
        with this one's environment updated by ``env`` would be (the group's new rendezvous): what a group whose
        processes are reused (``RayWorkerGroup.reinitialize``) asks every rank."""
        self.end_for_reuse()
        os.environ.clear()
        os.environ.update(_PROCESS_ENV)
        os.environ.update(env)
        type(self).__init__(self, *args, **kwargs)

    def modules_changed(self) -> list[str]:
        """Files of modules this process imported that changed on disk since it started: it is not reused then
        (``RayWorkerGroup.reinitialize``), a new process runs the code as it is now."""
        from rlworkers.loading import modules_changed_since_start

        return modules_changed_since_start()

    @classmethod
    def env_keys(cls) -> list[str]:
        return list(_ENV_KEYS)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

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
        return {
            "pid": os.getpid(),
            "node_ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "log_file": log_file if log_file and log_file.startswith("/") else None,
        }

    def getenv(self, key: str) -> str | None:
        return os.environ.get(key)

    def get_fused_worker_by_name(self, worker_name: str) -> "Worker | None":
        """The colocated role ``worker_name`` (``create_colocated_worker_raw_cls``), or None."""
        return self.fused_worker_dict.get(worker_name)

    # --------------------------------------------------------------------------------- nd dispatch (verl's API)
    def _register_dispatch_collect_info(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        """Declare this rank's dp rank in the device mesh ``mesh_name`` and whether it is its dp group's collector
        (the one rank whose output the controller keeps), for ``make_nd_compute_dataproto_dispatch_fn``."""
        if mesh_name in self.__dispatch_dp_rank:
            raise ValueError(f"mesh {mesh_name!r} is already registered on this worker; register each mesh once")
        self.__dispatch_dp_rank[mesh_name] = dp_rank
        self.__collect_dp_rank[mesh_name] = is_collect

    def _require_mesh(self, mesh_name: str) -> None:
        if mesh_name not in self.__dispatch_dp_rank:
            raise ValueError(
                f"mesh {mesh_name!r} is not registered on {type(self).__name__} rank {self.rank} (registered: "
                f"{sorted(self.__dispatch_dp_rank)}); call self._register_dispatch_collect_info({mesh_name!r}, "
                "dp_rank=..., is_collect=...) where the device mesh is built"
            )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_dispatch_info(self, mesh_name: str) -> int:
        self._require_mesh(mesh_name)
        return self.__dispatch_dp_rank[mesh_name]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_collect_info(self, mesh_name: str) -> bool:
        return self.query_collect_info(mesh_name)

    def query_collect_info(self, mesh_name: str) -> bool:
        self._require_mesh(mesh_name)
        return self.__collect_dp_rank[mesh_name]

    def get_dispatch_collect(self) -> dict[str, dict]:
        return {"dispatch_dp_rank": dict(self.__dispatch_dp_rank), "collect_dp_rank": dict(self.__collect_dp_rank)}

    def set_dispatch_collect(
        self, mesh_name: str, dispatch_dp_rank: dict[str, int], collect_dp_rank: dict[str, bool]
    ) -> None:
        """Register, under ``mesh_name``, the one mesh of another worker's ``get_dispatch_collect()`` (an outer
        worker exposing an inner one: ``self.set_dispatch_collect("ref", **self.ref.get_dispatch_collect())``)."""
        if len(dispatch_dp_rank) != 1 or len(collect_dp_rank) != 1:
            raise ValueError(
                f"set_dispatch_collect({mesh_name!r}) copies exactly one mesh; got dispatch meshes "
                f"{sorted(dispatch_dp_rank)} and collect meshes {sorted(collect_dp_rank)}"
            )
        (dp_rank,), (is_collect,) = dispatch_dp_rank.values(), collect_dp_rank.values()
        self._register_dispatch_collect_info(mesh_name, dp_rank, is_collect)

    # --------------------------------------------------------------------------------- driver functions
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def execute_with_func_generator(self, func, *args, **kwargs):
        """Run ``func(self, *args, **kwargs)`` on every rank's chunk: ``group.execute_with_func_generator(f, data)``."""
        return func(self, *args, **kwargs)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def execute_func_rank_zero(self, func, *args, **kwargs):
        """Run ``func(*args, **kwargs)`` on rank 0: ``group.execute_func_rank_zero(f, ...)`` returns its result."""
        return func(*args, **kwargs)

    def init_process_group(self, backend: str | None = None, timeout_s: float = 300.0) -> str:
        """Join this group's torch.distributed world (gloo on CPU, nccl when CUDA is used). Returns the backend."""
        from rlworkers.single_controller.distributed import init_process_group

        return init_process_group(backend=backend, timeout_s=timeout_s)
