"""The RL stages as Prefect tasks: each calls one WorkerGroup method (or one pure function) and returns what the
next stage needs. On the Ray task runner every ``.submit()`` runs in Ray's task host, and a future passed to the
next stage goes to it there, not through the flow process.

Task runs are named ``<stage>-step-<N>`` (the training step they belong to; validation before training is step 0).
Every stage is declared with ``@stage`` (name, retry policy, timing) and records ``timing_s/<stage>`` (seconds spent
in the call); the stage that returns the step's metrics reports those of the stages before it, which its batch
carries.

Retry policy, per stage:
- pure or idempotent stages (reward, log-probs, values, advantages, validation, checkpoint) retry in place, twice,
  unless a worker died or hung (retrying a call on a dead actor cannot succeed);
- stages that change state (generate consumes RNG; updates change weights) do not retry in place.
A step that fails because a worker died or hung is redone by the flow's loop: ``flows.controller.recovery.recover``
replaces the lost workers and restores the newest checkpoint (``trainer.max_restarts`` times at most).
"""

from __future__ import annotations

import dataclasses
import functools
import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlworkers.algorithms.batch_ops import apply_bypass_mode, compute_data_metrics
from rlworkers.algorithms.batch_ops import compute_advantage as compute_advantage_fn
from rlworkers.algorithms.kl import get_kl_controller
from rlworkers.algorithms.rollout_correction import apply_rollout_correction
from rlworkers.checkpoint import CheckpointSaveError, apply_retention, begin_checkpoint, commit_checkpoint, write_json
from rlworkers.protocol import DataProto
from rlworkers.single_controller import WorkerError


def _worker_alive(task, task_run, state) -> bool:
    """Retry in place unless a worker died or hung: a call on a dead actor cannot succeed, and recovery (a
    restart from the last checkpoint, see ``flows.controller.recovery.recover``) is what follows."""
    try:
        state.result()
    except WorkerError as error:
        return not error.actor_died
    except Exception:
        return True
    return True


@dataclasses.dataclass
class PolicyUpdate:
    """What a policy update returns to the flow: the step's metrics (the update's, the data's, every stage's timing)
    and the adaptive KL controller's state, which the next step's advantage stage starts from."""

    metrics: dict[str, float]
    kl_ctrl_state: dict | None = None


STAGE = {"cache_policy": NO_CACHE, "persist_result": False}
IDEMPOTENT = {**STAGE, "retries": 2, "retry_delay_seconds": 1, "retry_condition_fn": _worker_alive}
STATEFUL = {**STAGE, "retries": 0}


def task_run_name(stage: str, step: int | str, last: int | None = None) -> str:
    """The name of a stage's task run: ``<stage>-step-<step>``, ``...-to-<last>`` for a block of steps (one name
    format: ``flows.controller.recovery.failed_stages`` finds a step's failed stages by it)."""
    return f"{stage}-step-{step}" + (f"-to-{last}" if last not in (None, step) else "")


def is_task_run_of_step(name: str, step: int) -> bool:
    """Whether the task run called ``name`` (see ``task_run_name``) ran ``step``, alone or first of a block."""
    return name.endswith(f"-step-{step}") or f"-step-{step}-to-" in name


def timed(name: str):
    """Decorate a stage function so it records ``timing_s/<name>``, the seconds spent in its call: in the
    ``meta_info`` of the DataProto it returns (``union`` carries it on to the next stages), or, for a stage that
    returns the step's metrics (a dict, or a ``PolicyUpdate``'s), among them beside the timings its input batches
    carry."""
    key = f"timing_s/{name}"

    def decorate(stage):
        @functools.wraps(stage)  # Prefect reads the stage's signature (task_run_name uses ``step``)
        def timed_stage(*args, **kwargs):
            start = time.perf_counter()
            out = stage(*args, **kwargs)
            seconds = time.perf_counter() - start
            if isinstance(out, DataProto):
                out.meta_info[key] = seconds
                return out
            batches = [arg for arg in (*args, *kwargs.values()) if isinstance(arg, DataProto)]
            earlier = {k: v for batch in batches for k, v in batch.meta_info.items() if k.startswith("timing_s/")}
            if isinstance(out, PolicyUpdate):
                return dataclasses.replace(out, metrics={**out.metrics, **earlier, key: seconds})
            return {**out, **earlier, key: seconds}

        return timed_stage

    return decorate


