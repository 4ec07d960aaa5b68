"""Where a run's workers come from: Ray (a local one, or the cluster at ``trainer.ray_address``), the flows' task
runner, and the worker groups of a run's roles, built and released."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import threading
import uuid
import weakref

from flows.config import RLConfig
from flows.plumbing import kept as kept_processes
from flows.plumbing.servers import http_ok
from rlworkers.single_controller.base.worker import WORKING_DIR_ENV
from rlworkers.single_controller.errors import StaleProcessError
from rlworkers.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from rlworkers.storage import storage_env
from rlworkers.workers.actor_rollout_ref import ActorRolloutRefWorker
from rlworkers.workers.critic import CriticWorker
from rlworkers.workers.reward import RewardWorker, RuleReward

logger = logging.getLogger(__name__)


# Worker groups kept between the runs of one process whose Ray outlives them (a notebook, a sweep, the tests): a run
# that ends lets its groups' workers go (``Worker.end_for_reuse``) but keeps their processes, in their placement; the
# next run of the process builds its workers in those of the same class, size, resources and environment
# (``RayWorkerGroup.reinitialize``: seeded and set up exactly as in new processes) instead of starting processes that
# import torch and transformers again (most of a short run's CPU: docs/performance.md). In the local Ray of `rlflow
# server up` the groups of every run are kept so, for the next run of any process (flows/plumbing/kept.py). A run that
# starts its own Ray (``rlflow train`` with no local Ray up, a deployment run then) ends its groups with it. Kept groups
# that a build does not take are ended then, so they never hold the placement a run needs; ``end_kept_groups()`` ends
# them at any time.
_kept_groups: list[tuple[tuple, RayWorkerGroup]] = []
_keys: weakref.WeakKeyDictionary[RayWorkerGroup, tuple] = weakref.WeakKeyDictionary()  # of reusable groups built
_kept_groups_lock = threading.Lock()
# the groups of this process recorded in the local Ray's registry of kept processes (flows/plumbing/kept.py): their item
# ids
_registered: weakref.WeakKeyDictionary[RayWorkerGroup, str] = weakref.WeakKeyDictionary()


def group_key(cls, process_on_nodes: list[int], use_gpu: bool, cpus_per_worker: float, env: dict[str, str]) -> tuple:
    """What a kept group must match to be reused: the Ray job (any job of the local Ray of `rlflow server up`), the
    worker class, its workers on each node, their resources and their environment (a process's environment is set when
    it starts: the group's own variables and those every worker of the run gets)."""
    import ray

    job = None if kept_processes.in_local_ray() else ray.get_runtime_context().get_job_id()
    env = {**_service_env(), **env}
    shape = tuple(process_on_nodes)
    return (job, cls.__module__, cls.__qualname__, shape, use_gpu, cpus_per_worker, kept_processes.digest(env))


def take_kept_groups(keys: list[tuple]) -> list[RayWorkerGroup | None]:
    """For each of ``keys``, a kept group of that key (None if none is kept); every kept group not taken is ended."""
    if kept_processes.in_local_ray():
        taken = []
        for found in kept_processes.take("group", keys):
            group = None
            if found is not None:
                group = pickle.loads(found[1])
                _registered[group] = found[0]
            taken.append(group)
        return taken
    with _kept_groups_lock:
        kept, _kept_groups[:] = list(_kept_groups), []
    taken = []
    for key in keys:
        found = next((i for i, (kept_key, _) in enumerate(kept) if kept_key == key), None)
        taken.append(None if found is None else kept.pop(found)[1])
    _end_groups([group for _, group in kept])
    return taken


def keep_group(key: tuple, group: RayWorkerGroup) -> None:
    """Keep ``group`` for the next run of this process (see ``_kept_groups``), or end it when its workers do not
    let go."""
    if group.end_for_reuse():
        with _kept_groups_lock:
            _kept_groups.append((key, group))
    else:
        _end_groups([group])


def end_kept_groups() -> int:
    """End every kept group (their processes exit and their placement is freed); returns how many there were. In the
    local Ray of `rlflow server up`, every idle group and task host kept there."""
    if kept_processes.in_local_ray():
        return kept_processes.end_idle()
    with _kept_groups_lock:
        kept, _kept_groups[:] = list(_kept_groups), []
    _end_groups([group for _, group in kept])
    return len(kept)


def _end_groups(groups: list[RayWorkerGroup], wait_s: float = 10.0) -> None:
    """Kill the groups' actors, free their placement, and wait (up to ``wait_s``) for their processes on this node
    to exit: whoever ends kept groups expects them gone, not still exiting."""
    import psutil
    import ray

    if not groups or not ray.is_initialized():  # a Ray that is gone took them with it
        return
    here, pids = ray.util.get_node_ip_address(), []
    for group in groups:
        pids += [process.pid for process in group.worker_processes if process and process.node_ip == here]
        with contextlib.suppress(Exception):  # a Ray that is gone took them with it
            release_group(group)
    processes = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            processes.append(psutil.Process(pid))
    psutil.wait_procs(processes, timeout=wait_s)


def build_group(
    cls,
    process_on_nodes: list[int],
    *,
    use_gpu: bool,
    cpus_per_worker: float = 1.0,
    timeout: tuple[float, float] | None = None,
    env: dict[str, str] | None = None,
    reusable: bool = True,
    kept: RayWorkerGroup | None = None,
    **init_kwargs,
) -> RayWorkerGroup:
    """A group of workers of ``cls`` (``process_on_nodes``: how many on each node, verl's) built with
    ``init_kwargs``, set up (``init_model``): in the processes of
    ``kept`` when one is given (a kept group of its key: ``take_kept_groups``), else in new ones. ``reusable``:
    whether ``release_group(group, keep=True)`` may keep its processes for another run (not a vLLM engine's: its
    engine does not let go of everything it started)."""
    worker_cls = RayClassWithInitArgs(cls=cls, **init_kwargs)
    env = worker_env(env)
    if env:
        worker_cls.update_options({"runtime_env": {"env_vars": env}})
    key = group_key(cls, process_on_nodes, use_gpu, cpus_per_worker, env)
    group = None
    if kept is not None:
        try:
            kept.reinitialize(worker_cls)
            group = kept
        except StaleProcessError as error:  # new processes run the code as it is now
            logger.info("the kept %s processes run older code (%s): starting new workers", cls.__name__, error)
            release_group(kept)
        except Exception as error:  # a kept process that died or fails: new ones, as if none was kept
            logger.warning("a kept %s group could not be reused (%s): starting new workers", cls.__name__, error)
            release_group(kept)
    if group is None:
        in_local_ray = kept_processes.in_local_ray()  # detached, recorded in its registry before any worker starts
        pool = RayResourcePool(
            list(process_on_nodes),
            use_gpu=use_gpu,
            max_colocate_count=1,
            cpus_per_worker=cpus_per_worker,
            detached=in_local_ray,
        )
        if in_local_ray:
            item = uuid.uuid4().hex
            kept_processes.hold(item, "group", key, pgs=pool.get_placement_groups())
        try:
            group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=worker_cls, detached=in_local_ray)
        except BaseException:
            if in_local_ray:
                kept_processes.end([item])
            raise
        if in_local_ray:
            _registered[group] = item
            pids = [process.pid for process in group.worker_processes if process]
            kept_processes.hold(item, "group", key, pgs=pool.pgs, pids=pids)
    if reusable:
        _keys[group] = key
    group.set_call_timeout(*(timeout or (None, 0.0)))
    group.init_model()
    return group


