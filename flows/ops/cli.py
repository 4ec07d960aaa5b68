"""The ``rlflow`` command line.

rlflow server up|down|status                              local Prefect + MLflow servers (127.0.0.1)
rlflow train grpo --config demo trainer.total_steps=50    run a training flow (sft, grpo, ppo, online_dpo)
rlflow runs                                               runs: lineage, parent, model version, status, links
rlflow deploy                                             work pool, scheduled deployments, crash automations
rlflow worker                                             a Prefect process worker that runs the deployments
rlflow demo                                               SFT warm-up then GRPO on the built-in task
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from pathlib import Path
from typing import Any, NoReturn, Optional

import pydantic
import typer
from rich.console import Console
from rich.table import Table

from flows.launch import ALGORITHMS, get_flow, run_training
from flows.ops.preflight import server_failure_message, use_running_services
from flows.ops.services import CONTROLLER, LOCAL_RAY, ServiceConfig, service_status, start_services, stop_services
from flows.plumbing.servers import (
    LOCAL_HOSTS,
    MLFLOW_TRACKING_URI,
    PREFECT_API_URL,
    ServiceError,
    require_mlflow_tracking,
    require_prefect_api,
)


class _Commands(typer.Typer):
    """The command line: a Prefect or MLflow request that still fails after its client's retries ends the command
    with one line naming the server, its URL and the request (flows.ops.preflight.server_failure_message), exit
    status 3, instead of a traceback through httpx or requests."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except Exception as error:
            message = server_failure_message(error)
            if message is None:
                raise
            console.print(f"[red]{message}[/red]")
            raise SystemExit(3) from None


