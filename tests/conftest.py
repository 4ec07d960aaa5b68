"""Shared fixtures: one local Ray instance per test session (CPU only, logical CPUs for placement)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    if not ray.is_initialized():
        # 16 logical CPUs on a 2-core machine: placement needs slots, the work itself is light in these tests.
        ray.init(
            num_cpus=16,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}},
        )
    yield ray
    ray.shutdown()
