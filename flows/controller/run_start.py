"""A run's start: name it, pin (or read back) what it starts from, check data, model and checkpoint before any worker
starts, open its MLflow run, build its worker groups and resume its newest checkpoint (``start_run``)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import uuid

import fsspec
from prefect import get_run_logger

from flows.config import RLConfig, flatten, runs_root
from flows.controller.groups import build_groups, flow_task_runner, ray_settings, reap_orphaned_ray_agents
from flows.controller.rows import read_inputs
from flows.controller.run_checkpoints import checkpoint_root, restore
from flows.controller.runtime import Run, end_status, raise_the_stop_behind
from flows.controller.startup import StartupClock, run_clock
from flows.lineages import lineage
from flows.lineages.run_lock import one_run_at_a_time
from flows.plumbing.tracking import (
    ProgressArtifact,
    TerminalProgress,
    Tracker,
    prefect_flow_run_links,
    publish_mlflow_link,
)
from rlworkers.checkpoint import (
    read_json,
    resolve_resume,
    write_json,
)
from rlworkers.data.batching import TokenCache
from rlworkers.data.datasets import PromptDataLoader
from rlworkers.models import lora
from rlworkers.models.loading import base_model_path, load_tokenizer, resolve_model_path
from rlworkers.storage import is_remote
from rlworkers.workers import memory
from rlworkers.workers.common import EMULATED_BF16_SLOWDOWN, resolve_autocast


def start_run(config: RLConfig, algorithm: str, *, roles: tuple[str, ...]) -> Run:
    """Name the run, pin what it starts from (first attempt) or read that back (later attempts), open its MLflow
    run, build the worker groups (``roles`` among actor, ref, reward, critic) and resume its newest checkpoint.

    Raises:
        RunAlreadyComplete: the run already trained all its steps and published them (``trainer.republish``).
        RestartBudgetExhausted: the flow run crashed more than ``trainer.max_crash_restarts`` times.
        ModelReferenceError: ``model.path`` names an MLflow model that does not exist.
    """
    from flows.plumbing.servers import require_mlflow_tracking, require_prefect_api

    clock = run_clock()
    config.check_algorithm(algorithm)
    require_prefect_api()
    require_mlflow_tracking()
    config = config.model_copy(
        update={"trainer": config.trainer.model_copy(update={"run_name": lineage.run_name(config, algorithm)})}
    )
    check_runs_dir_writable(config)
    lock = contextlib.ExitStack()  # held until Run.close: one run of a lineage at a time (flows/lineages/run_lock.py)
    root = runs_root(config)
    lock.enter_context(one_run_at_a_time(config.trainer.lineage, config.trainer.run_name, root))
    clock.mark("checks")
    try:
        return _start_holding_the_lock(config, algorithm, roles, root, clock, lock)
    except BaseException:
        lock.close()
        raise


def _start_holding_the_lock(
    config: RLConfig, algorithm: str, roles: tuple[str, ...], root: str, clock: StartupClock, lock: contextlib.ExitStack
) -> Run:
    reap_orphaned_ray_agents()
    flow_task_runner().start_ray(*ray_settings(config.trainer.ray_address, config.trainer.ray_num_cpus))
    clock.mark("ray")
    name = config.trainer.run_name
    crashes = lineage.check_restart_budget(config.trainer.max_crash_restarts)
    links = prefect_flow_run_links()
    record = lineage.RunRecord.read(root)
    same_flow_run = record is not None and record.prefect_flow_run_id == links.get("prefect.flow_run_id")
    if record and config.trainer.resume == "never" and not same_flow_run:
        raise RuntimeError(
            f"run {name!r} already exists under {root}; use trainer.resume=auto to continue it, or "
            "choose another trainer.run_name"
        )
    # resume=never means "do not continue another run": a later attempt of this flow run still resumes its own.
    resume = resolve_resume(checkpoint_root(root), "auto" if same_flow_run else config.trainer.resume)
    state = read_json(f"{resume[0]}/trainer_state.json") if resume else None
    if state:
        check_checkpoint_fits(resume[0], state, config, algorithm, record.model_dir if record else None)
    # a run's last step: total_steps, or where a validation reached trainer.stop_at_val_score
    last_step = (state or {}).get("stopped_at") or config.trainer.total_steps
    if state and state["step"] >= last_step and lineage.read_result(root) and not config.trainer.republish:
        if record is not None:  # published by an older rlflow, which wrote result.json before ending the run
            from mlflow.tracking import MlflowClient

            if MlflowClient().get_run(record.mlflow_run_id).info.status == "RUNNING":
                MlflowClient().set_terminated(record.mlflow_run_id, status="FINISHED")
        if state.get("stopped_at"):
            done = f"stopped at step {last_step}, whose validation reached trainer.stop_at_val_score,"
            fixes = "Set trainer.republish=true to publish it again"
        else:
            done = f"already trained its {last_step} steps"
            fixes = "Raise trainer.total_steps to train it further, set trainer.republish=true to publish it again"
        raise lineage.RunAlreadyComplete(
            f"run {name!r} {done} and published its result ({root}/result.json): nothing to do. {fixes}, or "
            "start a new run (another trainer.run_name, or a lineage's next run)."
        )

    if record is None:  # nothing is written before the start model and the data have checked out
        model_uri, model_dir = _start_model(config)
    else:
        model_uri, model_dir = record.model_uri, record.model_dir
    tokenizer = TokenCache(load_tokenizer(model_dir))  # the length check tokenizes every prompt once
    inputs = read_inputs(config, algorithm, tokenizer, model_dir)
    check_memory_fits(config, roles, model_dir)

    clock.mark("data")
    experiment = config.trainer.lineage or config.trainer.project_name
    tags = {
        "algorithm": algorithm,
        **links,
        **({"rlflow.lineage": config.trainer.lineage} if config.trainer.lineage else {}),
    }
    if record is None:
        tracker, record = _new_record(
            config, algorithm, root, experiment, tags, links.get("prefect.flow_run_id"), model_uri, model_dir
        )
    else:
        tracker = Tracker(experiment, name, run_id=record.mlflow_run_id, tags=tags)
    tracker.log_params(flatten(config))
    publish_mlflow_link(name, tracker.url)

    clock.mark("tracking")
    data = config.data
    loader = PromptDataLoader(
        inputs.train_rows, batch_size=data.train_batch_size, shuffle=data.shuffle, seed=config.trainer.seed
    )
    run = Run(
        config=config,
        algorithm=algorithm,
        lock=lock,
        root=root,
        tokenizer=tokenizer,
        loader=loader,
        inputs=inputs,
        tracker=tracker,
        record=record,
        startup=clock,
    )
    try:
        _start_workers(run, roles, resume, state, clock)
    except BaseException as error:  # the MLflow run is open: it ends with the workers that did start
        run.close(end_status(error))
        raise_the_stop_behind(error)
        raise
    get_run_logger().info(
        "%s run %r from %s: steps %d..%d, MLflow %s%s%s",
        algorithm,
        name,
        record.model_uri,
        run.start_step,
        config.trainer.total_steps,
        tracker.url,
        f" (resumed from {resume[0]})" if resume else "",
        f" (attempt after {crashes} crash(es))" if crashes else "",
    )
    return run


def _start_workers(run: Run, roles: tuple[str, ...], resume, state: dict | None, clock: StartupClock) -> None:
    """The run's worker groups, its checkpoint restored (``resume``), its progress shown."""
    config, record, name, loader = run.config, run.record, run.config.trainer.run_name, run.loader
    if record.data_cursor and not resume:
        get_run_logger().info(
            "lineage %s: %s", config.trainer.lineage, lineage.continue_data_cursor(loader, record.data_cursor)
        )
    run.keep_initial_state()
    if "actor" in roles:  # a target module the model lacks, or a start adapter with other settings: fail here
        lora.check_fits(resolve_model_path(record.model_dir), config.actor.lora)
    run.use_workers(build_groups(config, roles, record.model_dir))
    if "actor" in run.groups:
        record_precision(run.groups["actor"], run.tracker)
    clock.mark("worker_groups")
    if resume:
        run.rewind(restore(run, resume[0], state))
        clock.mark("restore")
    total, done = config.trainer.total_steps, run.start_step - 1
    terminal = TerminalProgress(f"{run.algorithm} {name}", total, done) if sys.stderr.isatty() else None
    run.show_progress(ProgressArtifact(name, total), terminal)


