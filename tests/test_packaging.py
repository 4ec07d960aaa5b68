"""A non-editable install works away from the checkout: `pip install .` ships the presets, and the console
script finds them. The build runs offline on a copy of the sources (the venv's setuptools, no build isolation, no
dependencies: the venv supplies them), so the checkout gets no build/ folder. A few seconds; no training."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts services, trains or installs: `make test-quick` leaves it out

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """``pip install --target`` of a copy of the sources; returns the target folder."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in ("flows", "rlworkers"):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(source),
        ],
        check=True,
        timeout=120,
    )
    return target


def run_outside_checkout(installed: Path, tmp_path: Path, *command: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(installed)}
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_installed_package_loads_the_demo_preset(installed, tmp_path):
    probe = (
        "import flows.config as c; config = c.load_config('demo'); "
        "print(c.__file__); print(config.data.train_batch_size, config.rollout.n); c.load_config('no-such-preset')"
    )
    result = run_outside_checkout(installed, tmp_path, sys.executable, "-c", probe)
    module_file, values = result.stdout.split("\n")[:2]
    assert Path(module_file).is_relative_to(installed)
    assert values == "32 8"  # flows/configs/demo.yaml
    presets = [
        "agent", "agent-env", "agent-sft", "demo", "demo-sft", "gpu", "gpu-async", "real", "real-gsm8k", "real-sft",
    ]  # fmt: skip
    assert f"one of the presets {presets}" in result.stderr


def test_console_script_runs(installed, tmp_path):
    # --help stops before the flow modules (and torch) are imported: it checks the entry point, in a second.
    result = run_outside_checkout(installed, tmp_path, str(installed / "bin" / "rlflow"), "train", "--help")
    assert result.returncode == 0, result.stderr
    assert "one of sft, grpo, ppo, online_dpo" in result.stdout
