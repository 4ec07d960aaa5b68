"""Runs and lineages: what a run starts from, what it hands on, and when it counts as done.

Three lifetimes (../shared/DESIGN.md): an *attempt* is one execution of a Prefect flow run and may die at any
moment; a *run* is one training job (``<runs_dir>/<run_name>/``: its checkpoints, its MLflow run); a *lineage*
(``trainer.lineage``) is what a deployment trains, one run per schedule tick:

- each run of lineage ``L`` is named ``L-<UTC time of the flow run's scheduled start>-<flow run id[:6]>``, which is
  also the Prefect flow-run name, the run folder and the MLflow run name; attempts of the same flow run keep the
  name, so they resume the same run;
- it starts from the lineage's champion (``models:/<registered model>@<alias>``), or from ``model.path`` while the
  lineage has none; it continues the data cursor of the lineage's last finished run;
- at the end it registers its model as a new version and moves the alias to it when the promotion gate says so
  (``flows/lineages/evaluation.py``: the final model against the champion *as it is then*, paired on the same held-out
  examples); every version carries its eval results, the decision and the comparison (``flows/lineages/versions.py``).

``run.json`` (written by a run's first attempt, before any worker starts) pins what every later attempt must
reuse: the resolved start model, the MLflow run, the parent run and the data cursor. ``result.json`` (written after
publishing) marks the run complete: running a complete run again is an error (``RunAlreadyComplete``), never a
silent success, unless ``trainer.republish`` asks to publish it again.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import fsspec

from flows.config import MODEL_REFERENCE, RLConfig
from rlworkers.checkpoint import read_json, write_json
from rlworkers.storage import COMPLETE_MARKER, staged_dir

logger = logging.getLogger(__name__)

RESTART_STATE_NAME = "Restarting"  # the Scheduled state the restart automation sets (flows/ops/deploy.py)
RECORD_FILE = "run.json"
RESULT_FILE = "result.json"


class RunAlreadyComplete(RuntimeError):
    """The run already trained all its steps and published its result."""


class ModelReferenceError(RuntimeError):
    """An MLflow model reference that does not resolve; the message names what exists."""


class RestartBudgetExhausted(RuntimeError):
    """The flow run crashed more often than ``trainer.max_crash_restarts`` allows."""


# ---------------------------------------------------------------------------------------------- naming
def run_name(config: RLConfig, algorithm: str) -> str:
    """The run's name: ``trainer.run_name``; for a lineage, ``<lineage>-<UTC scheduled start>-<flow run id[:6]>``
    (kept by every attempt of the flow run; the id tells apart runs queued in the same second, e.g. two clicks on
    Run); otherwise the algorithm's name."""
    if config.trainer.run_name:
        return config.trainer.run_name
    if not config.trainer.lineage:
        return algorithm
    from prefect.runtime import flow_run

    lineage = config.trainer.lineage
    current = flow_run.get_name() or ""
    if re.fullmatch(rf"{re.escape(lineage)}-\d{{8}}T\d{{6}}Z-[0-9a-f]{{6}}", current):
        return current
    start = flow_run.get_scheduled_start_time() or datetime.now(timezone.utc)
    run_id = (flow_run.get_id() or uuid.uuid4().hex).replace("-", "")[:6]
    return f"{lineage}-{start.astimezone(timezone.utc):%Y%m%dT%H%M%SZ}-{run_id}"


def flow_run_name() -> str:
    """``flow_run_name=`` of every training flow: the Prefect flow run is named after the run it trains."""
    from prefect.runtime import flow_run

    from flows.config import validate_config

    config = validate_config(flow_run.get_parameters()["config"])
    return run_name(config, flow_run.get_flow_name() or "run")


# ---------------------------------------------------------------------------------------------- run record
@dataclass
class RunRecord:
    """What every attempt of a run must reuse (``<run>/run.json``)."""

    run_name: str
    algorithm: str
    lineage: str | None
    model_uri: str  # what the run started from, pinned (models:/name/3, runs:/..., or a path)
    model_dir: str  # local folder holding that model and its tokenizer
    mlflow_run_id: str
    prefect_flow_run_id: str | None
    parent_run_id: str | None = None  # the lineage's previous finished run
    data_cursor: dict | None = None  # where the parent's data loader stopped

    @classmethod
    def read(cls, root: str) -> "RunRecord | None":
        try:
            return cls(**read_json(f"{root}/{RECORD_FILE}"))
        except FileNotFoundError:
            return None

    def write(self, root: str) -> None:
        write_json(f"{root}/{RECORD_FILE}", asdict(self))


