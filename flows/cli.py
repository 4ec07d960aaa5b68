"""The ``rlflow`` command line.

    rlflow server up|down|status                              local Prefect + MLflow servers (127.0.0.1)
    rlflow train grpo --config demo trainer.total_steps=50    run a training flow (sft, grpo, ppo, online_dpo)
    rlflow runs                                               runs: lineage, parent, model version, status, links
    rlflow deploy                                             work pool, scheduled deployments, crash automations
    rlflow worker                                             a Prefect process worker that runs the deployments
    rlflow demo                                               SFT warm-up then GRPO on the built-in task
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from flows.services import server_app

app = typer.Typer(help="RL post-training of language models as Prefect flows over Ray worker groups.",
                  no_args_is_help=True, pretty_exceptions_show_locals=False)
app.add_typer(server_app, name="server")
console = Console()

ALGORITHMS = ("sft", "grpo", "ppo", "online_dpo")


def get_flow(algorithm: str):
    if algorithm == "sft":
        from flows.sft import sft as flow_fn
    elif algorithm == "grpo":
        from flows.grpo import grpo as flow_fn
    elif algorithm == "ppo":
        from flows.ppo import ppo as flow_fn
    elif algorithm == "online_dpo":
        from flows.online_dpo import online_dpo as flow_fn
    else:
        raise typer.BadParameter(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    return flow_fn


def use_running_services() -> None:
    """Point this process at the servers `rlflow server up` started, unless the environment already names some."""
    from flows.services import ServiceConfig, apply_service_env, service_status

    if os.environ.get("PREFECT_API_URL") and os.environ.get("MLFLOW_TRACKING_URI"):
        return
    status = service_status(ServiceConfig())
    if all(s.get("healthy") for s in status.values()) and status:
        apply_service_env({"PREFECT_API_URL": status["prefect"]["url"] + "/api",
                           "MLFLOW_TRACKING_URI": status["mlflow"]["url"]})


def run_training(algorithm: str, config, return_state: bool = False):
    """Run one training flow on the Ray task runner the config asks for (trainer.ray_address, ray_num_cpus)."""
    from flows.runtime import ray_task_runner

    runner = ray_task_runner(config.trainer.ray_address, config.trainer.ray_num_cpus)
    return get_flow(algorithm).with_options(task_runner=runner)(config=config, return_state=return_state)


@app.callback()
def main() -> None:
    """rlflow: run, resume and inspect RL post-training runs."""


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def train(
    algorithm: str = typer.Argument(..., help=f"one of {', '.join(ALGORITHMS)}"),
    config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML file or preset name in configs/"),
    overrides: Optional[list[str]] = typer.Argument(None, help="key.path=value overrides"),
) -> None:
    """Train: validates the config (before anything starts), then runs the flow."""
    from flows.config import ConfigError, load_config

    get_flow(algorithm)
    try:
        cfg = load_config(config, overrides or [])
    except (ConfigError, FileNotFoundError, ValueError) as error:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(2)
    use_running_services()
    state = run_training(algorithm, cfg, return_state=True)
    if not state.is_completed():
        console.print(f"[red]{state.name}: {state.message}[/red]")
        raise typer.Exit(1)
    metrics = state.result()
    console.print({k: round(v, 4) for k, v in (metrics or {}).items() if "score" in k or "loss" in k})


@app.command()
def runs(limit: int = typer.Option(20, help="most recent runs to list"),
         lineage: Optional[str] = typer.Option(None, help="only the runs of this lineage")) -> None:
    """List training runs: lineage, parent run, model version, status, and their Prefect and MLflow links."""
    import mlflow
    from mlflow.tracking import MlflowClient

    use_running_services()
    client = MlflowClient()
    table = Table()
    for column in ("run", "algorithm", "lineage", "parent", "model", "status", "steps"):
        table.add_column(column, no_wrap=True)  # names stay whole; the links fold instead
    for column in ("Prefect flow run", "MLflow run"):
        table.add_column(column, overflow="fold")
    base = mlflow.get_tracking_uri().rstrip("/")
    found = client.search_runs(experiment_ids=[e.experiment_id for e in client.search_experiments()],
                               filter_string=f"tags.`rlflow.lineage` = '{lineage}'" if lineage else "",
                               max_results=limit, order_by=["attributes.start_time DESC"])
    names = {r.info.run_id: r.info.run_name for r in found}
    for run in found:
        tags = run.data.tags
        steps = max((h.step for h in client.get_metric_history(run.info.run_id, "timing_s/step")), default=0)
        parent = tags.get("rlflow.parent_run_id", "")
        model = f"v{tags['rlflow.model_version']}" if "rlflow.model_version" in tags else ""
        if "rlflow.promoted" in tags:
            model += " promoted" if tags["rlflow.promoted"] == "true" else " rejected"
        table.add_row(tags.get("rlflow.run_name", run.info.run_name), tags.get("algorithm", ""),
                      tags.get("rlflow.lineage", ""), names.get(parent, parent), model, run.info.status, str(steps),
                      tags.get("prefect.flow_run_url", ""),
                      f"{base}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}")
    console.print(table)


@app.command()
def deploy() -> None:
    """Create (or update) the work pool, the deployments of deployments/prefect.yaml and the crash automations."""
    from flows.deploy import POOL, deploy_all, ensure_automations, ensure_work_pool
    from flows.services import require_prefect_api

    use_running_services()
    require_prefect_api()
    ensure_work_pool()
    console.print(deploy_all())
    for name in ensure_automations():
        console.print(f"automation: {name}")
    console.print(f"Start a worker to run them: [bold]rlflow worker[/bold] (or `prefect worker start --pool {POOL}`)")


@app.command()
def worker(limit: int = typer.Option(1, help="flow runs at once on this machine")) -> None:
    """Run a Prefect process worker on the rlflow pool: it starts the scheduled runs and watches their processes."""
    from flows.deploy import POOL
    from flows.services import require_prefect_api

    use_running_services()
    require_prefect_api()
    os.execvp(sys.executable, [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--type",
                               "process", "--limit", str(limit)])


@app.command()
def demo(
    sft_steps: Optional[int] = typer.Option(None, help="override the SFT steps of configs/demo-sft.yaml"),
    grpo_steps: Optional[int] = typer.Option(None, help="override the GRPO steps of configs/demo.yaml"),
) -> None:
    """Start the services, SFT-warm the tiny model, then GRPO; print before/after accuracy and where to look."""
    from flows.demo import main as run_demo

    run_demo(sft_steps=sft_steps, grpo_steps=grpo_steps)


if __name__ == "__main__":
    app()