def record_precision(actor, tracker: Tracker) -> None:
    """Log what the actor computes in and why (``model.autocast=auto`` resolved on the workers' own device), keep
    it as the run's params (``precision.*``; a later attempt's as a tag, params being immutable), and warn when bf16
    is forced on a CPU that only emulates it."""
    report = actor.get_precision()[0]
    logger = get_run_logger()
    logger.info("precision: %s", report["reason"])
    if report["slow"]:
        logger.warning(
            "%s: bf16 is emulated on this CPU, %s (docs/performance.md). Fix: model.autocast=auto (bf16 only where "
            "it is native) or model.autocast=none",
            report["reason"],
            EMULATED_BF16_SLOWDOWN,
        )
    tracker.log_params({"precision.autocast": report["autocast"], "precision.reason": report["reason"]})
    tracker.set_tags({"rlflow.precision": f"{report['autocast']}: {report['reason']}"})


class NotEnoughMemory(RuntimeError):
    """The workers of this run would hold more than this machine's memory before computing anything."""


def check_memory_fits(config: RLConfig, roles: tuple[str, ...], model_dir: str) -> None:
    """Refuse, before any worker starts, a run whose workers on this machine (a local Ray on the CPU) would hold more
    than its memory in weights, gradients and AdamW state alone (``rlworkers.workers.memory``); name the fix."""
    import psutil

    if config.trainer.device != "cpu" or config.trainer.ray_address:
        return  # GPUs, or a cluster's nodes: their memory is not this machine's
    base = base_model_path(resolve_model_path(model_dir))  # a LoRA adapter's base
    parameters = memory.parameter_count(base, config.model.trust_remote_code)
    models = _trained_models(config, roles, parameters, config.actor.strategy, config.critic.strategy)
    need = sum(model.bytes_per_worker() * model.workers for model in models)
    total = psutil.virtual_memory().total
    if need <= total:
        return

    def sharded_need(gathered: bool) -> int:
        models = _trained_models(config, roles, parameters, "fsdp2", "fsdp2", gathered)
        return sum(m.bytes_per_worker() * m.workers for m in models)

    lockstep = "actor.fsdp_config.gather_for_generation=false"
    if config.actor.strategy == "ddp":
        fix = (
            f"actor.strategy=fsdp2{' and critic.strategy=fsdp2' if 'critic' in roles else ''} (each worker holds a "
            f"1/{config.trainer.n_workers} shard: {memory.gib(sharded_need(True))} in all, "
            f"{memory.gib(sharded_need(False))} with {lockstep})"
        )
    else:
        fix = f"{lockstep} ({memory.gib(sharded_need(False))} in all)"
    fix += ", more workers, or a machine with more memory"
    held = "; ".join(
        f"{m.workers} {role} worker(s) x {memory.gib(m.bytes_per_worker())} ({m.strategy})"
        for role, m in zip(_trained_roles(config, roles), models)
    )
    raise NotEnoughMemory(
        f"this run needs at least {memory.gib(need)} before any activation ({parameters / 1e9:.2f}B parameters; "
        f"{held}) and this machine has {memory.gib(total)}: it would be killed for memory mid-step. Fix: {fix}."
    )