def read_result(root: str) -> dict | None:
    try:
        return read_json(f"{root}/{RESULT_FILE}")
    except FileNotFoundError:
        return None


def write_result(root: str, result: dict) -> None:
    write_json(f"{root}/{RESULT_FILE}", result)


def registered_model_name(config: RLConfig) -> str | None:
    return config.trainer.register_model_name or config.trainer.lineage


def start_model(config: RLConfig, client, cache_root: str) -> tuple[str, str]:
    """(pinned URI or path, local folder) of the model a new run starts from: the lineage's champion if it has
    one, else ``model.path`` (a path, ``tiny``, or an MLflow reference)."""
    name = registered_model_name(config)
    if config.trainer.lineage and name:
        champion = champion_version(client, name, config.trainer.promotion_alias)
        if champion is not None:
            uri = f"models:/{name}/{champion.version}"
            return uri, download_model(uri, client, cache_root)
        logger.info(
            "lineage %s has no %s yet: starting from model.path=%s",
            config.trainer.lineage,
            config.trainer.promotion_alias,
            config.model.path,
        )
    path = config.model.path
    if MODEL_REFERENCE.match(path):
        uri = pin_reference(path, client)
        return uri, download_model(uri, client, cache_root)
    return path, path


def champion_version(client, name: str, alias: str):
    """The model version ``alias`` points to, or None when the model or the alias does not exist."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as error:
        if error.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            return None
        raise


def pin_reference(uri: str, client) -> str:
    """``models:/name@alias`` -> ``models:/name/<version>`` (so every attempt loads the same weights).

    Raises:
        ModelReferenceError: the registered model, alias, version or run does not exist; names what does.
    """
    from mlflow.exceptions import MlflowException

    if uri.startswith("runs:/"):
        run_id = uri.split("/")[1]
        try:
            client.get_run(run_id)
        except MlflowException:
            raise ModelReferenceError(f"model.path={uri}: MLflow has no run {run_id}") from None
        return uri
    name, alias, version = _parse_models_uri(uri)
    models = {m.name: m for m in client.search_registered_models()}
    if name not in models:
        raise ModelReferenceError(
            f"model.path={uri}: no registered model {name!r} in MLflow ({_describe_models(models)}). Train and "
            "register it first (e.g. run the lineage that publishes it), or point model.path at a folder."
        )
    if alias:
        found = champion_version(client, name, alias)
        if found is None:
            raise ModelReferenceError(
                f"model.path={uri}: {name!r} has no alias {alias!r} ({_describe_models({name: models[name]})}); "
                "no version of it has been promoted yet"
            )
        return f"models:/{name}/{found.version}"
    try:
        client.get_model_version(name, version)
    except MlflowException:
        raise ModelReferenceError(
            f"model.path={uri}: {name!r} has no version {version} ({_describe_models({name: models[name]})})"
        ) from None
    return uri


def _parse_models_uri(uri: str) -> tuple[str, str | None, str | None]:
    body = uri.removeprefix("models:/")
    if "@" in body:
        name, alias = body.split("@", 1)
        return name, alias, None
    name, version = body.rsplit("/", 1)
    return name, None, version


def _describe_models(models: dict) -> str:
    if not models:
        return "there are no registered models"
    parts = []
    for name, model in sorted(models.items()):
        aliases = ", ".join(f"@{a}=v{v}" for a, v in sorted((model.aliases or {}).items()))
        latest = max((int(v.version) for v in model.latest_versions or []), default=0)
        parts.append(f"{name} (latest v{latest}{', ' + aliases if aliases else ''})")
    return "registered: " + "; ".join(parts)


def download_model(uri: str, client, cache_root: str) -> str:
    """Download a pinned model reference once into ``<cache_root>/<key>/hf`` and return that folder, which holds the
    model and its tokenizer together (MLflow's transformers flavour stores them apart). ``cache_root`` is under
    ``trainer.runs_dir``, so on object storage every node's workers read the model from there."""
    import mlflow

    key = re.sub(r"[^A-Za-z0-9_.-]+", "-", uri.split(":/", 1)[1]).strip("-")
    target = f"{cache_root.rstrip('/')}/{key}/hf"
    fs, path = fsspec.core.url_to_fs(target)
    if fs.exists(f"{path}/{COMPLETE_MARKER}"):
        return target
    if fs.exists(path):
        fs.rm(path, recursive=True)  # an earlier download that did not finish
    with tempfile.TemporaryDirectory(prefix="rlflow-model-") as tmp:
        downloaded = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=tmp))
        weights = next(
            (
                p.parent
                for name in ("config.json", "adapter_config.json")  # a model, or a LoRA adapter (rlworkers.models.lora)
                for p in downloaded.rglob(name)
                if "components" not in p.parts
            ),
            None,
        )
        if weights is None:
            raise ModelReferenceError(
                f"{uri} holds no Hugging Face model (no config.json, nor a LoRA adapter's adapter_config.json, in its "
                "artifacts)"
            )
        with staged_dir(target) as hf_dir:
            for source in [weights, *(p for p in [downloaded / "components" / "tokenizer"] if p.is_dir())]:
                for item in source.iterdir():
                    if item.is_file():
                        shutil.copy2(item, f"{hf_dir}/{item.name}")
    fs.pipe_file(f"{path}/{COMPLETE_MARKER}", b"")  # last: the folder is whole
    return target


