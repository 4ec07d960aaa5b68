"""MLflow tracking for one training run (one MLflow run, resumed by id) and the Prefect artifacts beside it.

Everything is logged from the flow process with an explicit ``run_id`` (MLflow's fluent active run is
thread-local). Metric names keep verl's spelling (``critic/score/mean``, ``timing_s/gen``); characters MLflow
rejects (``@``, ``(``, ...) are replaced, so a metric name can never crash training (verl #119, #984).
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Metric, Param, RunTag
from mlflow.environment_variables import MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS
from mlflow.tracking import MlflowClient

from rlworkers.storage import local_dir

logger = logging.getLogger(__name__)

_INVALID = re.compile(r"[^A-Za-z0-9_\-. /:]")


def sanitize_metric_name(name: str) -> str:
    return _INVALID.sub("_", name.replace("@", "_at_"))


@dataclass(frozen=True)
class LoggedAdapter:
    """What ``Tracker.log_adapter`` logged: the names of MLflow's ModelInfo that callers read."""

    model_uri: str
    registered_model_version: int | None


class Tracker:
    """One MLflow run. ``run_id`` continues an existing run (a later attempt of the same training run); without
    it, a run tagged with the same ``rlflow.run_name`` is continued if one exists, else a new one is created."""

    def __init__(self, experiment: str, run_name: str, *, run_id: str | None = None, tags: dict | None = None):
        # MLflow's async logging sends every queued log_batch as a request of its own: one per training step, ~7 a
        # second in the demo's SFT. Buffered for a second, the steps queued meanwhile go as one request: the MLflow
        # server's CPU during those steps fell from 0.06 to 0.01 cores and the steps were ~7% shorter (2 cores).
        # A value set in the environment wins.
        os.environ.setdefault(MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS.name, "1")
        self.client = MlflowClient()
        self._sending: list = []  # MLflow RunOperations of metrics logged without waiting
        existing = self.client.get_experiment_by_name(experiment)
        self.experiment_id = existing.experiment_id if existing else self.client.create_experiment(experiment)
        if run_id is None:
            found = self.client.search_runs(
                [self.experiment_id], max_results=1, filter_string=f"tags.`rlflow.run_name` = '{run_name}'"
            )
            run_id = found[0].info.run_id if found else None
        if run_id:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            self.resumed = True
            if tags:
                self.set_tags(tags)
        else:
            tags = {"rlflow.run_name": run_name, **(tags or {})}
            self.run_id = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags).info.run_id
            self.resumed = False

    @property
    def url(self) -> str:
        base = mlflow.get_tracking_uri().rstrip("/")
        if base.startswith("http"):
            return f"{base}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        return f"mlflow run {self.run_id} in {base}"

    def log_params(self, params: dict[str, Any]) -> None:
        if self.resumed:  # params are immutable in MLflow and were logged by the first attempt
            return
        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for start in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[start : start + 100])

    def set_tags(self, tags: dict[str, Any]) -> None:
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_metrics(self, metrics: dict[str, float], step: int, wait: bool = True) -> None:
        """Log ``metrics`` at ``step``, time-stamped now. ``wait=False``: MLflow's async logging sends them from its
        own thread, in order (a training step does not wait for the server); ``finish`` waits for them."""
        now = int(time.time() * 1000)
        items = [
            Metric(sanitize_metric_name(k), float(v), now, step)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and math.isfinite(float(v))
        ]
        for start in range(0, len(items), 500):
            sent = self.client.log_batch(self.run_id, metrics=items[start : start + 500], synchronous=wait)
            if sent is not None:
                self._sending.append(sent)

    def log_table(self, rows: list[dict], artifact_file: str) -> None:
        columns = {key: [row.get(key) for row in rows] for key in (rows[0] if rows else {})}
        self.client.log_table(self.run_id, data=columns, artifact_file=artifact_file)

    def log_dict(self, data: dict, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, data, artifact_file)

    def log_model(self, model_dir: str, register_as: str | None = None, name: str = "model"):
        """Log the final model (HF folder) with the transformers flavor; returns MLflow's ModelInfo (``model_uri``,
        ``registered_model_version``). A LoRA adapter folder is logged as it is (``log_adapter``).

        Requirements are given explicitly: MLflow's inference adds torchvision for every torch model, which this
        project does not install (PyPI's torchvision breaks the CPU torch build).
        """
        from importlib.metadata import version

        from huggingface_hub import ModelCard
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rlworkers.models.lora import is_adapter_folder

        if is_adapter_folder(model_dir):
            return self.log_adapter(model_dir, register_as, name)
        with local_dir(model_dir) as folder:  # s3://... runs_dir: a temporary local copy
            model = AutoModelForCausalLM.from_pretrained(folder)
            tokenizer = AutoTokenizer.from_pretrained(folder)
            readme = (
                Path(folder) / "README.md"
            )  # the model card (flows/controller/run_publish.py), license and base model
            model_card = ModelCard.load(readme) if readme.is_file() else None
        with mlflow.start_run(run_id=self.run_id):
            info = mlflow.transformers.log_model(
                transformers_model={"model": model, "tokenizer": tokenizer},
                name=name,
                task="text-generation",
                registered_model_name=register_as,
                model_card=model_card,
                pip_requirements=[f"{p}=={version(p)}" for p in ("torch", "transformers", "tokenizers", "safetensors")],
            )
        self.client.update_run(self.run_id, status="RUNNING")  # start_run's end marked it FINISHED: not yet
        return info

    def log_adapter(self, adapter_dir: str, register_as: str | None = None, name: str = "model") -> LoggedAdapter:
        """Log a LoRA adapter folder (peft's files, the tokenizer, ``base_model.json``: a few MB, not the model)
        as the run's ``<name>`` artifacts and, with ``register_as``, register them as a model version whose
        source is that folder. ``models:/...`` of it downloads the folder, which loads as base + adapter."""
        from mlflow.exceptions import MlflowException

        with local_dir(adapter_dir) as folder:
            self.client.log_artifacts(self.run_id, folder, name)
        source = f"{self.client.get_run(self.run_id).info.artifact_uri}/{name}"
        version = None
        if register_as:
            try:
                self.client.create_registered_model(register_as)
            except MlflowException as error:
                if error.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
            model_version = self.client.create_model_version(
                register_as, source, run_id=self.run_id, tags={"rlflow.kind": "lora-adapter"}
            )
            version = int(model_version.version)
        return LoggedAdapter(model_uri=f"runs:/{self.run_id}/{name}", registered_model_version=version)

    def flush(self) -> None:
        """Wait for the metrics still being sent (up to a second of buffering; a failure to send them is logged, not
        raised: the run goes on)."""
        for sent in self._sending:
            try:
                sent.wait()
            except Exception as error:
                logger.warning("MLflow run %s: some metrics were not logged: %s", self.run_id, error)
        self._sending.clear()

    def finish(self, status: str = "FINISHED") -> None:
        """Send what is left (``flush``), then end the MLflow run with ``status``."""
        self.flush()
        self.client.set_terminated(self.run_id, status=status)