def sharded_on_cpu_env(strategy: str, device: str) -> dict[str, str]:
    """A sharded model's workers on the CPU: glibc's mmap threshold fixed at 128 KiB. Left to itself glibc raises it
    as FSDP2 frees its gathered layers, their memory then stays in the heap, and a worker's RSS grows step by step
    (measured by bench/fsdp_memory.py: 1.9-2.1 GiB a worker of a 50M model after a few steps, 1.2 with it)."""
    return {"MALLOC_MMAP_THRESHOLD_": "131072"} if strategy == "fsdp2" and device == "cpu" else {}


def release_group(group: RayWorkerGroup, keep: bool = False) -> None:
    """End a group's actors and give its placement back; or, with ``keep`` (a process whose Ray outlives the run)
    and a group ``build_group`` made reusable, keep its processes for the next run of this process."""
    key = _keys.pop(group, None)
    item = _registered.pop(group, None)
    if item is not None:  # in the local Ray's registry: kept there for any process, or ended by it
        if keep and key is not None and group.end_for_reuse():
            pids = [process.pid for process in group.worker_processes if process]
            kept_processes.release(item, pickle.dumps(group), pids)
        else:
            kept_processes.end([item])
        return
    if keep and key is not None:
        keep_group(key, group)
        return
    group.shutdown()
    if group.resource_pool is not None:
        group.resource_pool.remove()