def _trained_models(
    config: RLConfig, roles, parameters: int, actor_strategy: str, critic_strategy: str, gather: bool | None = None
) -> list:
    """The groups' models as ``memory.TrainedModel``: the actor (with its colocated reference), the critic, a rollout
    pool and a reference of their own."""
    colocated = config.trainer.colocate_ref and "ref" in roles and not config.actor.lora.enabled
    if gather is None:
        gather = config.actor.fsdp_config.gather_for_generation
    gathered = (
        memory.DTYPE_BYTES[resolve_autocast(config.model, config.trainer.device) or config.model.dtype]
        if gather and config.rollout.name == "hf"
        else 0
    )
    trainable = 0 if config.actor.lora.enabled else parameters  # an adapter's own parameters are few
    n = config.trainer.n_workers
    models = [memory.TrainedModel(parameters, trainable, config.model.dtype, actor_strategy, n, colocated, gathered)]
    if "critic" in roles:
        critic = config.critic.model or config.model
        models.append(memory.TrainedModel(parameters, parameters, critic.dtype, critic_strategy, n))
    for role in ("rollout", "ref"):  # a pool of its own: the weights, nothing trained
        if role in _trained_roles(config, roles):
            n = sum(config.processes_on_nodes(role))
            models.append(memory.TrainedModel(parameters, 0, config.model.dtype, "ddp", n))
    return models


