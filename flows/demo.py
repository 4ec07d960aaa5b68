"""`make demo`: the whole product on this machine in about ten minutes.

1. starts the local Prefect and MLflow servers (`rlflow server up`);
2. SFT-warms the tiny offline model on 2-digit addition (configs/demo-sft.yaml), as a Prefect flow on Ray;
3. runs GRPO from the SFT model (configs/demo.yaml);
4. prints the validation accuracy before and after each phase, and where to look in the Prefect and MLflow UIs.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.table import Table

console = Console()


def _val_history(run_id: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return [
        (m.step, m.value)
        for m in sorted(MlflowClient().get_metric_history(run_id, "val/score/mean"), key=lambda m: m.step)
    ]


def main(sft_steps: int | None = None, grpo_steps: int | None = None) -> None:
    from mlflow.tracking import MlflowClient

    from flows.config import load_config, runs_root
    from flows.launch import run_training
    from flows.preflight import apply_service_env
    from flows.services import ServiceConfig, start_services

    urls = start_services(ServiceConfig())
    apply_service_env(urls)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    sft_overrides = [f"trainer.run_name=demo-sft-{stamp}", "trainer.resume=never"]
    if sft_steps:
        sft_overrides += [
            f"trainer.total_steps={sft_steps}",
            f"trainer.save_freq={sft_steps}",
            f"trainer.test_freq={sft_steps}",
        ]
    sft_config = load_config("demo-sft", sft_overrides)
    grpo_overrides = [f"trainer.run_name=demo-grpo-{stamp}", "trainer.resume=never"]
    if grpo_steps:
        grpo_overrides += [f"trainer.total_steps={grpo_steps}"]
    load_config("demo", grpo_overrides)  # validate both configs before anything starts

    console.rule("1/2  SFT warm-up")
    started = time.time()
    run_training("sft", sft_config)
    seconds = {"sft": time.time() - started}
    sft_model = f"{runs_root(sft_config)}/final_model"
    console.rule("2/2  GRPO from the SFT model")
    grpo_config = load_config("demo", grpo_overrides + [f"model.path={sft_model}"])
    run_training("grpo", grpo_config)
    seconds["grpo"] = time.time() - started - seconds["sft"]

    client = MlflowClient()
    experiment_id = client.get_experiment_by_name(sft_config.trainer.project_name).experiment_id
    table = Table(
        "phase",
        "steps",
        "val accuracy before",
        "val accuracy after",
        "wall time",
        title="2-digit addition, 200 held-out sums, greedy exact match",
    )
    links = []
    for phase, config in (("sft", sft_config), ("grpo", grpo_config)):
        name = config.trainer.run_name
        run = client.search_runs([experiment_id], filter_string=f"tags.`rlflow.run_name` = '{name}'")[0]
        history = _val_history(run.info.run_id)
        table.add_row(
            phase,
            str(config.trainer.total_steps),
            f"{history[0][1]:.1%}",
            f"{history[-1][1]:.1%}",
            f"{seconds[phase]:.0f} s",
        )
        links.append(f"  {phase}: {urls['mlflow_ui']}/#/experiments/{experiment_id}/runs/{run.info.run_id}")
    console.print(table)
    console.print(f"done in {time.time() - started:.0f} s")
    console.print("MLflow runs:\n" + "\n".join(links))
    console.print(f"Prefect UI (flow runs, task runs per stage, checkpoint artifacts): {urls['prefect_ui']}")
    console.print(f"MLflow UI (metrics, params, sample generations, model): {urls['mlflow_ui']}")
    console.print(f"Checkpoints and final models: {runs_root(sft_config)} and {runs_root(grpo_config)}")
    console.print("Stop the servers with `.venv/bin/rlflow server down`.")