def build_groups(config: RLConfig, roles: tuple[str, ...], model_path: str) -> dict[str, RayWorkerGroup | RuleReward]:
    """The worker groups of ``roles``, built at once: their processes start and load the model in parallel, each
    role's on its pool (``RLConfig.processes_on_nodes``). The reference may share the actor's group
    (``trainer.colocate_ref``), and so does the rollout unless it has a pool of its own (``rollout.n_workers``, or
    either mapped to a pool of its own in ``resource_pool``); a rule reward is a ``RuleReward`` that the
    compute_reward stage calls itself (``reward.num_workers=0``, the default for rules)."""
    from concurrent.futures import ThreadPoolExecutor

    trainer = config.trainer
    use_gpu, timeout = trainer.device == "cuda", (trainer.stage_timeout_s, trainer.stage_timeout_s_per_sample)
    model = config.model.model_copy(update={"path": model_path})  # resolved once: "tiny" -> its folder
    worker_config = config.worker_config().model_copy(update={"model": model})
    colocate_ref = trainer.colocate_ref and "actor" in roles and "ref" in roles  # SFT has no reference to hold
    plans = {
        "actor": (
            ActorRolloutRefWorker,
            config.processes_on_nodes("actor"),
            {
                "use_gpu": use_gpu,
                "config": worker_config,
                "role": "actor_rollout_ref" if colocate_ref else "actor_rollout",
                "env": sharded_on_cpu_env(config.actor.strategy, trainer.device),
                "reusable": config.rollout.name != "vllm",
            },
        ),
        "rollout": (
            ActorRolloutRefWorker,
            config.processes_on_nodes("rollout"),
            {
                "use_gpu": use_gpu,
                "config": worker_config,
                "role": "rollout",
                "reusable": config.rollout.name != "vllm",
            },
        ),
        "ref": (
            ActorRolloutRefWorker,
            config.processes_on_nodes("ref"),
            {"use_gpu": use_gpu, "config": worker_config, "role": "ref"},
        ),
        "critic": (
            CriticWorker,
            config.processes_on_nodes("critic"),
            {
                "use_gpu": use_gpu,
                "config": config.critic_config(),
                "model": model,
                "device": trainer.device,
                "seed": trainer.seed,
                "collective_timeout_s": trainer.collective_timeout_s,
                "env": sharded_on_cpu_env(config.critic.strategy, trainer.device),
            },
        ),
        "reward": (RewardWorker, config.processes_on_nodes("reward"), reward_worker_options(config, model_path)),
    }
    # a rule reward scores in the compute_reward stage (reward.num_workers=0): loaded here, before any worker starts
    in_stage = "reward" in roles and not config.reward.worker_count
    rule_reward = RuleReward(config.reward, model_path).load() if in_stage else None
    rollout_in_actor = "rollout" in roles and not config.rollout.n_workers  # the actor's processes generate
    no_group_of_its_own = {"ref": colocate_ref, "reward": rule_reward is not None, "rollout": rollout_in_actor}
    wanted = [role for role in plans if role in roles and not no_group_of_its_own.get(role)]
    keys = [plan_key(*plans[role]) for role in wanted]
    kept = dict(zip(wanted, take_kept_groups(keys)))  # the last run's groups of this process, where they fit
    with ThreadPoolExecutor(len(wanted)) as pool:
        futures = {
            role: pool.submit(
                build_group, plans[role][0], plans[role][1], timeout=timeout, kept=kept[role], **plans[role][2]
            )
            for role in wanted
        }
    groups, errors = {}, []
    for role, future in futures.items():
        try:
            groups[role] = future.result()
        except Exception as error:
            errors.append(error)
    if errors:  # release what did start before failing with the first error
        for group in groups.values():
            release_group(group)
        raise errors[0]
    if colocate_ref and "ref" in roles:
        groups["ref"] = groups["actor"]  # one group in two roles (Run.distinct_groups lists it once)
    if rollout_in_actor:
        groups["rollout"] = groups["actor"]
    if rule_reward is not None:
        groups["reward"] = rule_reward
    return groups