def lineage_parent(client, experiment_id: str, lineage: str):
    """The lineage's last MLflow run to finish (its data cursor is where the next run continues): by the time it
    finished, not started, as a run that started earlier may have finished later."""
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`rlflow.lineage` = '{lineage}' and attributes.status = 'FINISHED'",
        order_by=["attributes.end_time DESC"],
        max_results=1,
    )
    return runs[0] if runs else None


def continue_data_cursor(loader, cursor: dict) -> str:
    """Move ``loader`` to where the parent run's loader stopped; returns a sentence for the log.

    The same dataset continues exactly (rows, not batches, are counted, so a new batch size is fine); a dataset
    of another size is a new dataset: it starts at a new epoch."""
    rows = len(loader.rows)
    if cursor.get("num_rows") != rows:
        loader.load_state_dict({**loader.state_dict(), "epoch": int(cursor["epoch"]) + 1, "position": 0})
        return (
            f"the dataset changed ({cursor.get('num_rows')} -> {rows} rows): starting epoch "
            f"{loader.epoch} at its first batch"
        )
    consumed = int(cursor["position"]) * int(cursor["batch_size"])
    position, epoch = consumed // loader.batch_size, int(cursor["epoch"])
    if position >= len(loader):
        position, epoch = 0, epoch + 1
    loader.load_state_dict({**loader.state_dict(), "epoch": epoch, "position": position, "seed": cursor["seed"]})
    return f"continuing the lineage's data at epoch {epoch}, row {position * loader.batch_size} of {rows}"


# ---------------------------------------------------------------------------------------------- attempts
def count_crashes(flow_run_id) -> int:
    """How often a flow run crashed since a person or a schedule last started it: CRASHED states after its last
    SCHEDULED state that was not an automatic restart (named "Restarting", see flows/ops/deploy.py).

    One crash can be reported twice (the process worker and its runner both see the process exit; the second
    report may land after the automation already set "Restarting"): a CRASHED right after "Restarting", with no
    attempt in between, is that late report and is not counted."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        states = sorted(client.read_flow_run_states(flow_run_id), key=lambda state: state.timestamp)
    crashes, previous = 0, None
    for state in states:
        if state.type.value == "SCHEDULED" and state.name != RESTART_STATE_NAME:
            crashes = 0
        elif state.type.value == "CRASHED" and not (previous is not None and previous.name == RESTART_STATE_NAME):
            crashes += 1
        previous = state
    return crashes


def check_restart_budget(max_restarts: int) -> int:
    """How often this flow run crashed before this attempt; raises once that is more than ``max_restarts``."""
    from prefect.runtime import flow_run

    flow_run_id = flow_run.get_id()
    crashes = count_crashes(flow_run_id) if flow_run_id else 0
    if crashes > max_restarts:
        raise RestartBudgetExhausted(
            f"this flow run crashed {crashes} times; automatic restarts are capped at trainer.max_crash_restarts="
            f"{max_restarts}. Find the cause in the logs of the crashed attempts, then start it again (Retry in the "
            "Prefect UI gives it a new restart budget): it resumes from its newest checkpoint."
        )
    return crashes


def summary_markdown(record: RunRecord, result: dict) -> str:
    lines = [
        f"# {record.run_name}",
        "",
        "| | |",
        "|---|---|",
        f"| lineage | {record.lineage or '-'} |",
        f"| started from | `{record.model_uri}` |",
        f"| parent run | {record.parent_run_id or '-'} |",
        f"| MLflow run | {record.mlflow_run_id} |",
    ]
    for key in ("steps", "val/score/mean", "model_uri", "model_version", "decision", "data_epoch"):
        if key in result:
            lines.append(f"| {key} | {result[key]} |")
    return "\n".join(lines) + "\n"


def cache_root(config: RLConfig) -> str:
    runs = config.trainer.runs_dir
    return f"{os.path.abspath(runs) if '://' not in runs else runs.rstrip('/')}/_models"
