"""The README's "Running your own" block, run as a user would: every command, in the order shown, in one shell, in a
fresh folder (its own .rlflow/ servers on free ports, its own runs/). The training commands keep the user's
arguments and get a short step count appended; the servers get free ports so the suite's own keep theirs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flows.ops.services import free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # starts servers and trains four times: `make test-quick` leaves it out
SHORT = "trainer.total_steps=2 trainer.test_freq=2 trainer.save_freq=2 data.task.num_val=16"


def readme_block(heading: str) -> list[str]:
    """The command lines of the first fenced block after ``heading`` in README.md."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(heading) :]
    block = re.search(r"```\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def as_test_runs_it(line: str, prefect_port: int, mlflow_port: int, ray_port: int) -> str:
    command = line.split("#", 1)[0].rstrip()
    if command.endswith("rlflow server up"):
        return f"{command} --prefect-port {prefect_port} --mlflow-port {mlflow_port} --ray-port {ray_port}"
    if " train " in command:
        return f"{command} {SHORT}"
    return command


def test_running_your_own_runs_in_the_order_shown(tmp_path):
    lines = readme_block("## Running your own")
    assert any(" train ppo " in line for line in lines) and lines[-1].endswith("server down")
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)  # the README's .venv/bin/rlflow
    ports = free_port(), free_port(), free_port()
    script = "set -ex\n" + "\n".join(as_test_runs_it(line, *ports) for line in lines) + "\n"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "RLFLOW_LOCAL_RAY", "RLFLOW_HOME")
    }
    try:
        done = subprocess.run(
            ["bash", "-c", script],
            cwd=tmp_path,
            env={**env, "COLUMNS": "300"},
            capture_output=True,
            text=True,
            timeout=1200,
        )
    finally:
        subprocess.run([str(tmp_path / ".venv/bin/rlflow"), "server", "down"], cwd=tmp_path, capture_output=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    # every training command ran to its end and left its run in MLflow, each under its own name
    for name in ("grpo", "sft", "ppo", "online_dpo"):
        assert (tmp_path / "runs" / name / "result.json").exists(), name
        assert re.search(rf"\b{name}\b", done.stdout), done.stdout[-3000:]
