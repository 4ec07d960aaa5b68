"""The controller-cost bench runs end to end, bounded, so that a change to the stages or the task runner that breaks
it fails here rather than for the next person who measures (bench/overhead.py once broke unnoticed when
``update_actor`` began returning a ``PolicyUpdate``). Its numbers are not asserted: printing them is the bench's job.
(bench/restarts_under_load.py runs in tests/test_topology.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts services, trains or installs: `make test-quick` leaves it out


def test_overhead_bench_runs_both_measurements_and_prints_their_ratios(services):
    done = subprocess.run(
        [sys.executable, "bench/overhead.py", "--tasks", "3", "--repeats", "1", "--steps", "2", "--rounds", "1"],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ratio stock / warm per-task cost:" in done.stdout, done.stdout
    assert "controller share of the step (1 - plain / runner): WarmRayTaskRunner" in done.stdout, done.stdout


def test_precision_bench_prints_both_times_the_ratio_and_the_cpu():
    done = subprocess.run(
        [sys.executable, "bench/precision.py", "--model", "tiny", "--repeat", "1", "--tokens", "32"],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "CPU: torch " in done.stdout and "model.autocast=auto here: " in done.stdout, done.stdout
    assert "bf16 autocast / float32: " in done.stdout, done.stdout
