"""The README's "Agents: tools and environments" block, run as a user would: each command in the order shown, in a
fresh folder (its own runs/), against the session's Prefect and MLflow servers, with a short step count appended:
the SFT warm-up on tool-call demonstrations, GRPO from its final model with the calculator tool, and GRPO in the
"Wrong, try again." environment (SmolLM2-135M-Instruct each time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_readme import readme_block

# three SmolLM2 runs one after another outlast pyproject's 600 s per test on a CPU without native bf16 beside the rest
# of the suite; the command's own limit below stays the bound
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
# one step, 2 validation answers, 2 prompts x 2 trajectories (one of each a worker): what the commands do, not how far
# they train (the presets' 8 x 4 trajectories of SmolLM2 took minutes a step on a CPU without native bf16)
SHORT = (
    "trainer.total_steps=1 trainer.test_freq=1 trainer.save_freq=1 data.task.num_val=2 data.train_batch_size=2 "
    "rollout.n=2 actor.ppo_mini_batch_size=4 actor.ppo_micro_batch_size_per_gpu=2"
)


def test_the_agents_block_runs_in_the_order_shown(services, tmp_path):
    lines = readme_block("### Agents: tools and environments")
    commands = [line.split("#", 1)[0].rstrip() for line in lines]
    assert [c.split()[2:6] for c in commands] == [
        ["sft", "--config", "agent-sft"],
        ["grpo", "--config", "agent", "model.path=runs/agent-sft/final_model"],
        ["grpo", "--config", "agent-env"],
    ]
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)  # the README's .venv/bin/rlflow
    script = "set -ex\n" + "\n".join(f"{command} {SHORT}" for command in commands) + "\n"
    done = subprocess.run(
        ["bash", "-c", script],
        cwd=tmp_path,
        env={**os.environ, "COLUMNS": "300"},
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for name in ("agent-sft", "agent", "agent-env"):  # each ran to its end and published a whole model
        result = json.loads((tmp_path / "runs" / name / "result.json").read_text())
        assert result, name
        assert (tmp_path / "runs" / name / "final_model" / "model.safetensors").exists(), name
    started_from = json.loads((tmp_path / "runs" / "agent" / "run.json").read_text())
    assert started_from["model_dir"].endswith("runs/agent-sft/final_model"), started_from
