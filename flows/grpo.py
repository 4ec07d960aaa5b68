"""GRPO (DeepSeekMath, arXiv:2402.03300) as a Prefect flow: the controller of the HybridFlow single-controller design.

Each step, for a batch of prompts:
  1. sample ``rollout.n`` responses per prompt                  generate_sequences  (rollout: the actor group)
  2. score them, and in parallel recompute the rollout policy's  compute_reward      (reward group)
     log-probs and the reference's                               compute_log_prob / compute_ref_log_prob
  3. advantages: each response's reward against its group's      compute_advantage   (pure function)
  4. PPO-clip update of the policy (+ KL to the reference)       update_actor        (actor group)
then validate / checkpoint on schedule. Between two steps with neither, step 1 of the next step is submitted while
step 4 runs, waiting for it (``wait_for``): it starts as soon as the update ends, not after the flow has heard of it.
With ``algorithm.rollout_correction.bypass_mode`` (verl's bypass mode) the rollout's own log-probs are the old
policy's: step 2 has no ``compute_log_prob``. With ``async_training.staleness`` = k, step 1 of the next k steps is
submitted before step 4, which waits for it: those batches are sampled by the policy of before this update, and
``rollout_correction`` weighs them against the policy that trains on them. With ``rollout.n_workers`` the rollout is
a pool of its own: it gets the actor's weights after each update (``sync_rollout_weights``), and step 4 no longer waits
for the generations ahead, which run beside it.
Run it with ``rlflow train grpo --config demo``.
"""

from __future__ import annotations

from prefect import flow

from flows.config import RLConfig
from flows.controller.groups import ray_task_runner
from flows.controller.run_start import start_run
from flows.lineages.lineage import flow_run_name
from flows.stages import (
    compute_advantage,
    compute_log_prob,
    compute_ref_log_prob,
    compute_reward,
    generate_sequences,
    update_actor,
)

CRITICAL_PATH = [["gen"], ["reward", "old_log_prob", "ref"], ["adv"], ["update_actor"]]


@flow(
    name="grpo",
    task_runner=ray_task_runner(),
    persist_result=False,
    validate_parameters=True,
    flow_run_name=flow_run_name,
)
def grpo(config: RLConfig) -> dict:
    run = start_run(config, "grpo", roles=("actor", "rollout", "ref", "reward"))
    actor, rollout, ref, reward = (run.groups[k] for k in ("actor", "rollout", "ref", "reward"))
    algorithm = config.algorithm.model_dump()
    bypass = config.algorithm.rollout_correction.bypass_mode

    def generate(step, after=None):  # 1 for the prompts of `step`, once the futures `after` and the rollout are ready
        return generate_sequences.submit(rollout, run.next_prompts(step), step, wait_for=run.rollout_ready(after))

    # the numbered comments line up with the steps of the module docstring
    # fmt: off
    with run.training():  # the workers released and the MLflow run closed, however it ends
        run.validate_start()
        for step in run.steps:
            with run.step(step, CRITICAL_PATH) as metrics:
                gen = run.submitted_ahead(step) or generate(step)                                       # 1
                scores = compute_reward.submit(reward, gen, step)                                       # 2
                old = [] if bypass else [compute_log_prob.submit(actor, gen, step)]
                ref_lp = compute_ref_log_prob.submit(ref, gen, step)
                batch = compute_advantage.submit(gen, [scores, *old, ref_lp], algorithm, run.kl_ctrl_state, step)  # 3
                # async_training.staleness = k: the next k steps' generations start now, on the weights of before
                stale = run.submit_stale_ahead(step, gen, generate)
                update = update_actor.submit(actor, batch, step, wait_for=stale or None)                # 4
                run.sync_rollout_weights(step, update)  # a rollout pool of its own gets the new weights
                # on-policy: the next step's generation starts as soon as this update ends (nothing due in between)
                run.submit_ahead(step + 1, lambda: generate(step + 1, after=[update]))
                result = update.result()
                run.keep_kl_ctrl_state(result.kl_ctrl_state)
                metrics.update(result.metrics)
        run.publish()  # evaluate, save and register the final model; in a lineage, gate it (maybe a person's approval)
    # fmt: on
    return run.last_metrics
