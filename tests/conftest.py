"""Shared fixtures: one local Ray instance per test session (CPU only, logical CPUs for placement)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pytest_sessionfinish(session, exitstatus):
    """Under CI=true a skipped test fails the run: CI installs everything every test needs (vLLM's CPU build,
    chromium, PostgreSQL, root), so a skip there means a test that silently stopped testing."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if os.environ.get("CI") == "true" and skipped and exitstatus == 0:
        reporter.write_line(f"CI=true: {len(skipped)} test(s) skipped, which CI does not allow:", red=True)
        for report in skipped:
            reporter.write_line(f"  {report.nodeid}: {report.longrepr[-1] if report.longrepr else ''}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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


@pytest.fixture(scope="session")
def services(tmp_path_factory):
    """Real Prefect and MLflow servers (SQLite, 127.0.0.1, free ports) for the whole session."""
    import socket

    from flows.preflight import apply_service_env
    from flows.services import ServiceConfig, start_services, stop_services

    def free_port() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    config = ServiceConfig(
        state_dir=tmp_path_factory.mktemp("rlflow-home"), prefect_port=free_port(), mlflow_port=free_port()
    )
    saved = {k: os.environ.get(k) for k in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    urls = start_services(config)
    apply_service_env(urls)
    yield urls
    stop_services(config)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
