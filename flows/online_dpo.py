"""Online DPO (as in the HybridFlow tutorial: on-policy pairs each step) as a Prefect flow.

Each step, for a batch of prompts:
  1. sample ``rollout.n`` responses per prompt                     generate_sequences   (actor group)
  2. score them; reference log-probs of every response             compute_reward / compute_ref_log_prob
  3. pair the best and the worst response of each prompt            make_preference_pairs (rlworkers.algorithms)
     (prompts whose responses all score the same give no pair)
  4. DPO update of the policy against the reference                 update_actor_dpo     (actor group)
Run it with ``rlflow train online_dpo --config demo rollout.n=4``.
"""

from __future__ import annotations

from prefect import flow

from flows.config import RLConfig
from flows.controller.groups import ray_task_runner
from flows.controller.run_start import start_run
from flows.lineages.lineage import flow_run_name
from flows.stages import (
    IDEMPOTENT,
    compute_ref_log_prob,
    compute_reward,
    generate_sequences,
    stage,
    update_actor_dpo,
)
from rlworkers.algorithms.batch_ops import compute_data_metrics, make_preference_pairs
from rlworkers.protocol import DataProto

CRITICAL_PATH = [["gen"], ["reward", "ref"], ["pairs"], ["update_actor"]]


@stage("make_preference_pairs", IDEMPOTENT, timing="pairs")
def preference_pairs(batch: DataProto, parts: list[DataProto], world_size: int, beta: float, step: int) -> DataProto:
    """Merge the reward and reference columns into the batch, then pair it (``make_preference_pairs``)."""
    for part in parts:
        batch.union(part)
    pairs = make_preference_pairs(batch, world_size)
    metrics = {**compute_data_metrics(batch), "dpo/pairs": len(pairs) // 2}
    pairs.meta_info.update(dpo_beta=beta, data_metrics=metrics)
    return pairs


@flow(
    name="online_dpo",
    task_runner=ray_task_runner(),
    persist_result=False,
    validate_parameters=True,
    flow_run_name=flow_run_name,
)
def online_dpo(config: RLConfig) -> dict:
    run = start_run(config, "online_dpo", roles=("actor", "ref", "reward"))
    actor, ref, reward = run.groups["actor"], run.groups["ref"], run.groups["reward"]
    # the numbered comments line up with the steps of the module docstring
    # fmt: off
    with run.training():  # the workers released and the MLflow run closed, however it ends
        run.validate_start()
        for step in run.steps:
            with run.step(step, CRITICAL_PATH) as metrics:
                gen = generate_sequences.submit(actor, run.next_prompts(), step)                    # 1
                parts = [compute_reward.submit(reward, gen, step), compute_ref_log_prob.submit(ref, gen, step)]  # 2
                pairs = preference_pairs.submit(gen, parts, config.trainer.n_workers,               # 3
                                                config.algorithm.dpo_beta, step)
                metrics.update(update_actor_dpo.submit(actor, pairs, step).result())                # 4
        run.publish()  # evaluate, save and register the final model; in a lineage, gate it (maybe a person's approval)
    # fmt: on
    return run.last_metrics