def prefect_flow_run_links() -> dict[str, str]:
    """The current Prefect flow run's id and UI URL (empty outside a flow run)."""
    from prefect.runtime import flow_run

    run_id = flow_run.get_id()
    if not run_id:
        return {}
    return {
        "prefect.flow_run_id": run_id,
        "prefect.flow_run_url": flow_run.get_flow_run_ui_url() or "",
        "prefect.flow_name": flow_run.get_flow_name() or "",
    }


def publish_checkpoint_artifact(run_name: str, step: int, path: str, metrics: dict[str, float]) -> None:
    """A Prefect table artifact per checkpoint (step, path, key metrics)."""
    from prefect.artifacts import create_table_artifact

    key_metrics = {
        k: round(v, 4)
        for k, v in metrics.items()
        if k in ("critic/score/mean", "val/score/mean", "actor/pg_loss", "actor/kl_loss", "sft/loss")
    }
    create_table_artifact(
        key=f"{artifact_key(run_name)}-checkpoints",
        table=[{"step": step, "path": path, **key_metrics}],
        description=f"checkpoint of {run_name} at step {step}",
    )


def publish_mlflow_link(run_name: str, url: str) -> None:
    from prefect.artifacts import create_link_artifact

    create_link_artifact(
        key=f"{artifact_key(run_name)}-mlflow",
        link=url,
        link_text="MLflow run",
        description=f"MLflow run of {run_name}",
    )


