"""GRPO (DeepSeekMath, arXiv:2402.03300) as a Prefect flow: the controller of the HybridFlow single-controller design.

Each step, for a batch of prompts:
  1. sample ``rollout.n`` responses per prompt                  generate_sequences  (actor group)
  2. score them, and in parallel recompute the rollout policy's  compute_reward      (reward group)
     log-probs and the reference's                               compute_log_prob / compute_ref_log_prob
  3. advantages: each response's reward against its group's      compute_advantage   (pure function)
  4. PPO-clip update of the policy (+ KL to the reference)       update_actor        (actor group)
then validate / checkpoint on schedule. Between two steps with neither, step 1 of the next step is submitted while
step 4 runs, waiting for it (``wait_for``): it starts as soon as the update ends, not after the flow has heard of it.
With ``algorithm.rollout_correction.bypass_mode`` (verl's bypass mode) the rollout's own log-probs are the old
policy's: step 2 has no ``compute_log_prob``.
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
    run = start_run(config, "grpo", roles=("actor", "ref", "reward"))
    actor, ref, reward = run.groups["actor"], run.groups["ref"], run.groups["reward"]
    algorithm = config.algorithm.model_dump()
    bypass = config.algorithm.rollout_correction.bypass_mode

    def generate(step, after=None):  # 1 for the prompts of `step`; once the futures `after` (an update) completed
        return generate_sequences.submit(actor, run.next_prompts(), step, wait_for=after)

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
                update = update_actor.submit(actor, batch, step)                                        # 4
                # the next step's generation starts as soon as this update ends (when nothing is due in between)
                run.submit_ahead(step + 1, lambda: generate(step + 1, after=[update]))
                result = update.result()
                run.keep_kl_ctrl_state(result.kl_ctrl_state)
                metrics.update(result.metrics)
        run.publish()  # evaluate, save and register the final model; in a lineage, gate it (maybe a person's approval)
    # fmt: on
    return run.last_metrics
