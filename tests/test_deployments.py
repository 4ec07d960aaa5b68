"""deployments/prefect.yaml: every deployment's entry point imports, its parameters are a valid config, and
`prefect deploy --all` registers them on a real Prefect server with their schedules."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.config import validate_config

pytestmark = pytest.mark.slow  # starts services, trains or installs: `make test-quick` leaves it out

ROOT = Path(__file__).resolve().parents[1]
SPEC = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())


def test_entrypoints_and_parameters_are_valid():
    names = []
    for deployment in SPEC["deployments"]:
        path, function = deployment["entrypoint"].split(":")
        module = path.removesuffix(".py").replace("/", ".")
        flow_fn = getattr(importlib.import_module(module), function)
        assert flow_fn.name == function
        validate_config(deployment["parameters"]["config"])
        # no deployment concurrency limit: a pause releases it and crashes the paused run (flows/lineages/run_lock.py)
        assert "concurrency_limit" not in deployment
        names.append(deployment["name"])
    assert {"nightly-grpo", "weekly-sft", "agent-sft", "agent-nightly"} <= set(names)


def test_prefect_deploy_registers_schedules_and_limits(services):
    env = {**os.environ, "RLFLOW_PROJECT_DIR": str(ROOT), "PREFECT_API_URL": services["PREFECT_API_URL"]}
    prefect = [sys.executable, "-m", "prefect"]
    subprocess.run(
        [*prefect, "work-pool", "create", "rlflow", "--type", "process", "--overwrite"],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    result = subprocess.run(
        [*prefect, "--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr

    async def read():
        from prefect.client.orchestration import get_client

        async with get_client() as client:
            return {d.name: d for d in await client.read_deployments()}

    deployments = asyncio.run(read())
    nightly = deployments["nightly-grpo"]
    assert nightly.schedules[0].schedule.cron == "0 2 * * *"
    assert nightly.global_concurrency_limit is None  # one run per lineage is the flow's own lock (run_lock.py)
    assert nightly.parameters["config"]["trainer"]["lineage"] == "nightly-grpo"
    assert "rlflow" in nightly.tags  # what the crash automations match on
    assert nightly.work_pool_name == "rlflow"
    assert "config" in nightly.parameter_openapi_schema["properties"]  # the UI's parameter form
    agent = deployments["agent-nightly"].parameters["config"]  # an agent lineage, from the agent SFT lineage
    assert agent["trainer"]["lineage"] == "agent" and agent["model"]["path"] == "models:/agent-sft@champion"
    assert agent["rollout"]["multi_turn"]["enable"] and deployments["agent-nightly"].schedules


def test_a_deployment_run_starts_ray_as_its_config_asks(services, tmp_path):
    """The flow object a deployment runs (its entry point, no task runner given) starts Ray with the run's
    trainer.ray_num_cpus: one logical CPU cannot place two actor workers, so the run fails naming that cluster
    (a Ray started from the environment would have 8 and train)."""
    from rlworkers.models.tiny import ensure_tiny_model

    config = {
        "model": {"path": str(ensure_tiny_model(tmp_path / "tiny"))},
        "trainer": {
            "runs_dir": str(tmp_path / "runs"),
            "run_name": "one-cpu",
            "total_steps": 1,
            "n_workers": 2,
            "ray_num_cpus": 1,
        },
    }
    script = (
        "import json, sys; from flows.sft import sft; "
        "print(sft(config=json.loads(sys.argv[1]), return_state=True).message)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RLFLOW_LOCAL_RAY")}  # no Ray given
    env.update(
        PREFECT_API_URL=services["PREFECT_API_URL"],
        MLFLOW_TRACKING_URI=services["MLFLOW_TRACKING_URI"],
        RLFLOW_RAY_NUM_CPUS="8",
    )
    result = subprocess.run(
        [sys.executable, "-c", script, json.dumps(config)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "PlacementError" in result.stdout, result.stdout + result.stderr[-3000:]
    assert "the cluster has {'CPU': 1.0}" in result.stdout