def worker_env(env: dict[str, str] | None) -> dict[str, str]:
    """A group's environment variables: ``env`` and the storage's (workers write checkpoints straight to the store)."""
    return {**storage_env(), **(env or {})}


def plan_key(cls, process_on_nodes: list[int], options: dict) -> tuple:
    """``group_key`` of the group ``build_group(cls, process_on_nodes, **options)`` builds."""
    return group_key(
        cls, process_on_nodes, options["use_gpu"], options.get("cpus_per_worker", 1.0), worker_env(options.get("env"))
    )


def reward_worker_options(config: RLConfig, model_path: str) -> dict:
    """The reward group's options: a reward model runs on the run's device (a GPU each worker, as the critic's), a
    rule on CPU. Its workers get the policy's tokenizer, which decodes the batch, and the data's prompt column, where
    a reward model finds chat prompts to render again in its own template."""
    on_device = config.reward.reward_model is not None and config.trainer.device == "cuda"
    return {
        "use_gpu": on_device,
        "device": "cuda" if on_device else "cpu",
        "cpus_per_worker": 0.5,
        "config": config.reward,
        "tokenizer_path": model_path,
        "prompt_key": config.data.prompt_key,
    }


def ray_outlives_the_run() -> bool:
    """Whether the Ray of this process outlives the flow run it is in (the run's task runner did not start it, or it
    is the local Ray of `rlflow server up`): then the run's worker groups are kept for the next run
    (``release_group(..., keep=True)``)."""
    from prefect.context import FlowRunContext

    from flows.plumbing.task_runner import WarmRayTaskRunner

    context = FlowRunContext.get()
    runner = context.task_runner if context else None
    return isinstance(runner, WarmRayTaskRunner) and (not runner.owns_ray or kept_processes.in_local_ray())


def flow_task_runner():
    """The task runner of the flow run this process is in; training flows run on ``ray_task_runner()``."""
    from prefect.context import FlowRunContext

    from flows.plumbing.task_runner import WarmRayTaskRunner

    runner = FlowRunContext.get().task_runner
    if not isinstance(runner, WarmRayTaskRunner):
        raise TypeError(
            f"training flows run on flows.controller.groups.ray_task_runner(), not {type(runner).__name__}: drop "
            "the task_runner of `flow.with_options(...)`"
        )
    return runner


def reap_orphaned_ray_agents() -> list[int]:
    """Kill ``ray::`` processes (Ray's per-node agents and workers) whose raylet is gone.

    Every such process is started by a raylet and stays its child (or, forked by a Ray worker, its grandchild, with
    the worker's ``ray::`` name). When a flow process that started a local Ray dies by SIGKILL, its raylet and GCS exit
    with it, but Ray's two agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) can outlive them indefinitely.
    Every attempt starts by ending those orphans (this user's only), so the new attempt of a crashed run leaves nothing
    of the dead one behind; a ``ray::`` process whose ``ray::`` ancestors lead to a live raylet belongs to a running
    Ray (another run's, on a shared machine) and is left alone. All are found before any is killed: a killed
    process's children would look orphaned at once."""
    import psutil

    def under_a_raylet(process) -> bool:
        parent = process.parent()
        while parent is not None and parent.name().startswith("ray::"):
            parent = parent.parent()
        return parent is not None and "raylet" in parent.name()

    orphans = []
    for process in psutil.process_iter(["name", "uids"]):
        try:
            if not (process.info["name"] or "").startswith("ray::") or process.info["uids"].real != os.getuid():
                continue
            if not under_a_raylet(process):
                orphans.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    reaped = []
    for process in orphans:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            process.kill()
            reaped.append(process.pid)
    if reaped:
        logger.warning("ended %d Ray agent process(es) left by a dead local Ray: %s", len(reaped), reaped)
    return reaped


