"""Supervised fine-tuning (the warm-up before RL) as a Prefect flow.

Each step: one batch of ``prompt + response`` pairs, next-token cross-entropy on the response tokens,
one optimizer step on every data-parallel worker (``sft_step``); a task runs ``trainer.steps_per_task`` such steps
(one unless configured, for steps so short that a task's orchestration shows). Validation generates greedily and
scores with the reward function. Run it with ``rlflow train sft --config demo-sft``.
"""

from __future__ import annotations

from prefect import flow

from flows.config import RLConfig
from flows.controller.groups import ray_task_runner
from flows.controller.run_start import start_run
from flows.lineages.lineage import flow_run_name
from flows.stages import sft_step


@flow(
    name="sft",
    task_runner=ray_task_runner(),
    persist_result=False,
    validate_parameters=True,
    flow_run_name=flow_run_name,
)
def sft(config: RLConfig) -> dict:
    run = start_run(config, "sft", roles=("actor", "reward"))
    actor = run.groups["actor"]
    with run.training():  # the workers released and the MLflow run closed, however it ends
        run.validate_start()
        for steps in run.step_blocks(config.trainer.steps_per_task):  # one step per task unless configured
            with run.step_block(steps, [["sft_step"]]) as metrics:
                batches = [run.next_sft_batch() for _ in steps]
                metrics.extend(sft_step.submit(actor, batches, steps[0], steps[-1]).result())
        run.publish()  # evaluate, save and register the final model; in a lineage, gate it (maybe a person's approval)
    return run.last_metrics