class ProgressArtifact:
    """A Prefect progress artifact for the run; its description counts the restarts.

    Sent at most once per ``MIN_INTERVAL_S`` while steps go by (a step of the demo is far shorter, and each update
    is a request the server handles), and always for the last step, a restart, and on ``close``."""

    MIN_INTERVAL_S = 1.0

    def __init__(self, run_name: str, total: int):
        from prefect.artifacts import create_progress_artifact

        self.run_name, self.total, self.restarts = run_name, total, 0
        self._sending = ThreadPoolExecutor(1, thread_name_prefix="rlflow-progress")
        self._open_client = None  # used by the sending thread only
        self._sent_at = -math.inf
        self._unsent: int | None = None  # the newest step not sent yet
        self.id = create_progress_artifact(
            progress=0.0, key=f"{artifact_key(run_name)}-progress", description=self._description()
        )

    def _description(self) -> str:
        restarts = f" ({self.restarts} restart(s) after worker faults)" if self.restarts else ""
        return f"training progress of {self.run_name}{restarts}"

    def update(self, step: int, restarts: int | None = None) -> None:
        """Record ``step`` (and the restart count); send it now if it is due (see the class docstring)."""
        restarted = restarts is not None and restarts != self.restarts
        self.restarts = self.restarts if restarts is None else restarts
        self._unsent = step
        if restarted or step >= self.total or time.monotonic() - self._sent_at >= self.MIN_INTERVAL_S:
            self._send()

    def _send(self) -> None:
        """Send the newest step from a thread of its own (in order): a training step does not wait for the server."""
        from prefect.client.schemas.actions import ArtifactUpdate

        update = ArtifactUpdate(data=100.0 * self._unsent / self.total, description=self._description())
        self._sent_at, self._unsent = time.monotonic(), None

        def send() -> None:
            try:
                self._client().update_artifact(artifact_id=self.id, artifact=update)
            except Exception as error:  # the run goes on; the next update may get through
                logger.warning("the progress artifact of %s was not updated: %s", self.run_name, error)

        self._sending.submit(send)

    def _client(self):
        """One Prefect client for every update, opened in the sending thread: prefect's ``update_progress_artifact``
        builds a new client per call, and each loads the CA bundle (CPU at every step)."""
        if self._open_client is None:
            from prefect.client.orchestration import get_client

            self._open_client = get_client(sync_client=True)
            self._open_client.__enter__()
        return self._open_client

    def close(self) -> None:
        """Send the newest step if it was not, and wait until every update was sent."""
        if self._unsent is not None:
            self._send()
        self._sending.shutdown(wait=True)
        if self._open_client is not None:
            self._open_client.__exit__(None, None, None)


def artifact_key(name: str) -> str:
    return re.sub(r"[^a-z0-9-]", "-", name.lower())


class TerminalProgress:
    """A rich progress bar with the step's key metrics, when the flow runs in a terminal."""

    def __init__(self, description: str, total: int, completed: int):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[summary]}"),
            console=Console(stderr=True),
        )
        self.task = self.bar.add_task(description, total=total, completed=completed, summary="")
        self.bar.start()

    def update(self, step: int, metrics: dict) -> None:
        self.bar.update(self.task, completed=step, summary=step_summary(metrics))

    def stop(self) -> None:
        self.bar.stop()


def step_summary(metrics: dict) -> str:
    keys = (
        "critic/score/mean",
        "sft/loss",
        "actor/pg_loss",
        "actor/kl_loss",
        "val/score/mean",
        "timing_s/step",
    )
    return "  ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)
