"""The topology a team runs: `rlflow server up --postgres ... --artifacts s3://...` starts Prefect's server and
MLflow's tracking server on a real PostgreSQL (a private cluster this module starts with Debian's postgresql
binaries) with MLflow's artifacts in an S3-compatible store (moto's server); a lineage of two `rlflow train` runs
then keeps its flow runs in Prefect's database, its runs and model versions in MLflow's, its models and eval tables
in the bucket, and the second run starts from `models:/<lineage>@champion` downloaded from there. On the same servers:
killed deployment runs restarted under API load, and a run lost with its worker found by the heartbeat automation.

Needs PostgreSQL's server binaries (`apt-get install postgresql`; `.ci/run` installs it) and root or the postgres
user to run them; skips with that hint otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from pg_cluster import private_postgres, query
from rlflow_cli import rlflow

from flows.ops.services import ServiceConfig, ensure_postgres_databases, free_port, start_services, stop_services
from flows.plumbing.servers import ServiceError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def postgres():
    with private_postgres() as cluster:
        yield cluster


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    """moto's S3 server on 127.0.0.1 with a bucket; this process's AWS_* and MLFLOW_S3_ENDPOINT_URL point at it
    (the MLflow server started below inherits them)."""
    import time

    import boto3

    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT
    )
    endpoint = f"http://127.0.0.1:{port}"
    with pytest.MonkeyPatch.context() as env:  # module scope: pytest's monkeypatch fixture is per test
        for key, value in (("AWS_ACCESS_KEY_ID", "team"), ("AWS_SECRET_ACCESS_KEY", "team"),
                           ("AWS_DEFAULT_REGION", "us-east-1"), ("MLFLOW_S3_ENDPOINT_URL", endpoint)):  # fmt: skip
            env.setenv(key, value)
        client = boto3.client("s3", endpoint_url=endpoint)
        for _ in range(100):  # until moto's server answers
            try:
                client.create_bucket(Bucket="team-mlflow")
                break
            except Exception:
                time.sleep(0.2)
        yield client
        server.terminate()
        server.wait(10)


@pytest.fixture(scope="module")
def team_services(postgres, bucket, tmp_path_factory):
    config = ServiceConfig(
        state_dir=tmp_path_factory.mktemp("team-home"),
        prefect_port=free_port(),
        mlflow_port=free_port(),
        ray_port=free_port(),
        postgres=postgres["url"],
        artifacts="s3://team-mlflow/mlflow",
        startup_timeout_s=180,
    )
    urls = start_services(config)
    yield urls
    stop_services(config)


def rlflow_train(urls: dict, *args: str) -> subprocess.CompletedProcess:
    servers = {key: urls[key] for key in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "RLFLOW_LOCAL_RAY")}
    return rlflow("train", *args, env=servers)


def test_a_lineage_on_postgresql_with_artifacts_in_object_storage(team_services, postgres, bucket, tmp_path):
    assert set(query(postgres, "postgres", "SELECT datname FROM pg_database")) >= {"prefect", "mlflow"}
    lineage = f"team-{uuid.uuid4().hex[:6]}"
    args = ["sft", "--config", "demo-sft", f"trainer.runs_dir={tmp_path}", f"trainer.lineage={lineage}",
            "trainer.run_name=null", "trainer.total_steps=4", "trainer.test_freq=0", "trainer.save_freq=0",
            "trainer.n_workers=1"]  # fmt: skip
    first = rlflow_train(team_services, *args)
    second = rlflow_train(team_services, *args)
    assert f"{lineage} v1 promoted" in first.stdout + first.stderr
    assert f"from models:/{lineage}/1" in second.stdout + second.stderr  # downloaded through the server, from S3

    # Prefect's flow runs and MLflow's runs and versions are rows in PostgreSQL, not in SQLite files
    flow_runs = query(postgres, "prefect", f"SELECT state_name FROM flow_run WHERE name LIKE '{lineage}-%'")
    assert flow_runs == ["Completed", "Completed"]
    runs = query(postgres, "mlflow", f"SELECT status FROM runs WHERE name LIKE '{lineage}-%'")
    assert runs == ["FINISHED", "FINISHED"]
    versions = query(postgres, "mlflow", f"SELECT version FROM model_versions WHERE name = '{lineage}' ORDER BY 1")
    assert versions == ["1", "2"]
    assert not list(Path(team_services["env_file"]).parent.rglob("*.db"))

    # the models and the per-example eval tables are objects in the bucket
    keys = [o["Key"] for page in bucket.get_paginator("list_objects_v2").paginate(Bucket="team-mlflow")
            for o in page.get("Contents", [])]  # fmt: skip
    assert sum(key.endswith("/model/model.safetensors") for key in keys) >= 2
    assert sum(key.endswith("/eval/validation/final.json") for key in keys) >= 2


def test_a_postgresql_server_that_refuses_is_named_with_the_fix(postgres):
    wrong = postgres["url"].replace("team:", "nobody:")
    with pytest.raises(ServiceError, match=r"PostgreSQL at 127\.0\.0\.1:\d+ as 'nobody'.*user and password"):
        ensure_postgres_databases(wrong)


@pytest.mark.timeout(1200)  # its load makes its runs slow by design; 600 s ran out on an AVX2-only CPU
def test_killed_runs_come_back_with_a_plain_prefect_worker_under_load(team_services, tmp_path):
    """bench/restarts_under_load.py, bounded: 2 lineage runs on 2 deployments served by a plain
    `prefect worker start` (no rlflow restart loop) at once, one of them SIGKILLed in its first attempt while an API
    client keeps the PostgreSQL-backed server busy. The killed run is restarted by the automation and completes; no
    run is left Crashed or Running, and the server dead-letters no event. (The bench's defaults, 20 runs with 8 kills
    and API traffic as fast as the server answers, are the measurement in docs/; here the suite's CPU is shared, so the
    smallest case that still overlaps a restart with another run and with API traffic: two requests every 0.5 s,
    where a client with no pause took about a core of the 2-core machine from the rest of the suite; the kill 2-8 s
    into the attempt, as its 6 steps in the kept processes of the local Ray can take under 20 s.)"""
    servers = {key: team_services[key] for key in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "RLFLOW_LOCAL_RAY")}
    out = tmp_path / "restarts.json"
    server_log = Path(team_services["env_file"]).parent / "logs" / "prefect.log"
    done = subprocess.run(
        [sys.executable, "bench/restarts_under_load.py", "--runs", "2", "--deployments", "2", "--kills", "1",
         "--limit", "2", "--load-threads", "1", "--load-interval-s", "0.5", "--kill-after-s", "2", "8",
         "--timeout-s", "900", "--runs-dir", str(tmp_path / "runs"), "--server-log", str(server_log),
         "--out", str(out)],
        cwd=Path(__file__).resolve().parents[1], env={**os.environ, **servers, "PREFECT_WORKER_QUERY_SECONDS": "2"},
        capture_output=True, text=True,
        timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    summary, runs = result["summary"], result["runs"]
    assert summary["completed"] == 2 and summary["not_final"] == 0, runs
    assert summary["killed"] == 1 and summary["killed_then_completed"] == 1, runs
    assert summary["load_requests"] > 0, summary  # the API traffic ran beside the runs
    assert summary["crashes_never_restarted"] == 0 and summary["dead_letters_in_server_log"] == 0, summary
    assert all(row["restarted_by"] == ["automation"] for row in runs if row["killed"]), runs


def test_run_lost_with_its_worker_on_postgresql_is_marked_crashed_restarted_and_capped(
    services, team_services, tmp_path
):
    """tests/test_schedule.py's lost worker on the team's servers: where the heartbeat automation's events live in
    PostgreSQL. (Last in the module: its `rlflow worker` serves the pool the bench above serves with its own.)"""
    from test_schedule import check_run_lost_with_its_worker, deployment_worker

    from flows.ops.preflight import apply_service_env

    apply_service_env(team_services)  # the test's own API calls too (Prefect's settings refreshed)
    try:
        with deployment_worker(team_services, tmp_path) as worker:
            check_run_lost_with_its_worker(worker)
    finally:
        apply_service_env(services)
