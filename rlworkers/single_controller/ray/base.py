"""The Ray backend's core: RayClassWithInitArgs (actor factory) and RayWorkerGroup (one worker class's actors,
its registered methods bound as distributed calls, time limits, restarts). ~500 lines because the group is one
concept: placing, calling, recovering and verl's keywords all act on the same actors.

Names and signatures follow ``verl.single_controller.ray`` so that a verl worker ports by changing imports.
Placement groups: ``placement.py``; how a group travels to the task host: ``group_transport.py``; verl's pool
helpers that no flow uses (split, merge, pools by role): ``verl_compat.py``; colocation (several roles in one
actor): ``colocate.py``.
"""

from __future__ import annotations

import collections
import copy
import inspect
import math
import threading
import time
import uuid
from typing import Any, Callable

import numpy as np
import ray
import torch
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from tensordict import TensorDict

from rlworkers.protocol import DataProto
from rlworkers.single_controller.base.decorator import (
    DROP_OUTPUT_KEY,
    WITH_LEN_KEY,
    Execute,
    collect_dp_compute_data_proto,
)
from rlworkers.single_controller.base.worker import RENDEZVOUS_KEY_ENV
from rlworkers.single_controller.base.worker_group import ClassWithInitArgs, WorkerGroup
from rlworkers.single_controller.errors import (
    PlacementError,
    StageTimeout,
    StaleProcessError,
    WorkerError,
    WorkerProcess,
    get_with_rank,
)
from rlworkers.single_controller.futures import DataProtoFuture
from rlworkers.single_controller.ray import progress
from rlworkers.single_controller.ray.group_transport import reduce_group
from rlworkers.single_controller.ray.placement import RayResourcePool, _placed, _resources


def _published_rendezvous(
    constructed, key: str, cls_name: str, poll_s: float = 0.02, max_poll_s: float = 0.25
) -> tuple[str, str]:
    """The "host:port" rank 0 publishes when its Worker.__init__ binds the store (see base/worker.py), read
    while the rest of its __init__ may still run (``constructed``: the ref that resolves when rank 0's constructor
    ends); a failed constructor raises WorkerError for rank 0. The key stays until every rank has read it (the group
    deletes it). The poll backs off to ``max_poll_s``: this runs at Ray's driver priority (nice 0) while the workers
    it waits for import at Ray's worker niceness (15), and through Ray Client each poll is a request to its server."""
    from ray.experimental.internal_kv import _internal_kv_get

    while True:
        published = _internal_kv_get(key)
        if published is not None:
            host, port = published.decode().rsplit(":", 1)
            return host, port
        done, _ = ray.wait([constructed], timeout=poll_s)
        poll_s = min(2 * poll_s, max_poll_s)
        if done:
            try:
                ray.get(constructed)
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as error:
                raise WorkerError(0, f"{cls_name}.__init__", error) from error
            if _internal_kv_get(key) is None:
                raise RuntimeError(
                    f"{cls_name}.__init__ finished without calling Worker.__init__, so rank 0 bound "
                    "no rendezvous store: call super().__init__() first in __init__"
                )


class RayClassWithInitArgs(ClassWithInitArgs):
    """A worker class (plain or ``ray.remote``) and its constructor arguments; calling it starts an actor."""

    def __init__(self, cls, *args, **kwargs):
        super().__init__(cls, *args, **kwargs)
        self.user_cls = getattr(cls, "__ray_actor_class__", cls)
        self._actor_cls = cls if hasattr(cls, "__ray_actor_class__") else None
        self._options: dict[str, Any] = {}
        self._additional_resource: dict[str, float] = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_actor_cls": None}  # the Ray actor class is rebuilt where it is needed

    def update_options(self, options: dict) -> None:
        self._options.update(options)

    def set_additional_resource(self, additional_resource: dict) -> None:
        self._additional_resource = dict(additional_resource)

    def __call__(
        self,
        placement_group: PlacementGroup,
        placement_group_bundle_idx: int,
        use_gpu: bool = True,
        num_gpus: float = 1,
        num_cpus: float = 1,
        env_vars: dict | None = None,
        name: str | None = None,
        detached: bool = False,
    ):
        options = copy.deepcopy(self._options)
        runtime_env = options.pop("runtime_env", {}) or {}
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **(env_vars or {})}
        options.update(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=placement_group_bundle_idx
            ),
            runtime_env=runtime_env,
            num_cpus=num_cpus,
            num_gpus=num_gpus if use_gpu else 0,
        )
        if self._additional_resource:
            options["resources"] = dict(self._additional_resource)
        if name:
            options["name"] = name
        if detached:
            options["lifetime"] = "detached"
        if self._actor_cls is None:
            self._actor_cls = ray.remote(self.user_cls)
        return self._actor_cls.options(**options).remote(*self.args, **self.kwargs)