def _service_env() -> dict[str, str]:
    """Environment every Ray worker (on every node) gets: where the services are, where the tiny model lives,
    how to reach the object store, the working directory relative paths are relative to (a worker and the task host
    start there: ``Worker.__init__``, ``TaskHost``)."""
    return {
        WORKING_DIR_ENV: os.getcwd(),
        **{
            k: os.environ[k]
            for k in (
                "PREFECT_API_URL",
                "MLFLOW_TRACKING_URI",
                "RLFLOW_TINY_MODEL_DIR",
                "RLFLOW_SMOLLM2_MODEL_DIR",
                # credentials of servers with authentication (in the workers' environment, never in a param)
                "PREFECT_API_AUTH_STRING",
                "PREFECT_API_KEY",
                "MLFLOW_TRACKING_USERNAME",
                "MLFLOW_TRACKING_PASSWORD",
                "MLFLOW_TRACKING_TOKEN",
            )
            if k in os.environ
        },
        **storage_env(),
    }


def ray_task_runner():
    """The flows' task runner (``WarmRayTaskRunner``: prefect-ray's, with tasks in a long-lived actor), built here
    only. It starts Ray when the flow's ``start_run`` calls ``start_ray`` with the run's config (``ray_settings``).
    Every Ray worker, on every node, gets the service URLs in its environment."""
    from flows.plumbing.task_runner import WarmRayTaskRunner

    # the worker classes too: a stage task's WorkerGroup argument is rebuilt in the host from its worker class, and the
    # first one (validation before step 1) would otherwise wait for torch and transformers to import there; and the
    # run's modules (with MLflow): the flow run context every task gets holds the flow, whose module imports them
    workers = ("rlworkers.workers.actor_rollout_ref", "rlworkers.workers.critic", "rlworkers.workers.reward")
    return WarmRayTaskRunner(host_env=_service_env, preload=("flows.stages", *workers, "flows.controller.run_start"))


def ray_settings(address: str | None, num_cpus: int | None) -> tuple[str | None, dict]:
    """``(address, ray.init keyword arguments)`` for ``trainer.ray_address`` / ``trainer.ray_num_cpus``: Ray at
    ``address`` (else ``$RAY_ADDRESS``) when one is given; else the local Ray of `rlflow server up` when it is up
    (``$RLFLOW_LOCAL_RAY``); otherwise a local Ray of the run's own with ``num_cpus`` (else ``$RLFLOW_RAY_NUM_CPUS``,
    else max(8, cores)) logical CPUs as slots for the worker processes. ``num_cpus`` does not apply to an existing
    Ray (it has its own resources: the local Ray's are `rlflow server up --ray-cpus`)."""
    address = address or os.environ.get("RAY_ADDRESS") or None
    init_kwargs = {"include_dashboard": False, "log_to_driver": False, "runtime_env": {"env_vars": _service_env()}}
    local_ray = os.environ.get(kept_processes.LOCAL_RAY_ENV)
    if address is None and local_ray and http_ok(f"tcp://{local_ray}", timeout=1.0):  # it is up
        address = local_ray
        init_kwargs["namespace"] = kept_processes.NAMESPACE  # its kept (detached, named) actors outlive the job
    if address is None:
        init_kwargs["num_cpus"] = num_cpus or int(os.environ.get("RLFLOW_RAY_NUM_CPUS", max(8, os.cpu_count() or 1)))
        # Ray starts idle worker processes for the driver's job at once, but every actor rlflow starts has a
        # runtime env of its own (per-rank variables) and never uses them: on a small machine they only slow the
        # worker groups' start-up (docs/performance.md).
        init_kwargs["_system_config"] = {"prestart_worker_first_driver": False}
    else:
        init_kwargs.pop("include_dashboard")  # a setting of the cluster's head, not of a client
    return address, init_kwargs