def stage(name: str, policy: dict, timing: str | None = None):
    """Declare a stage task: Prefect task ``name`` with the retry ``policy`` (``IDEMPOTENT`` or ``STATEFUL``), its
    runs named ``<name>-step-<step>``, ``@timed(timing)`` when ``timing`` is given."""

    def decorate(fn):
        body = timed(timing)(fn) if timing else fn
        return task(name=name, task_run_name=task_run_name(name, "{step}"), **policy)(body)  # Prefect fills {step}

    return decorate


# --------------------------------------------------------------------------------------------------- stages
@stage("generate_sequences", STATEFUL, timing="gen")
def generate_sequences(actor_rollout, prompts: DataProto, step: int) -> DataProto:
    return actor_rollout.generate_sequences(prompts)


@stage("sync_rollout_weights", IDEMPOTENT, timing="sync_weights")
def sync_rollout_weights(actor, rollout, step: int) -> dict:
    """A rollout pool of its own (``rollout.n_workers``) gets the actor's weights after ``step``'s update."""
    rollout.set_policy_weights(actor.get_policy_weights()[0])
    return {}


@stage("compute_reward", IDEMPOTENT, timing="reward")
def compute_reward(reward, batch: DataProto, step: int) -> DataProto:
    return reward.compute_rm_score(batch)


@stage("compute_log_prob", IDEMPOTENT, timing="old_log_prob")
def compute_log_prob(actor, batch: DataProto, step: int) -> DataProto:
    out = actor.compute_log_prob(batch)
    out.meta_info.pop("temperature", None)
    return out


@stage("compute_ref_log_prob", IDEMPOTENT, timing="ref")
def compute_ref_log_prob(ref, batch: DataProto, step: int) -> DataProto:
    return ref.compute_ref_log_prob(batch)


@stage("compute_values", IDEMPOTENT, timing="values")
def compute_values(critic, batch: DataProto, step: int) -> DataProto:
    return critic.compute_values(batch)


@stage("compute_advantage", IDEMPOTENT, timing="adv")
def compute_advantage(
    batch: DataProto, parts: list[DataProto], algorithm: dict, kl_ctrl_state: dict | None, step: int
) -> DataProto:
    """Merge the stage outputs into the batch and add advantages (a pure function of its inputs). In bypass mode
    (``algorithm.rollout_correction.bypass_mode``) the rollout's log-probs are the old policy's; otherwise its
    ``rollout_is`` / ``rollout_rs`` weigh the tokens and mask out the rejected ones before the advantages."""
    for part in parts:
        batch.union(part)
    correction = algorithm["rollout_correction"]
    if correction["bypass_mode"]:
        apply_bypass_mode(batch)
    correction_metrics = {}
    if correction["rollout_is"] or correction["rollout_rs"]:  # weights for the loss, rejected tokens masked out
        correction_metrics = apply_rollout_correction(
            batch, **{key: value for key, value in correction.items() if key != "bypass_mode"}
        )
    kl_ctrl = None
    if algorithm["use_kl_in_reward"]:
        kl_ctrl = get_kl_controller(algorithm["kl_ctrl"])
        if kl_ctrl_state:
            kl_ctrl.load_state_dict(kl_ctrl_state)
    batch, kl_metrics = compute_advantage_fn(
        batch,
        algorithm["adv_estimator"],
        gamma=algorithm["gamma"],
        lam=algorithm["lam"],
        norm_adv_by_std_in_grpo=algorithm["norm_adv_by_std_in_grpo"],
        kl_ctrl=kl_ctrl,
        kl_penalty=algorithm["kl_penalty"],
    )
    batch.meta_info["data_metrics"] = {**compute_data_metrics(batch), **kl_metrics, **correction_metrics}
    batch.meta_info["kl_ctrl_state"] = kl_ctrl.state_dict() if kl_ctrl is not None else None
    return batch


@stage("update_actor", STATEFUL, timing="update_actor")
def update_actor(actor, batch: DataProto, step: int) -> PolicyUpdate:
    """PPO/GRPO policy update: the step's metrics (update, data, every stage's timing) and the KL controller's
    state for the next step."""
    return PolicyUpdate(
        metrics={**_mean_metrics(actor.update_actor(batch)), **batch.meta_info["data_metrics"]},
        kl_ctrl_state=batch.meta_info.get("kl_ctrl_state"),
    )


