"""The RL stages as Prefect tasks: each calls one WorkerGroup method (or one pure function) and returns what the
next stage needs. On RayTaskRunner every ``.submit()`` runs in a Ray worker; futures passed between stages stay in
Ray's object store and never pass through the flow process.

Task runs are named ``<stage>-step-<N>`` (the training step they belong to; validation before training is step 0).
Every stage records ``timing_s/<stage>`` (seconds spent in the call) in the returned DataProto's ``meta_info``;
the flow adds them up into the step's metrics.

Retry policy, per stage:
- pure or idempotent stages (reward, log-probs, values, advantages, validation, checkpoint) retry in place, twice,
  unless a worker died or hung (retrying a call on a dead actor cannot succeed);
- stages that change state (generate consumes RNG; updates change weights) do not retry in place.
A step that fails because a worker died or hung is redone by the flow's loop: ``Run.recover`` replaces the lost
workers and restores the newest checkpoint (``trainer.max_restarts`` times at most).
"""

from __future__ import annotations

import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlworkers.algorithms.batch_ops import compute_advantage as compute_advantage_fn
from rlworkers.algorithms.batch_ops import compute_data_metrics
from rlworkers.algorithms.kl import get_kl_controller
from rlworkers.protocol import DataProto
from rlworkers.single_controller import WorkerError


def _worker_alive(task, task_run, state) -> bool:
    """Retry in place unless a worker died or hung: a call on a dead actor cannot succeed, and recovery (a
    restart from the last checkpoint, see ``Run.recover``) is what follows."""
    try:
        state.result()
    except WorkerError as error:
        return not error.actor_died
    except Exception:
        return True
    return True


STAGE = {"cache_policy": NO_CACHE, "persist_result": False}
IDEMPOTENT = {**STAGE, "retries": 2, "retry_delay_seconds": 1, "retry_condition_fn": _worker_alive}
STATEFUL = {**STAGE, "retries": 0}


def _timed(out: DataProto, name: str, start: float) -> DataProto:
    out.meta_info[f"timing_s/{name}"] = time.perf_counter() - start
    return out


# --------------------------------------------------------------------------------------------------- stages
@task(name="generate_sequences", task_run_name="generate_sequences-step-{step}", **STATEFUL)
def generate_sequences(actor_rollout, prompts: DataProto, step: int) -> DataProto:
    start = time.perf_counter()
    return _timed(actor_rollout.generate_sequences(prompts), "gen", start)


@task(name="compute_reward", task_run_name="compute_reward-step-{step}", **IDEMPOTENT)
def compute_reward(reward, batch: DataProto, step: int) -> DataProto:
    start = time.perf_counter()
    return _timed(reward.compute_rm_score(batch), "reward", start)


@task(name="compute_log_prob", task_run_name="compute_log_prob-step-{step}", **IDEMPOTENT)
def compute_log_prob(actor, batch: DataProto, step: int) -> DataProto:
    start = time.perf_counter()
    out = actor.compute_log_prob(batch)
    out.meta_info.pop("temperature", None)
    return _timed(out, "old_log_prob", start)


@task(name="compute_ref_log_prob", task_run_name="compute_ref_log_prob-step-{step}", **IDEMPOTENT)
def compute_ref_log_prob(ref, batch: DataProto, step: int) -> DataProto:
    start = time.perf_counter()
    return _timed(ref.compute_ref_log_prob(batch), "ref", start)


@task(name="compute_values", task_run_name="compute_values-step-{step}", **IDEMPOTENT)
def compute_values(critic, batch: DataProto, step: int) -> DataProto:
    start = time.perf_counter()
    return _timed(critic.compute_values(batch), "values", start)


@task(name="compute_advantage", task_run_name="compute_advantage-step-{step}", **IDEMPOTENT)
def compute_advantage(batch: DataProto, parts: list[DataProto], algorithm: dict, kl_ctrl_state: dict | None,
                      step: int) -> DataProto:
    """Merge the stage outputs into the batch and add advantages (a pure function of its inputs)."""
    start = time.perf_counter()
    for part in parts:
        batch.union(part)
    kl_ctrl = None
    if algorithm["use_kl_in_reward"]:
        kl_ctrl = get_kl_controller(algorithm["kl_ctrl"])
        if kl_ctrl_state:
            kl_ctrl.load_state_dict(kl_ctrl_state)
    batch, kl_metrics = compute_advantage_fn(
        batch, algorithm["adv_estimator"], gamma=algorithm["gamma"], lam=algorithm["lam"],
        norm_adv_by_std_in_grpo=algorithm["norm_adv_by_std_in_grpo"], kl_ctrl=kl_ctrl,
        kl_penalty=algorithm["kl_penalty"])
    batch.meta_info["data_metrics"] = {**compute_data_metrics(batch), **kl_metrics}
    batch.meta_info["kl_ctrl_state"] = kl_ctrl.state_dict() if kl_ctrl is not None else None
    return _timed(batch, "adv", start)


@task(name="update_actor", task_run_name="update_actor-step-{step}", **STATEFUL)
def update_actor(actor, batch: DataProto, step: int) -> dict:
    """PPO/GRPO policy update. Returns the step's metrics: update, data and every stage's timing."""
    start = time.perf_counter()
    out = actor.update_actor(batch)
    return {"metrics": {**_mean_metrics(out), "timing_s/update_actor": time.perf_counter() - start,
                        **batch.meta_info["data_metrics"], **_timings(batch)},
            "kl_ctrl_state": batch.meta_info.get("kl_ctrl_state")}


@task(name="update_critic", task_run_name="update_critic-step-{step}", **STATEFUL)
def update_critic(critic, batch: DataProto, step: int) -> dict:
    start = time.perf_counter()
    out = critic.update_critic(batch)
    return {**_mean_metrics(out), "timing_s/update_critic": time.perf_counter() - start}


@task(name="sft_step", task_run_name="sft_step-step-{step}", **STATEFUL)
def sft_step(actor, batch: DataProto, step: int) -> dict:
    start = time.perf_counter()
    out = actor.sft_step(batch)
    return {**_mean_metrics(out), "timing_s/sft_step": time.perf_counter() - start}


@task(name="update_actor_dpo", task_run_name="update_actor_dpo-step-{step}", **STATEFUL)
def update_actor_dpo(actor, batch: DataProto, step: int) -> dict:
    """DPO update on (chosen, rejected) row pairs; a step without pairs changes nothing."""
    start = time.perf_counter()
    metrics = _mean_metrics(actor.update_actor_dpo(batch)) if len(batch) else {}
    return {**metrics, **batch.meta_info.get("data_metrics", {}), **_timings(batch),
            "timing_s/update_actor": time.perf_counter() - start}


@task(name="validate", task_run_name="validate-step-{step}", **IDEMPOTENT)
def validate(actor_rollout, reward, prompts: DataProto, step: int) -> DataProto:
    """Greedy generation on the validation prompts, scored by the reward worker."""
    start = time.perf_counter()
    prompts.meta_info.update(do_sample=False, n=1)
    gen = actor_rollout.generate_sequences(prompts)
    gen.union(reward.compute_rm_score(gen))
    return _timed(gen, "validate", start)


def _mean_metrics(out: DataProto) -> dict[str, float]:
    """Per-rank metrics (lists after the group's concat) -> their mean."""
    metrics = {}
    for key, value in out.meta_info.get("metrics", {}).items():
        values = value if isinstance(value, list) else [value]
        metrics[key] = float(sum(values) / len(values))
    return metrics


def _timings(batch: DataProto) -> dict[str, float]:
    return {k: v for k, v in batch.meta_info.items() if k.startswith("timing_s/")}
