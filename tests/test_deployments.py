"""deployments/prefect.yaml: every deployment's entry point imports, its parameters are a valid config, and
`prefect deploy --all` registers them on a real Prefect server with their schedules and concurrency limits."""

from __future__ import annotations

import asyncio
import importlib
import os
import subprocess
import sys
from pathlib import Path

import yaml

from flows.config import validate_config

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
        assert deployment["concurrency_limit"]["limit"] == 1
        names.append(deployment["name"])
    assert {"nightly-grpo", "weekly-sft"} <= set(names)


def test_prefect_deploy_registers_schedules_and_limits(services):
    env = {**os.environ, "RLFLOW_PROJECT_DIR": str(ROOT), "PREFECT_API_URL": services["PREFECT_API_URL"]}
    prefect = [sys.executable, "-m", "prefect"]
    subprocess.run([*prefect, "work-pool", "create", "rlflow", "--type", "process", "--overwrite"], env=env,
                   check=True, capture_output=True, timeout=120)
    result = subprocess.run([*prefect, "--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml"],
                            env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr

    async def read():
        from prefect.client.orchestration import get_client

        async with get_client() as client:
            return {d.name: d for d in await client.read_deployments()}

    deployments = asyncio.run(read())
    nightly = deployments["nightly-grpo"]
    assert nightly.schedules[0].schedule.cron == "0 2 * * *"
    assert nightly.global_concurrency_limit is not None and nightly.global_concurrency_limit.limit == 1
    assert nightly.parameters["config"]["trainer"]["lineage"] == "nightly-grpo"
    assert "rlflow" in nightly.tags  # what the crash automations match on
    assert nightly.work_pool_name == "rlflow"
    assert "config" in nightly.parameter_openapi_schema["properties"]  # the UI's parameter form
