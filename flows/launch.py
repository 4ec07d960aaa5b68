"""Run a training flow by its algorithm's name: what ``rlflow train`` and the demo (``flows/ops/demo.py``) call."""

from __future__ import annotations

from flows.controller.startup import mark_flow_called
from rlworkers.process_start import collector_off_while_importing

ALGORITHMS = ("sft", "grpo", "ppo", "online_dpo")


def get_flow(algorithm: str):
    """The Prefect flow of ``algorithm``.

    Raises:
        ValueError: ``algorithm`` is not one of ``ALGORITHMS``.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    with collector_off_while_importing():  # torch, transformers, Prefect, MLflow: see rlworkers/process_start.py
        if algorithm == "sft":
            from flows.sft import sft as flow_fn
        elif algorithm == "grpo":
            from flows.grpo import grpo as flow_fn
        elif algorithm == "ppo":
            from flows.ppo import ppo as flow_fn
        else:
            from flows.online_dpo import online_dpo as flow_fn
    return flow_fn


def run_training(algorithm: str, config, return_state: bool = False):
    """Run one training flow; it starts Ray as its config asks (trainer.ray_address, trainer.ray_num_cpus)."""
    flow_fn = get_flow(algorithm)
    mark_flow_called()  # the end of the start-up's first phase (flows/controller/startup.py)
    return flow_fn(config=config, return_state=return_state)