def func_generator(
    worker_group: "RayWorkerGroup",
    method_name: str,
    dispatch_fn: Callable,
    collect_fn: Callable,
    execute_mode,
    blocking: bool,
) -> Callable:
    """The controller-side method: dispatch -> run on the ranks -> (wait) -> collect."""
    returns_data_proto = collect_fn is collect_dp_compute_data_proto or hasattr(collect_fn, "collect_ranks")
    chain_as_future = not blocking and returns_data_proto

    def call(*args, **kwargs):
        rows = _rows(args, kwargs)
        args, kwargs = dispatch_fn(worker_group, *args, **kwargs)
        ranks = list(range(worker_group.world_size)) if execute_mode is Execute.ALL else [0]
        kept = ranks  # the ranks whose outputs collect_fn merges, in its order
        if execute_mode is Execute.ALL and hasattr(collect_fn, "collect_ranks"):
            kept = collect_fn.collect_ranks(worker_group)
        refs = worker_group._execute_per_rank(
            method_name, args, kwargs, ranks, return_len=chain_as_future, drop_output=set(ranks) - set(kept)
        )
        if chain_as_future:
            kept_refs = [refs[ranks.index(rank)] for rank in kept]
            return DataProtoFuture([r[0] for r in kept_refs], [r[1] for r in kept_refs], method=method_name, ranks=kept)
        if not blocking:
            return refs if execute_mode is Execute.ALL else refs[0]
        outputs = worker_group._collect(refs, ranks, method_name, rows)  # every rank: its errors surface
        if execute_mode is Execute.RANK_ZERO:
            return collect_fn(worker_group, outputs[0])
        return collect_fn(worker_group, [outputs[rank] for rank in kept])

    call.__name__ = call.__qualname__ = method_name
    return call


def _rows(args: tuple, kwargs: dict) -> int:
    """Rows of the first batch argument of a call (0 if it has none, or if it is a future whose lengths are
    still remote): what its time limit scales with."""
    for value in [*args, *kwargs.values()]:
        if isinstance(value, (DataProto, TensorDict)):
            return len(value)
    return 0


# One call's submits to its ranks, never interleaved with another call's from this process: Ray runs an actor's calls
# from one process in the order they were submitted, so every rank then runs the calls in the same order. Stage tasks
# call the same group from several threads at once, and ranks running them in different orders would pair one call's
# collectives (a sharded model's forward, gathering its weights) with another's: a silent mix when the shapes agree.
SUBMITTING = threading.Lock()
SLOWEST_FACTOR = 3.0  # a call's time limit is at least this many times its method's slowest earlier call (per row)
# a call whose ranks keep working past its limit gets more windows of it: 10, or as many as make 10 minutes
MAX_WINDOWS, MIN_PATIENCE_S = 10, 600.0
PROTECTED_ENV = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "WG_PREFIX",
    "WG_BACKEND",
    "RAY_LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)  # set per worker by the group


