"""Under CI=true a skipped test fails `make test` (tests/conftest.py): a skip in CI is a test that stopped testing."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_probe(ci: str | None) -> subprocess.CompletedProcess:
    probe = HERE / f"_probe_{uuid.uuid4().hex[:8]}.py"  # beside conftest.py, so its hook applies
    probe.write_text("import pytest\n\ndef test_runs():\n    pass\n\ndef test_skips():\n    pytest.skip('no tool')\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": ci} if ci else {})
    try:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(probe)],
            cwd=HERE.parent,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        probe.unlink()


def test_a_skip_fails_the_run_under_ci_only():
    outside = run_probe(None)
    assert outside.returncode == 0 and "1 passed, 1 skipped" in outside.stdout, outside.stdout
    inside = run_probe("true")
    assert inside.returncode == 1, inside.stdout
    assert "CI=true: 1 test(s) skipped" in inside.stdout and "test_skips: Skipped: no tool" in inside.stdout