def _trained_roles(config: RLConfig, roles) -> list[str]:
    """The roles ``_trained_models`` lists, in its order."""
    own_rollout = "rollout" in roles and config.rollout.n_workers
    own_ref = "ref" in roles and not config.trainer.colocate_ref
    return [
        "actor", *(["critic"] if "critic" in roles else []), *(["rollout"] if own_rollout else []),
        *(["ref"] if own_ref else []),
    ]  # fmt: skip


class CheckpointMismatch(RuntimeError):
    """A checkpoint this run would resume was written by another algorithm, model or number of workers."""


def check_checkpoint_fits(
    path: str, state: dict, config: RLConfig, algorithm: str, start_model: str | None = None
) -> None:
    """Refuse, before any worker starts, a checkpoint that this run cannot continue; a LoRA checkpoint also when
    the weights of the base it was trained on are not those of this run's base (``start_model``'s)."""
    saved = state.get("config", {})
    problems = []
    if state.get("algorithm") != algorithm:
        problems.append(f"it is a {state.get('algorithm')} checkpoint and this is the {algorithm} flow")
    trained = ("actor", "critic") if algorithm == "ppo" else ("actor",)
    for role in trained:
        was, now = saved.get(role, {}).get("strategy", "ddp"), getattr(config, role).strategy
        if was != now:
            problems.append(f"it was trained with {role}.strategy={was} and this run has {role}.strategy={now}")
    # a sharded checkpoint loads on any number of workers (DCP reshards it); a DDP one on its own number only
    resharded = all(getattr(config, role).strategy == "fsdp2" for role in trained)
    if state.get("world_size") not in (None, config.trainer.n_workers) and not resharded:
        problems.append(
            f"it was written by {state['world_size']} actor workers and this run has "
            f"trainer.n_workers={config.trainer.n_workers} (with actor.strategy=fsdp2 it could load on any number)"
        )
    saved_model = saved.get("model", {}).get("path")
    if saved_model not in (None, config.model.path):
        problems.append(f"it trains model.path={saved_model!r} and this run names {config.model.path!r}")
    saved_lora = saved.get("actor", {}).get("lora", {}).get("rank", 0)
    if saved_lora != config.actor.lora.rank:
        problems.append(f"it was trained with actor.lora.rank={saved_lora} and this run has {config.actor.lora.rank}")
    elif saved_lora and start_model is not None:
        problems += _lora_base_problems(f"{path}/actor", start_model)
    if problems:
        raise CheckpointMismatch(
            f"cannot resume {path}: {'; '.join(problems)}. Fix: use the settings the run was started with, or start "
            "a new run (another trainer.run_name, or trainer.resume=never)."
        )