def _check_verl_options(pool, use_gpu, device_name, master_addr, master_port, profile_steps, worker_nsight_options):
    if use_gpu and pool is not None and not pool.use_gpu:
        raise ValueError("use_gpu=True needs a resource pool with GPUs: RayResourcePool(..., use_gpu=True)")
    if device_name not in ("cuda", "cpu"):
        raise ValueError(f"device_name={device_name!r} is not supported; use 'cuda' or 'cpu'")
    if master_addr is not None or master_port is not None:
        raise ValueError(
            "master_addr/master_port cannot be pinned: rank 0 binds a free port itself and the group "
            "hands it to the other ranks (no port race); drop both arguments"
        )
    if profile_steps or worker_nsight_options:
        raise ValueError(
            "nsight profiling (profile_steps, worker_nsight_options) is not supported; drop both "
            "arguments, or profile a worker with nsys through ray_cls_with_init.update_options"
        )


class RayWorkerGroup(WorkerGroup):
    """Ray actors of one worker class placed on a RayResourcePool, with the class's registered methods bound.

    Blocking calls have a time limit when one is set (``set_call_timeout``): ranks that do not answer in time are
    killed and the call raises ``StageTimeout``. ``unresponsive_ranks`` and ``restart`` let a controller find
    dead or hung ranks after a failure and replace the group's actors in the same placement.
    """

    def __init__(
        self,
        resource_pool: RayResourcePool | None = None,
        ray_cls_with_init: RayClassWithInitArgs = None,
        bin_pack: bool = True,
        name_prefix: str | None = None,
        detached: bool = False,
        worker_names: list[str] | None = None,
        worker_handles: list | None = None,
        ray_wait_register_center_timeout: int = 300,
        *,
        worker_env: dict[str, str] | None = None,
        use_gpu: bool | None = None,
        device_name: str = "cuda",
        master_addr: str | None = None,
        master_port: str | None = None,
        profile_steps: list | None = None,
        worker_nsight_options: dict | None = None,
    ):
        """verl's signature. ``worker_env`` adds environment variables to every worker (not the ones the group
        sets: ``PROTECTED_ENV``); ``use_gpu`` (default: the pool's) and ``device_name`` ("cuda" or "cpu") decide
        whether each actor takes its share of a GPU. ``ray_wait_register_center_timeout`` is accepted and unused
        (rlflow has no register center). ``master_addr``/``master_port`` and nsight profiling are not supported."""
        super().__init__(resource_pool)
        if ray_cls_with_init is None:
            raise ValueError("RayWorkerGroup needs ray_cls_with_init=RayClassWithInitArgs(cls=YourWorker, ...)")
        _check_verl_options(
            resource_pool, use_gpu, device_name, master_addr, master_port, profile_steps, worker_nsight_options
        )
        clash = set(PROTECTED_ENV) & set(worker_env or {})
        if clash:
            raise ValueError(f"worker_env may not set {sorted(clash)}: the worker group sets them")
        self.ray_cls_with_init = ray_cls_with_init
        self.call_timeout_s: float | None = None
        self.call_timeout_s_per_row = 0.0
        self._worker_processes: list[WorkerProcess | None] = []
        self._bin_pack, self._detached, self._worker_env = bin_pack, detached, dict(worker_env or {})
        if use_gpu is None:
            use_gpu = resource_pool is not None and resource_pool.use_gpu
        self.use_gpu = use_gpu
        self.device_name = device_name
        self.name_prefix = name_prefix if name_prefix is not None else f"{uuid.uuid4().hex[:6]}_"
        self.resource_pool = resource_pool
        if worker_handles is not None:
            self._workers = list(worker_handles)
            self._worker_names = list(worker_names or [])
            self._worker_processes = [None] * len(self._workers)
        elif worker_names is not None:
            self._workers = [ray.get_actor(name) for name in worker_names]
            self._worker_names = list(worker_names)
            self._worker_processes = [None] * len(self._workers)
        elif resource_pool is not None:
            self._init_with_resource_pool(resource_pool, bin_pack, detached, self._worker_env)
        else:
            raise ValueError("RayWorkerGroup needs a resource_pool, worker_names or worker_handles")
        self._bind_worker_method(ray_cls_with_init.user_cls, func_generator)

    @classmethod
    def from_detached(
        cls,
        name_prefix: str | None = None,
        worker_names: list[str] | None = None,
        worker_handles: list | None = None,
        ray_cls_with_init: RayClassWithInitArgs = None,
        **kwargs,
    ):
        """A group over actors that exist (by name or handle); ``kwargs`` as the constructor's."""
        return cls(
            resource_pool=None,
            ray_cls_with_init=ray_cls_with_init,
            name_prefix=name_prefix,
            worker_names=worker_names,
            worker_handles=worker_handles,
            **kwargs,
        )

    def _init_with_resource_pool(self, pool: RayResourcePool, bin_pack: bool, detached: bool, worker_env: dict):
        pool.get_placement_groups(strategy="STRICT_PACK" if bin_pack else "PACK")
        slots = pool.bundle_slots()
        world_size = pool.world_size
        cls_name = self.ray_cls_with_init.user_cls.__name__
        takes_gpu = self.use_gpu and self.device_name == "cuda"
        rendezvous_key = f"rlflow_rendezvous_{uuid.uuid4().hex}"
        num_gpus = 1 / pool.max_colocate_count if takes_gpu else 0
        ranks_on_pg = collections.Counter(pg_idx for pg_idx, _, _ in slots)
        for rank, (pg_idx, pg, bundle) in enumerate(slots):
            # verl's environment. LOCAL_RANK is 0: Ray shows each GPU actor only its own GPU (see Worker).
            env = {
                "WORLD_SIZE": str(world_size),
                "RANK": str(rank),
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
                "WG_PREFIX": self.name_prefix,
                "WG_BACKEND": "ray",
                "RAY_LOCAL_WORLD_SIZE": str(ranks_on_pg[pg_idx]),
                **worker_env,
            }
            # Rank 0 binds a new store (never one named by what Ray's processes inherited: a driver under torchrun,
            # or one that ran a Worker itself) and publishes its address under the key; every rank starts at once,
            # and the others read the address in Worker.__init__.
            env.update(MASTER_ADDR="", MASTER_PORT="")
            env[RENDEZVOUS_KEY_ENV] = rendezvous_key
            name = f"{self.name_prefix}{cls_name}_{pg_idx}:{bundle}"
            worker = self.ray_cls_with_init(
                pg,
                bundle,
                use_gpu=takes_gpu,
                num_gpus=num_gpus,
                num_cpus=pool.cpus_per_worker,
                env_vars=env,
                name=name,
                detached=detached,
            )
            self._workers.append(worker)
            self._worker_names.append(name)
        # Surface constructor errors now, with the rank, rather than at the first call; learn where each rank runs.
        try:
            self._master_addr, self._master_port = _published_rendezvous(
                self._workers[0].__ray_ready__.remote(), rendezvous_key, cls_name
            )
            described = get_with_rank(
                [w.describe_process.remote() for w in self._workers], list(range(world_size)), f"{cls_name}.__init__"
            )
        finally:
            from ray.experimental.internal_kv import _internal_kv_del

            _internal_kv_del(rendezvous_key)
        self._worker_processes = [
            WorkerProcess(worker_class=cls_name, actor_name=name, **info)
            for name, info in zip(self._worker_names, described)
        ]

    # ------------------------------------------------------------------------------------------- properties
    @property
    def worker_names(self) -> list[str]:
        return self._worker_names

    @property
    def worker_processes(self) -> list[WorkerProcess | None]:
        """Where each rank runs (pid, node, log file); None for groups attached to existing actors."""
        return self._worker_processes

    @property
    def workers(self) -> list:
        return self._workers

    @property
    def master_address(self) -> str | None:
        return self._master_addr

    @property
    def master_port(self) -> str | None:
        return self._master_port

    def share(self, value: Any) -> Any:
        # Store large broadcast values once; every rank then reads the same object instead of its own copy.
        if isinstance(value, (DataProto, TensorDict, torch.Tensor, np.ndarray)):
            return ray.put(value)
        return value

    # ------------------------------------------------------------------------------------------- execution
    def set_call_timeout(self, timeout_s: float | None, per_row_s: float = 0.0) -> None:
        """Time limit of every blocking call: ``timeout_s + per_row_s * rows`` of its batch argument (None: none),
        and at least ``SLOWEST_FACTOR`` times what the slowest earlier call of the same method took (per row).
        Ranks still running at the limit are cut only when they are not working (progress.still_working)."""
        self.call_timeout_s, self.call_timeout_s_per_row = timeout_s, per_row_s

    def call_time_limit(self, method_name: str, rows: int = 0) -> float | None:
        """The time limit of a call of ``method_name`` on a batch of ``rows`` (see ``set_call_timeout``)."""
        if self.call_timeout_s is None:
            return None
        seen = self.__dict__.get("_slowest_s", {}).get(method_name, 0.0)
        return max(self.call_timeout_s + self.call_timeout_s_per_row * rows, SLOWEST_FACTOR * seen * max(rows, 1))

    def _collect(self, refs: list, ranks: list[int], method_name: str, rows: int = 0) -> list:
        timeout_s, started = self.call_time_limit(method_name, rows), time.monotonic()
        workers = [self._worker_processes[r] for r in ranks]

        def still_working(late: list[int], pause) -> bool:
            return progress.still_working(method_name, [self._worker_processes[r] for r in late], pause)

        try:
            windows = MAX_WINDOWS if not timeout_s else max(MAX_WINDOWS, math.ceil(MIN_PATIENCE_S / timeout_s))
            outputs = get_with_rank(refs, ranks, method_name, timeout_s=timeout_s, workers=workers,
                                    still_working=still_working, max_windows=windows)  # fmt: skip
        except StageTimeout as timeout:
            for rank in timeout.ranks:  # a hung rank would also hang the next call: end it
                ray.kill(self._workers[rank], no_restart=True)
            raise
        slowest = self.__dict__.setdefault("_slowest_s", {})  # seconds per row (per call without rows), this process
        slowest[method_name] = max(slowest.get(method_name, 0.0), (time.monotonic() - started) / max(rows, 1))
        return outputs

    def _execute_per_rank(
        self,
        method_name: str,
        args: tuple,
        kwargs: dict,
        ranks: list[int],
        return_len: bool = False,
        drop_output: set[int] = frozenset(),
    ) -> list:
        """Start ``method_name`` on ``ranks``, rank r with element r of every argument. Ranks in ``drop_output``
        return None instead of their output (the caller keeps only the other ranks')."""
        for name, value in [*enumerate(args), *kwargs.items()]:
            if not isinstance(value, (list, tuple)) or len(value) != self.world_size:
                raise TypeError(
                    f"the dispatch function for {method_name!r} must return one value per rank "
                    f"({self.world_size}) for every argument; argument {name!r} is {type(value).__name__}"
                )
        refs = []
        with SUBMITTING:
            for rank in ranks:
                rank_kwargs = {k: v[rank] for k, v in kwargs.items()}
                method = getattr(self._workers[rank], method_name)
                if return_len:
                    rank_kwargs[WITH_LEN_KEY] = True
                    method = method.options(num_returns=2)
                if rank in drop_output:
                    rank_kwargs[DROP_OUTPUT_KEY] = True
                refs.append(method.remote(*(a[rank] for a in args), **rank_kwargs))
        return refs

    def execute_all_async(self, method_name: str, *args, **kwargs) -> list:
        """Call ``method_name`` on every rank with the same arguments; returns one ObjectRef per rank."""
        with SUBMITTING:
            return [getattr(worker, method_name).remote(*args, **kwargs) for worker in self._workers]

    def execute_all_sync(self, method_name: str, *args, **kwargs) -> list:
        return self._collect(
            self.execute_all_async(method_name, *args, **kwargs), list(range(self.world_size)), method_name
        )

    execute_all = execute_all_async

    def execute_rank_zero_async(self, method_name: str, *args, **kwargs):
        return getattr(self._workers[0], method_name).remote(*args, **kwargs)

    def execute_rank_zero_sync(self, method_name: str, *args, **kwargs):
        return self._collect([self.execute_rank_zero_async(method_name, *args, **kwargs)], [0], method_name)[0]

    execute_rank_zero = execute_rank_zero_async

    # ------------------------------------------------------------------------------------------- pickling
    def __getstate__(self) -> dict:
        # Bound methods are closures over this group; send handles and bindings, rebind on arrival. This is what
        # lets a group travel as an argument to a Prefect task running in another Ray process.
        # _slowest_s is this process's record of its own calls (call_time_limit): kept out, so that a group's bytes
        # do not change with every call and a receiving process keeps its unpickled copy (group_transport)
        return {k: v for k, v in self.__dict__.items() if not inspect.isfunction(v) and k != "_slowest_s"}

    def __reduce__(self):  # see group_transport: cached per process, or through Ray Client's pickler
        return reduce_group(self)

    def __setstate__(self, state: dict) -> None:
        bindings = state.pop("_bindings", [])
        self.__dict__.update(state)
        self._bindings = []
        for user_cls, prefix in bindings:
            self._bind_worker_method(user_cls, func_generator, remote_prefix=prefix)

    def __copy__(self) -> "RayWorkerGroup":  # a new group on the same actors, never one from the unpickled cache
        group = type(self).__new__(type(self))
        group.__setstate__(self.__getstate__())
        return group

    def __deepcopy__(self, memo: dict) -> "RayWorkerGroup":  # the actors are not copied, so as copy.copy
        return self.__copy__()

    # ------------------------------------------------------------------------------------------- colocation
    def spawn(self, prefix_set) -> dict[str, "RayWorkerGroup"]:
        """One group per role of a colocated worker class, all sharing these actors."""
        role_classes = getattr(self.ray_cls_with_init.user_cls, "raw_cls_dict", None)
        if role_classes is None:
            raise ValueError(
                "spawn() needs a group built from create_colocated_worker_cls(...) or a subclass of "
                "create_colocated_worker_raw_cls(...)"
            )
        unknown = set(prefix_set) - set(role_classes)
        if unknown:
            raise ValueError(
                f"spawn() got roles {sorted(unknown)} that the colocated class lacks; it has {sorted(role_classes)}"
            )
        groups = {}
        for prefix in prefix_set:
            group = copy.copy(self)
            group.__dict__ = {
                k: v
                for k, v in self.__dict__.items()
                if not inspect.isfunction(v) and not isinstance(v, RayWorkerGroup)
            }
            group._bindings = []
            group._dispatch_info, group._collect_info = {}, {}  # each role registers its own meshes
            group._bind_worker_method(role_classes[prefix], func_generator, remote_prefix=f"{prefix}_")
            groups[prefix] = group
        return groups

    def fuse(self, prefix_set) -> None:
        """verl's fused groups: ``group.<role>`` is the role's group (as ``spawn`` makes it)."""
        for role, group in self.spawn(prefix_set).items():
            if hasattr(self, role) and not isinstance(getattr(self, role), RayWorkerGroup):
                raise ValueError(f"role {role!r} clashes with a RayWorkerGroup attribute; rename the role")
            setattr(self, role, group)

    # ------------------------------------------------------------------------------------------- recovery
    def unresponsive_ranks(self, timeout_s: float = 30.0) -> list[int]:
        """Ranks whose actor is dead or does not answer a ping within ``timeout_s`` (a busy actor answers once
        its running call ends)."""
        pings = [worker.__ray_ready__.remote() for worker in self._workers]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=timeout_s)
        bad = []
        for rank, ping in enumerate(pings):
            try:
                if ping not in ready:
                    raise TimeoutError
                ray.get(ping)
            except (TimeoutError, ray.exceptions.RayActorError):
                bad.append(rank)
        return bad

    def restart(self) -> None:
        """Replace every actor with a new one in the same placement (after a rank died or hung): the ranks of a
        torch.distributed world cannot rejoin one by one. Registered methods stay bound; call ``init_model``
        (or whatever sets the workers up) again. Raises ``PlacementError`` while the placement lacks capacity
        (a lost node) for longer than the pool's ``placement_timeout_s``."""
        if self.resource_pool is None:
            raise ValueError("restart() needs a group created from a resource pool")
        pool = self.resource_pool
        pgs = pool.get_placement_groups()
        deadline = time.monotonic() + pool.placement_timeout_s
        while not all(_placed(pg) for pg in pgs) and time.monotonic() < deadline:
            time.sleep(1.0)
        if not all(_placed(pg) for pg in pgs):
            raise PlacementError(
                f"resource pool {pool.store} lost capacity (a node left?) and has not been placed again within "
                f"{pool.placement_timeout_s:.0f} s: it needs {len(pool.store)} placement group(s) of bundles "
                f"{pool.bundle()}; free now: {_resources(ray.available_resources(), pool.bundle())}"
            )
        for worker in self._workers:
            ray.kill(worker, no_restart=True)
        self._workers, self._worker_names, self._worker_processes = [], [], []
        self.name_prefix = f"{uuid.uuid4().hex[:6]}_"  # the killed actors' names may not be free yet
        self._init_with_resource_pool(pool, self._bin_pack, self._detached, self._worker_env)

    # ------------------------------------------------------------------------------------------- reuse
    def end_for_reuse(self, timeout_s: float = 60.0) -> bool:
        """Every rank drops its worker (``Worker.end_for_reuse``): the processes wait idle, in their placement, for
        ``reinitialize``. False when a rank failed or did not answer within ``timeout_s``: end the group then."""
        try:
            ray.get([worker.end_for_reuse.remote() for worker in self._workers], timeout=timeout_s)
            return True
        except Exception:
            return False

    def reinitialize(self, ray_cls_with_init: RayClassWithInitArgs) -> None:
        """New workers of the same class, built with ``ray_cls_with_init``'s arguments in this group's processes
        (``Worker.reinitialize``): what ``RayWorkerGroup(pool, ray_cls_with_init)`` gives, without starting a
        process or importing a module. Call ``init_model`` (or whatever sets the workers up) again. Raises
        ``StaleProcessError`` when code a process imported changed on disk since it started (start new ones)."""
        if ray_cls_with_init.user_cls is not self.ray_cls_with_init.user_cls:
            raise ValueError(
                f"reinitialize() builds workers of the group's class {self.ray_cls_with_init.user_cls.__name__}, "
                f"not {ray_cls_with_init.user_cls.__name__}: start a new group for another class"
            )
        from ray.experimental.internal_kv import _internal_kv_del

        changed = sorted(
            {path for paths in ray.get([w.modules_changed.remote() for w in self._workers]) for path in paths}
        )
        if changed:
            raise StaleProcessError(f"code its processes imported changed on disk since: {', '.join(changed[:3])}")
        cls_name = ray_cls_with_init.user_cls.__name__
        self.ray_cls_with_init = ray_cls_with_init  # what restart() builds from
        self.name_prefix = f"{uuid.uuid4().hex[:6]}_"
        rendezvous_key = f"rlflow_rendezvous_{uuid.uuid4().hex}"
        env = {"WG_PREFIX": self.name_prefix, "MASTER_ADDR": "", "MASTER_PORT": "", RENDEZVOUS_KEY_ENV: rendezvous_key}
        args, kwargs = ray_cls_with_init.args, ray_cls_with_init.kwargs
        refs = [worker.reinitialize.remote(env, args, kwargs) for worker in self._workers]
        try:
            self._master_addr, self._master_port = _published_rendezvous(refs[0], rendezvous_key, cls_name)
            get_with_rank(refs, list(range(self.world_size)), f"{cls_name}.__init__")
        finally:
            _internal_kv_del(rendezvous_key)
        self.__dict__.pop("_slowest_s", None)  # the calls of the workers before are no measure of these
        self._dispatch_info, self._collect_info = {}, {}  # the new workers register their meshes anew

    def shutdown(self) -> None:
        """Kill this group's actors (its resource pool stays placed; call ``pool.remove()`` to free it)."""
        for worker in self._workers:
            ray.kill(worker)
        self._workers = []
