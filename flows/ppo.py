"""PPO with a critic and GAE (Schulman et al. 2017; the InstructGPT/verl recipe) as a Prefect flow.

Each step, for a batch of prompts:
  1. sample responses                                            generate_sequences  (rollout: the actor group)
  2. in parallel: score them, recompute the rollout policy's     compute_reward / compute_log_prob /
     log-probs, the reference's, and the critic's values          compute_ref_log_prob / compute_values
  3. KL-shaped rewards (optional) and GAE advantages + returns   compute_advantage   (pure function)
  4. in parallel: PPO-clip policy update, clipped value update   update_actor / update_critic
Between two steps with no validation or checkpoint, step 1 of the next step is submitted while step 4 runs, waiting
for both updates (``wait_for``), as in ``flows/grpo.py``. With ``algorithm.rollout_correction.bypass_mode`` the
rollout's own log-probs are the old policy's (no ``compute_log_prob``); ``async_training.staleness`` and a rollout
pool of its own (``rollout.n_workers``) work as in ``flows/grpo.py``.
Run it with ``rlflow train ppo --config demo algorithm.adv_estimator=gae``.
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
    compute_values,
    generate_sequences,
    update_actor,
    update_critic,
)

CRITICAL_PATH = [["gen"], ["reward", "old_log_prob", "ref", "values"], ["adv"], ["update_actor", "update_critic"]]


@flow(
    name="ppo",
    task_runner=ray_task_runner(),
    persist_result=False,
    validate_parameters=True,
    flow_run_name=flow_run_name,
)
def ppo(config: RLConfig) -> dict:
    run = start_run(config, "ppo", roles=("actor", "rollout", "ref", "critic", "reward"))
    actor, rollout, ref, critic, reward = (run.groups[k] for k in ("actor", "rollout", "ref", "critic", "reward"))
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
                gen = run.submitted_ahead(step) or generate(step)                                   # 1
                old = [] if bypass else [compute_log_prob.submit(actor, gen, step)]                 # 2
                parts = [compute_reward.submit(reward, gen, step), *old,
                         compute_ref_log_prob.submit(ref, gen, step), compute_values.submit(critic, gen, step)]
                batch = compute_advantage.submit(gen, parts, algorithm, run.kl_ctrl_state, step)    # 3
                # async_training.staleness = k: the next k steps' generations start now, on the weights of before
                stale = run.submit_stale_ahead(step, gen, generate)
                critic_result = update_critic.submit(critic, batch, step)                           # 4
                update = update_actor.submit(actor, batch, step, wait_for=stale or None)
                run.sync_rollout_weights(step, update)  # a rollout pool of its own gets the new weights
                # on-policy: the next step's generation starts as soon as both updates end (nothing due in between)
                run.submit_ahead(step + 1, lambda: generate(step + 1, after=[critic_result, update]))
                result = update.result()
                run.keep_kl_ctrl_state(result.kl_ctrl_state)
                metrics.update(critic_result.result())
                metrics.update(result.metrics)
        run.publish()  # evaluate, save and register the final model; in a lineage, gate it (maybe a person's approval)
    # fmt: on
    return run.last_metrics