@stage("update_critic", STATEFUL, timing="update_critic")
def update_critic(critic, batch: DataProto, step: int) -> dict:
    return _mean_metrics(critic.update_critic(batch))


def _sft_run_name() -> str:
    from prefect.runtime import task_run

    return task_run_name("sft_step", task_run.parameters["step"], task_run.parameters["last_step"])


@task(name="sft_step", task_run_name=_sft_run_name, **STATEFUL)
def sft_step(actor, batches: list[DataProto], step: int, last_step: int) -> list[dict]:
    """SFT steps ``step`` to ``last_step``, one batch each (``trainer.steps_per_task``; the run is named
    ``sft_step-step-<step>``, or ``...-to-<last_step>`` for a block): each step's metrics with its
    ``timing_s/sft_step``."""
    out = []
    for batch in batches:
        start = time.perf_counter()
        metrics = _mean_metrics(actor.sft_step(batch))
        out.append({**metrics, "timing_s/sft_step": time.perf_counter() - start})
    return out


@stage("update_actor_dpo", STATEFUL, timing="update_actor")
def update_actor_dpo(actor, batch: DataProto, step: int) -> dict:
    """DPO update on (chosen, rejected) row pairs; a step without pairs changes nothing."""
    metrics = _mean_metrics(actor.update_actor_dpo(batch)) if len(batch) else {}
    return {**metrics, **batch.meta_info.get("data_metrics", {})}


@stage("validate", IDEMPOTENT, timing="validate")
def validate(actor_rollout, reward, prompts: DataProto, step: int) -> DataProto:
    """Greedy generation on the validation prompts, scored by the reward worker."""
    prompts.meta_info.update(do_sample=False, n=1)
    gen = actor_rollout.generate_sequences(prompts)
    gen.union(reward.compute_rm_score(gen))
    return gen


@stage("evaluate", IDEMPOTENT, timing="evaluate")
def evaluate(actor_rollout, scorer, prompts: DataProto, step: int) -> DataProto:
    """Generation on an eval set's prompts (greedy unless ``prompts.meta_info`` asks for seeded samples: the eval
    set's ``sampling``), scored by the set's scorer (not the training reward)."""
    prompts.meta_info.setdefault("do_sample", False)
    prompts.meta_info.setdefault("n", 1)
    gen = actor_rollout.generate_sequences(prompts)
    gen.union(scorer.compute_rm_score(gen))
    return gen


@stage("save_checkpoint", IDEMPOTENT)
def save_checkpoint(
    root: str, step: int, roles: dict, trainer_state: dict, keep_last: int, previous: str | None
) -> tuple[str, dict]:
    """Workers write their state into ``<root>/step_<N>/<role>/``, then the manifest commits it (atomically).
    Retention runs only after the commit, so ``previous`` (the run's newest checkpoint) is intact whatever fails.

    Raises:
        CheckpointSaveError: a write failed (the store, not a worker): the message names what is still there.
    """
    step_dir = f"{root}/step_{step}"
    try:
        begin_checkpoint(root, step, overwrite=True)
        for role, group in roles.items():
            group.save_checkpoint(f"{step_dir}/{role}")
        write_json(f"{step_dir}/trainer_state.json", trainer_state)
        manifest = commit_checkpoint(
            step_dir, {"step": step, "world_size": trainer_state["world_size"]}, required=["trainer_state.json"]
        )
    except WorkerError as error:
        if error.actor_died:
            raise  # a lost or hung worker: the step is redone after a restart (flows.controller.recovery.recover)
        cause = str(error.cause).strip().splitlines()[0] if str(error.cause).strip() else ""
        raise CheckpointSaveError(
            step_dir, previous, f"rank {error.rank} failed in {error.method}: {type(error.cause).__name__}: {cause}"
        ) from error
    except Exception as error:  # OSError, botocore's EndpointConnectionError / ClientError, gcsfs's HttpError...
        raise CheckpointSaveError(step_dir, previous, f"{type(error).__name__}: {error}") from error
    apply_retention(root, keep_last)
    return step_dir, manifest


def _mean_metrics(out: DataProto) -> dict[str, float]:
    """Per-rank metrics (lists after the group's concat) -> their mean."""
    metrics = {}
    for key, value in out.meta_info.get("metrics", {}).items():
        values = value if isinstance(value, list) else [value]
        metrics[key] = float(sum(values) / len(values))
    return metrics