app = _Commands(
    help="RL post-training of language models as Prefect flows over Ray worker groups.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
server_app = typer.Typer(
    help="Start, stop and inspect the local Prefect API server and MLflow tracking server.", no_args_is_help=True
)
app.add_typer(server_app, name="server")
console = Console()


def use_services(prefect: bool = False, mlflow: bool = False) -> None:
    """Point this process at the running servers (unless the environment names others) and check the ones it needs,
    credentials included; a problem ends the command with its fix, before anything starts."""
    use_running_services()
    try:
        if prefect:
            require_prefect_api()
        if mlflow:
            require_mlflow_tracking()
    except ServiceError as error:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(2) from None


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

    try:
        get_flow(algorithm)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    try:
        cfg = load_config(config, overrides or [])
        cfg.check_algorithm(algorithm)
    except (ConfigError, FileNotFoundError, ValueError) as error:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(2)
    use_services(prefect=True, mlflow=True)
    import signal

    from prefect.exceptions import TerminationSignal

    def stop(signum, _frame):
        raise TerminationSignal(signal=signum)

    # Prefect's flow engine turns SIGTERM into TerminationSignal, but after the run's own clean-up it re-sends the
    # signal to the handler it found (SIG_DFL: the process dies before the flow run is marked Crashed). With this
    # one the re-sent signal raises again, the engine marks the run Crashed, and the command exits below.
    signal.signal(signal.SIGTERM, stop)
    try:
        state = run_training(algorithm, cfg, return_state=True)
    except (KeyboardInterrupt, TerminationSignal) as stop:
        signum = getattr(stop, "signal", 2)  # SIGINT raises KeyboardInterrupt
        console.print(
            f"[red]stopped by signal {signum}: the workers are stopped, the MLflow run is KILLED and the Prefect "
            f"flow run Crashed. The same command resumes from the run's last checkpoint.[/red]"
        )
        raise typer.Exit(128 + signum) from None
    if not state.is_completed():
        console.print(f"[red]{state.name}: {state.message}[/red]")
        raise typer.Exit(1)
    metrics = state.result()
    console.print({k: round(v, 4) for k, v in (metrics or {}).items() if "score" in k or "loss" in k})


@app.command()
def runs(
    limit: int = typer.Option(20, help="most recent runs to list"),
    lineage: Optional[str] = typer.Option(None, help="only the runs of this lineage"),
) -> None:
    """List training runs: lineage, parent run, model version, status, and their Prefect and MLflow links."""
    import mlflow
    from mlflow.tracking import MlflowClient

    use_services(mlflow=True)
    client = MlflowClient()
    table = Table()
    for column in ("run", "algorithm", "lineage", "parent", "model", "status", "steps"):
        table.add_column(column, no_wrap=True)  # names stay whole; the links fold instead
    for column in ("Prefect flow run", "MLflow run"):
        table.add_column(column, overflow="fold")
    base = mlflow.get_tracking_uri().rstrip("/")
    found = client.search_runs(
        experiment_ids=[e.experiment_id for e in client.search_experiments()],
        filter_string=f"tags.`rlflow.lineage` = '{lineage}'" if lineage else "",
        max_results=limit,
        order_by=["attributes.start_time DESC"],
    )
    names = {r.info.run_id: r.info.run_name for r in found}
    for run in found:
        tags = run.data.tags
        steps = max((h.step for h in client.get_metric_history(run.info.run_id, "timing_s/step")), default=0)
        parent = tags.get("rlflow.parent_run_id", "")
        model = f"v{tags['rlflow.model_version']}" if "rlflow.model_version" in tags else ""
        if "rlflow.promoted" in tags:
            model += " promoted" if tags["rlflow.promoted"] == "true" else " rejected"
        table.add_row(
            tags.get("rlflow.run_name", run.info.run_name),
            tags.get("algorithm", ""),
            tags.get("rlflow.lineage", ""),
            names.get(parent, parent),
            model,
            run.info.status,
            str(steps),
            tags.get("prefect.flow_run_url", ""),
            f"{base}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}",
        )
    console.print(table)
    if lineage:
        _print_champion_history(client, lineage)


def _print_champion_history(client, name: str) -> None:
    from mlflow.exceptions import MlflowException

    from flows.lineages.versions import champion_history

    try:
        moves = champion_history(client, name)
    except MlflowException:  # no registered model (yet) under the lineage's name
        return
    history = Table(title=f"{name}: champion history (oldest first)")
    for column in ("when (UTC)", "alias", "version", "before", "how", "reason"):
        history.add_column(column, overflow="fold")
    for move in moves:
        before = f"v{move['previous']}" if move["previous"] else ""
        history.add_row(move["at"], move["alias"], f"v{move['version']}", before, move["how"], move["reason"])
    console.print(history)


@app.command()
def promote(
    lineage: str = typer.Argument(..., help="the lineage (its registered model's name)"),
    version: str = typer.Option(..., "--version", help="the model version to make the champion"),
    reason: str = typer.Option(..., "--reason", help="why (recorded on the version and in the history)"),
    alias: str = typer.Option("champion", help="the alias to move (trainer.promotion_alias)"),
) -> None:
    """Make a model version the lineage's champion by hand; the next run starts from it."""
    from mlflow.tracking import MlflowClient

    from flows.lineages.lineage import ModelReferenceError
    from flows.lineages.versions import promote_by_hand

    use_services(mlflow=True)
    try:
        move = promote_by_hand(MlflowClient(), lineage, alias=alias, version=version, reason=reason)
    except ModelReferenceError as error:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(1) from None
    console.print(f"{lineage}@{alias}: v{move['previous']} -> v{move['version']} ({reason})")


@app.command()
def rollback(
    lineage: str = typer.Argument(..., help="the lineage (its registered model's name)"),
    reason: str = typer.Option(..., "--reason", help="why (recorded on the version left and in the history)"),
    alias: str = typer.Option("champion", help="the alias to move back (trainer.promotion_alias)"),
) -> None:
    """Move the lineage's champion back to the version it was before; the next run starts from that one."""
    from mlflow.tracking import MlflowClient

    from flows.lineages.lineage import ModelReferenceError
    from flows.lineages.versions import rollback as roll_back

    use_services(mlflow=True)
    try:
        move = roll_back(MlflowClient(), lineage, alias, reason)
    except ModelReferenceError as error:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(1) from None
    console.print(f"{lineage}@{alias}: v{move['previous']} -> v{move['version']} ({move['how']}: {reason})")


@app.command()
def deploy() -> None:
    """Create (or update) the work pool, the deployments of deployments/prefect.yaml and the crash automations."""
    from flows.ops.deploy import POOL, deploy_all, ensure_automations, ensure_work_pool

    use_services(prefect=True)
    ensure_work_pool()
    console.print(deploy_all())
    for name in ensure_automations():
        console.print(f"automation: {name}")
    console.print(f"Start a worker to run them: [bold]rlflow worker[/bold] (or `prefect worker start --pool {POOL}`)")


@app.command()
def worker(limit: int = typer.Option(1, help="flow runs at once on this machine")) -> None:
    """Run a Prefect process worker on the rlflow pool: it starts the scheduled runs and watches their processes;
    a crashed run the restart automation missed is restarted from here (flows/ops/deploy.py)."""
    import signal
    import subprocess

    from flows.ops.deploy import CRASH_CHECK_EVERY_S, POOL

    use_services(prefect=True)
    command = [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--type", "process"]
    prefect_worker = subprocess.Popen([*command, "--limit", str(limit)])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # then stop the Prefect worker too
    try:
        while prefect_worker.poll() is None:
            try:
                prefect_worker.wait(timeout=CRASH_CHECK_EVERY_S)
            except subprocess.TimeoutExpired:
                _restart_missed_crashes()
    finally:
        if prefect_worker.poll() is None:
            prefect_worker.terminate()
            prefect_worker.wait(30)
    raise typer.Exit(prefect_worker.returncode)


def _restart_missed_crashes() -> None:
    from flows.ops.deploy import restart_missed_crashes

    try:
        for name in restart_missed_crashes():
            console.print(f"rlflow worker: restarting crashed run {name!r} (the restart automation did not act)")
    except Exception as error:  # the server is briefly unreachable: the next check tries again
        console.print(f"rlflow worker: could not check for crashed runs: {error}")


@app.command()
def demo(
    sft_steps: Optional[int] = typer.Option(None, help="override the SFT steps of configs/demo-sft.yaml"),
    grpo_steps: Optional[int] = typer.Option(None, help="override the GRPO steps of the demo's GRPO config"),
    model: str = typer.Option(
        "tiny",
        help="tiny: SFT then GRPO on the tiny model (configs/demo*.yaml); smollm2-135m-instruct: SFT then GRPO on "
        "that real chat model (configs/real-sft.yaml, configs/real-gsm8k.yaml)",
    ),
    agent: bool = typer.Option(
        False, "--agent", help="SmolLM2 learns to call a calculator tool: SFT then GRPO (configs/agent*.yaml)"
    ),
    environment: bool = typer.Option(
        False,
        "--environment",
        help="SmolLM2 in a multi-turn environment that answers a wrong sum with 'Wrong, try again.': GRPO alone "
        "(configs/agent-env.yaml)",
    ),
) -> None:
    """Start the services, train the demo (SFT, then GRPO); print before/after accuracy and where to look."""
    from flows.ops.demo import main as run_demo

    run_demo(sft_steps=sft_steps, grpo_steps=grpo_steps, model=model, agent=agent, environment=environment)


# ---------------------------------------------------------------------------------------------- rlflow server
_StateDir = typer.Option(None, "--state-dir", help="State folder [default: $RLFLOW_HOME or ./.rlflow].")


def _cli_config(state_dir: Path | None, **overrides: Any) -> ServiceConfig:
    values = {k: v for k, v in overrides.items() if v is not None}
    if state_dir is not None:
        values["state_dir"] = state_dir
    try:
        return ServiceConfig(**values)
    except pydantic.ValidationError as error:
        for problem in error.errors():
            console.print(f"[red]{'.'.join(map(str, problem['loc']))}: {problem['msg']}[/red]")
        raise typer.Exit(2) from None


@server_app.command()
def up(
    state_dir: Path | None = _StateDir,
    host: str = typer.Option("127.0.0.1", help="Interface to bind; 0.0.0.0 exposes both servers."),
    prefect_port: int = typer.Option(4200, help="Port of the Prefect API server and UI."),
    mlflow_port: int = typer.Option(5000, help="Port of the MLflow tracking server and UI."),
    ray_port: int = typer.Option(6390, help="Port of the local Ray that runs join (always on 127.0.0.1)."),
    ray_cpus: Optional[int] = typer.Option(None, help="Logical CPUs of the local Ray [default: max(8, cores)]."),
    timeout: float = typer.Option(90.0, help="Seconds to wait for both health endpoints."),
    postgres: str | None = typer.Option(
        None,
        envvar="RLFLOW_POSTGRES",
        help="postgresql://user:password@host:port: both servers keep their state there (databases 'prefect' and "
        "'mlflow', created when missing) instead of SQLite files",
    ),
    artifacts: str | None = typer.Option(
        None, envvar="RLFLOW_ARTIFACTS", help="where MLflow stores artifacts and models, e.g. s3://bucket/mlflow"
    ),
    auth: str | None = typer.Option(
        None,
        envvar="RLFLOW_SERVER_AUTH",
        show_default=False,
        help="user:password both servers ask every client for (better from $RLFLOW_SERVER_AUTH than the command "
        "line); clients export the same RLFLOW_SERVER_AUTH and source env.sh",
    ),
) -> None:
    """Start both servers, a local Ray and the controller fork server in the background (or reuse running ones) and
    print their URLs. Runs of this machine join that Ray when they are given no other, and build their workers in
    the processes the run before kept there (flows/plumbing/kept.py); `rlflow` commands start in children of the fork
    server, with everything imported (flows/plumbing/forkserver.py); `rlflow server down` ends them."""
    config = _cli_config(
        state_dir,
        host=host,
        prefect_port=prefect_port,
        mlflow_port=mlflow_port,
        ray_port=ray_port,
        ray_cpus=ray_cpus,
        startup_timeout_s=timeout,
        postgres=postgres,
        artifacts=artifacts,
        auth=auth,
    )
    try:
        with console.status("Starting the Prefect and MLflow servers and a local Ray..."):
            urls = start_services(config)
    except ServiceError as error:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(1) from None
    table = Table(title=f"rlflow services ({config.state_dir})")
    for column in ("service", "pid", "UI", "client setting"):
        table.add_column(column, overflow="fold")
    table.add_row("Prefect", str(urls["prefect_pid"]), urls["prefect_ui"], f"{PREFECT_API_URL}={urls[PREFECT_API_URL]}")
    table.add_row(
        "MLflow", str(urls["mlflow_pid"]), urls["mlflow_ui"], f"{MLFLOW_TRACKING_URI}={urls[MLFLOW_TRACKING_URI]}"
    )
    table.add_row("Ray", str(urls["ray_pid"]), "-", f"{LOCAL_RAY}={urls[LOCAL_RAY]}")
    table.add_row("Controller", str(urls["controller_pid"]), "-", f"{CONTROLLER}={urls[CONTROLLER]}")
    console.print(table)
    console.print(f"Point this shell at them:  [bold]source {urls['env_file']}[/bold]")
    if config.auth:
        console.print(
            "Both servers ask for the user and password of RLFLOW_SERVER_AUTH: export it (same value) in every shell "
            "that runs rlflow, a worker or a flow, before sourcing env.sh. The UIs ask for them in the browser."
        )
    if config.host not in LOCAL_HOSTS:
        console.print(
            f"[yellow]Bound to {config.host}: both servers accept connections from the network"
            + ("" if config.auth else ", without authentication (set RLFLOW_SERVER_AUTH=user:password and restart)")
            + ". MLflow accepts only localhost and private-IP Host headers (see `mlflow server --allowed-hosts`)."
            "[/yellow]"
        )


@server_app.command()
def down(state_dir: Path | None = _StateDir) -> None:
    """Stop both servers and the local Ray, with the worker processes kept there (idempotent)."""
    stopped = stop_services(_cli_config(state_dir))
    for name, was_running in stopped.items():
        typer.echo(f"{name}: {'stopped' if was_running else 'was not running'}")


@server_app.command()
def status(state_dir: Path | None = _StateDir) -> None:
    """Show url, pid and health of both servers, the local Ray and the controller fork server; exit code 1 unless all
    are healthy (the fork server may still be starting: commands run in their own process until it answers)."""
    states = service_status(_cli_config(state_dir))
    table = Table()
    for column in ("service", "url", "pid", "alive", "healthy"):
        table.add_column(column, overflow="fold")
    for name, state in states.items():
        starting = name == "controller" and state["alive"] and not state["healthy"]
        healthy = "[yellow]starting[/yellow]" if starting else _yes_no(state["healthy"])
        table.add_row(name, state["url"], str(state["pid"] or "-"), _yes_no(state["alive"]), healthy)
    console.print(table)
    unhealthy = [s for name, s in states.items() if not s["healthy"] and not (name == "controller" and s["alive"])]
    for state in unhealthy:
        console.print(f"log: {state['log']}")
    if unhealthy:
        raise typer.Exit(1)


def _yes_no(flag: bool) -> str:
    return "[green]yes[/green]" if flag else "[red]no[/red]"


def run_command() -> NoReturn:
    """The `rlflow` command: ``app``, then the end of the process without Python's own tear-down, which spends
    seconds freeing the objects of torch, transformers, Prefect and MLflow one by one for a process that is about to
    go (docs/performance.md). What must run still does, in the order Python's exit runs it: the
    non-daemon threads are waited for (``threading._shutdown``, as at exit), then the exit handlers (Prefect's
    event and log flushes, MLflow's async logging, Ray's shutdown, logging's), then the streams are flushed."""
    try:
        app()
        code = 0
    except SystemExit as done:
        code = done.code
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)  # what sys.exit("message") prints
        code = 1
    threading._shutdown()  # private, as is the next one: what Python's exit calls, with no public names
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run_command()