def _lora_base_problems(adapter_dir: str, start_model: str) -> list[str]:
    saved = lora.read_base(adapter_dir).get("sha256")
    base = base_model_path(resolve_model_path(start_model))
    if saved and lora.weights_fingerprint(base) != saved:
        return [
            f"its adapter was trained on a base model with other weights than {base} has now (sha256 "
            f"{saved[:12]}... then, {lora.weights_fingerprint(base)[:12]}... now)"
        ]
    return []


def check_runs_dir_writable(config: RLConfig) -> None:
    """Fail before anything starts when ``trainer.runs_dir`` cannot be written (permissions, credentials, a
    missing bucket): checkpoints would fail only at the first save, after minutes of training."""
    runs = config.trainer.runs_dir
    probe = f"{runs.rstrip('/') if is_remote(runs) else os.path.abspath(runs)}/.rlflow-write-test-{uuid.uuid4().hex}"
    try:
        write_json(probe, {"written_by": "rlflow pre-flight check"})
        fs, path = fsspec.core.url_to_fs(probe)
        fs.rm(path)
    except Exception as error:  # PermissionError, botocore's ClientError, NoCredentialsError...
        raise PermissionError(
            f"trainer.runs_dir={runs!r} cannot be written ({type(error).__name__}: {error}). "
            "Checkpoints, the run record and the final model go there. Fix: pick a folder you can "
            "write (or fix its permissions), or for s3:// check the bucket exists and the "
            "credentials (AWS_* variables, AWS_ENDPOINT_URL for an S3-compatible store)."
        ) from error


def _start_model(config: RLConfig) -> tuple[str, str]:
    """(pinned URI, folder) of the model a new run starts from; a named model (``tiny``, ``smollm2-135m-instruct``)
    becomes its local folder, a URL stays one (every node caches it)."""
    from mlflow.tracking import MlflowClient

    model_uri, model_dir = lineage.start_model(config, MlflowClient(), lineage.cache_root(config))
    if model_dir.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(model_dir)):
        raise FileNotFoundError(
            f"model.path={model_dir!r}: no such folder. Fix: name a folder that holds the model's "
            "config.json, weights and tokenizer, a Hugging Face hub name, `tiny`, `smollm2-135m-instruct`, or an "
            "MLflow reference (models:/<name>@<alias>)"
        )
    return model_uri, model_dir if is_remote(model_dir) else resolve_model_path(model_dir)


def _new_record(
    config: RLConfig,
    algorithm: str,
    root: str,
    experiment: str,
    tags: dict,
    flow_run_id: str | None,
    model_uri: str,
    model_dir: str,
) -> tuple[Tracker, lineage.RunRecord]:
    """A run's first attempt: pin its start model (and, in a lineage, its parent run and data cursor), then create
    its MLflow run and write its record."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    parent = None
    if config.trainer.lineage:
        found = client.get_experiment_by_name(experiment)
        parent = lineage.lineage_parent(client, found.experiment_id, config.trainer.lineage) if found else None
        own = f"models:/{lineage.registered_model_name(config)}/"
        if config.trainer.lineage_data == "from_champion" and model_uri.startswith(own):
            champion = client.get_model_version(*model_uri.removeprefix("models:/").rsplit("/", 1))
            parent = client.get_run(champion.run_id) if champion.run_id else parent
    cursor = (
        json.loads(parent.data.tags["rlflow.data_cursor"])
        if parent and "rlflow.data_cursor" in parent.data.tags
        else None
    )
    lineage_tags = {"rlflow.start_model": model_uri}
    if parent:
        lineage_tags["rlflow.parent_run_id"] = parent.info.run_id
    tracker = Tracker(experiment, config.trainer.run_name, tags={**tags, **lineage_tags})
    record = lineage.RunRecord(
        run_name=config.trainer.run_name,
        algorithm=algorithm,
        lineage=config.trainer.lineage,
        model_uri=model_uri,
        model_dir=model_dir,
        mlflow_run_id=tracker.run_id,
        prefect_flow_run_id=flow_run_id,
        parent_run_id=parent.info.run_id if parent else None,
        data_cursor=cursor,
    )
    record.write(root)
    return tracker, record
