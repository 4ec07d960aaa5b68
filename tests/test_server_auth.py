"""Servers a team shares: `rlflow server up` with RLFLOW_SERVER_AUTH turns on Prefect's API auth string and MLflow's
basic-auth app. Strangers get 401 from both (health endpoints stay open), a run without credentials fails before any
worker starts and names the fix, and a run with credentials (from env.sh, which holds no secret) and AWS keys in its
environment finishes without any of those secrets in MLflow's params, tags or artifacts, or in the Prefect flow
run's parameters, job variables or logs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from flows.ops.services import ServiceConfig, free_port, start_services, stop_services
from flows.plumbing.servers import basic_auth_header, http_status

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

CLIENT_VARIABLES = (
    "PREFECT_API_URL",
    "MLFLOW_TRACKING_URI",
    "PREFECT_API_AUTH_STRING",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "RLFLOW_SERVER_AUTH",
)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    auth = f"team:pw-{uuid.uuid4().hex}"
    config = ServiceConfig(
        state_dir=tmp_path_factory.mktemp("auth-home"),
        prefect_port=free_port(),
        mlflow_port=free_port(),
        ray_port=free_port(),
        auth=auth,
    )
    urls = start_services(config)
    yield {"auth": auth, "urls": urls, "config": config}
    stop_services(config)


def train(guarded, tmp_path: Path, extra_env: dict[str, str], source_env_file: bool) -> subprocess.CompletedProcess:
    """`rlflow train` in a shell as a user runs it: the client variables only from ``extra_env`` (and env.sh)."""
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_VARIABLES}
    env.update({"COLUMNS": "300", **extra_env})
    command = (
        f"{sys.executable} -m flows train grpo --config demo model.path=tiny trainer.runs_dir={tmp_path} "
        "trainer.run_name=guarded trainer.total_steps=2 trainer.test_freq=0 trainer.log_samples=2"
    )
    if source_env_file:
        command = f"source {guarded['config'].env_file} && {command}"
    else:  # the URLs, without credentials
        env["PREFECT_API_URL"] = guarded["urls"]["PREFECT_API_URL"]
        env["MLFLOW_TRACKING_URI"] = guarded["urls"]["MLFLOW_TRACKING_URI"]
    return subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_bad_credentials_are_refused_before_any_server_starts(tmp_path):
    for auth, problem in (("team", "must be user:password"), ("team:short", "at least 12 characters")):
        done = subprocess.run(
            [sys.executable, "-m", "flows", "server", "up", "--state-dir", str(tmp_path)],
            cwd=ROOT, env={**os.environ, "RLFLOW_SERVER_AUTH": auth, "COLUMNS": "300"},
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 2 and problem in done.stdout + done.stderr, done.stdout + done.stderr
        assert not (tmp_path / "services.json").exists()


def test_strangers_are_refused_and_env_sh_holds_no_secret(guarded):
    prefect, mlflow = guarded["urls"]["PREFECT_API_URL"], guarded["urls"]["MLFLOW_TRACKING_URI"]
    search = f"{mlflow}/api/2.0/mlflow/experiments/search?max_results=1"

    def status(url: str, auth: str | None = None) -> int | None:
        # a client's patience, not a probe's 2 s: MLflow checks a password with a deliberately slow hash (werkzeug's),
        # which took over 2 s on the 2-core machine with the rest of the suite running beside it
        return http_status(url, timeout=60, headers=basic_auth_header(auth) if auth else None)

    assert status(f"{prefect}/admin/version") == 401
    assert status(search) == 401
    assert status(search, "team:wrong") == 401
    assert status(f"{prefect}/admin/version", guarded["auth"]) == 200
    assert status(search, guarded["auth"]) == 200
    assert status(f"{prefect}/health") == 200 and status(f"{mlflow}/health") == 200  # probes stay open
    password = guarded["auth"].partition(":")[2]
    for path in guarded["config"].state_dir.rglob("*"):  # env.sh, services.json, basic_auth.ini, logs
        if path.is_file() and path.suffix in (".sh", ".json", ".ini", ".log"):
            assert password not in path.read_text(errors="replace"), path


def test_a_run_without_credentials_fails_before_any_worker_starts(guarded, tmp_path):
    done = train(guarded, tmp_path, {}, source_env_file=False)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "asks for a user and password" in output and "PREFECT_API_AUTH_STRING" in output, output[-3000:]
    assert "Starting a local Ray" not in output


def test_no_credential_reaches_params_tags_artifacts_or_flow_run(guarded, tmp_path, monkeypatch):
    aws_secret = f"aws-{uuid.uuid4().hex}"
    done = train(
        guarded,
        tmp_path,
        {
            "RLFLOW_SERVER_AUTH": guarded["auth"],
            "AWS_ACCESS_KEY_ID": "AKIATESTRLFLOW000000",
            "AWS_SECRET_ACCESS_KEY": aws_secret,
        },
        source_env_file=True,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    secrets = (guarded["auth"].partition(":")[2], aws_secret)

    def clean(text: str, where: str) -> None:
        for secret in secrets:
            assert secret not in text, f"a secret in {where}"

    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "team")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", secrets[0])
    client = MlflowClient(guarded["urls"]["MLFLOW_TRACKING_URI"])
    [run] = client.search_runs(
        [client.get_experiment_by_name("rlflow").experiment_id], filter_string="tags.`rlflow.run_name` = 'guarded'"
    )
    assert run.info.status == "FINISHED" and run.data.params  # the run logged through the guarded server
    clean(json.dumps(run.data.params), "MLflow params")
    clean(json.dumps(run.data.tags), "MLflow tags")
    folder = client.download_artifacts(run.info.run_id, "", str(tmp_path / "artifacts"))
    files = [p for p in Path(folder).rglob("*") if p.is_file() and p.suffix in (".json", ".yaml", ".txt", ".md")]
    assert files  # config, samples
    for path in files:
        clean(path.read_text(errors="replace"), f"MLflow artifact {path.name}")

    headers = basic_auth_header(guarded["auth"])
    with httpx.Client(base_url=guarded["urls"]["PREFECT_API_URL"], headers=headers, timeout=30) as api:
        [flow_run] = api.post("/flow_runs/filter", json={"flow_runs": {"name": {"any_": ["guarded"]}}}).json()
        assert flow_run["state"]["type"] == "COMPLETED" and flow_run["parameters"]
        clean(json.dumps(flow_run["parameters"]), "Prefect flow run parameters")
        clean(json.dumps(flow_run.get("job_variables") or {}), "Prefect job variables")
        logs = api.post("/logs/filter", json={"logs": {"flow_run_id": {"any_": [flow_run["id"]]}}}).json()
        assert logs
        clean(json.dumps(logs), "Prefect logs")
