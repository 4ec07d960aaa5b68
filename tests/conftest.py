"""Shared fixtures: one local Ray instance per test session (CPU only, logical CPUs for placement); how `make test`
shares the suite between its two processes."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from flows.ops.services import LOCAL_RAY_PROCESS_ENV, free_port, local_ray_command

ROOT = Path(__file__).resolve().parents[1]


# `make test` runs the suite in two processes (pytest-xdist, `-n 2`): while one waits (for servers, heartbeats, leases,
# process starts), the other computes, and the 2-core machine stays ~95% busy. Each module stays whole in one process
# (its module fixtures are built once), and the modules that load SmolLM2 or start vLLM engines share one group, so no
# two of them hold several GiB at once: the scheduler below. (xdist's own `--dist loadgroup` marks do not reach its
# scheduler under pytest 9, which no longer reads the node id xdist rewrites.) The longest groups start first
# (test-minutes in `make test` on the 2-core CI machine, 2026-11-28: smollm2-vllm ~25, promotion 15, flows 13, cluster
# 12.5, schedule 12.4, topology 8). The SmolLM2 group starts beside test_schedule, whose tests mostly wait on servers:
# beside the promotion module's training (2026-11-28 19:08) its runs took about twice as long and the killed-and-resumed
# agent run passed pytest-timeout's 600 s. The two modules that start from the demo's SFT-warmed tiny model share one
# process, so its warm-up (``sft_warmed_tiny``) runs once.
SFT_WARMED = {"test_promotion", "test_training"}
HEAVY_MEMORY = {"test_agent_rollouts", "test_readme_agents", "test_real_model", "test_real_model_training",
                "test_vllm_rollout", "test_lora"}  # fmt: skip
LONGEST_FIRST = ["smollm2-vllm", "test_schedule", "sft-warmed", "test_flows", "test_topology", "test_cluster",
                 "test_publish_crashes", "test_lineage", "test_readme", "test_local_ray",
                 "test_server_auth", "test_single_controller", "test_single_controller_verl_parity", "test_benches",
                 "test_object_store"]  # fmt: skip


def suite_group(nodeid: str) -> str:
    module = Path(nodeid.split("::", 1)[0]).stem
    return "smollm2-vllm" if module in HEAVY_MEMORY else "sft-warmed" if module in SFT_WARMED else module


def pytest_collection_modifyitems(config, items):
    rank = {group: position for position, group in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(suite_group(item.nodeid), len(rank)))  # stable: the rest keep their order


def pytest_xdist_make_scheduler(config, log):
    """Each group whole to one process, in the order collected (``--no-loadscope-reorder``)."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return suite_group(nodeid)

    return ModuleGroups(config, log)


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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ``RLFLOW_TEST_TIMELINE=FILE``: one JSON line per test (its process, start and end; fixtures included), for
    bench/suite_by_test.py to tell which test started which processes (bench/cpu_by_process.py --processes)."""
    started = time.time()
    yield
    path = os.environ.get("RLFLOW_TEST_TIMELINE")
    if path:
        row = {"test": item.nodeid, "pid": os.getpid(), "start": started, "end": time.time()}
        with open(path, "a") as out:
            out.write(json.dumps(row) + "\n")


SESSION_SERVICES: dict = {}  # the `services` fixture's, once it started them


@pytest.fixture(scope="module", autouse=True)
def end_kept_worker_groups():
    """The worker groups a module's flow runs kept (flows/controller/groups.py) end with the module: a module finds no
    worker processes of another's (its tests may count them), while the runs of one module reuse each other's. Those of
    this process's flows, and the idle ones the module's `rlflow` commands kept in the session's local Ray."""
    yield
    import subprocess
    import sys

    import psutil

    if "flows.controller.groups" in sys.modules:
        sys.modules["flows.controller.groups"].end_kept_groups()
    ray_pid = SESSION_SERVICES.get("ray_pid")
    if not ray_pid or not psutil.pid_exists(ray_pid):
        return
    from rlflow_cli import local_ray_workers

    if local_ray_workers(ray_pid):
        script = (
            "import os, ray\nfrom flows.plumbing import kept\nkept.use_token_authentication()\n"
            "ray.init(address=os.environ[kept.LOCAL_RAY_ENV], namespace=kept.NAMESPACE, log_to_driver=False)\n"
            "kept.end_idle()\n"
        )
        subprocess.run([sys.executable, "-c", script], cwd=ROOT, timeout=120, capture_output=True, check=True)


@pytest.fixture(scope="session")
def ray_cluster():
    """This test process's own Ray, which its in-process flows and worker groups use: started with `ray start` (and
    joined) rather than by ``ray.init``, which cannot leave out Ray's log monitor: nothing here reads worker output
    through it (``log_to_driver=False``), and it polls every log file of the node ten times a second all session."""
    import subprocess
    import tempfile

    import ray

    from flows.plumbing import kept

    if not ray.is_initialized():
        port = free_port()
        # 16 logical CPUs on a 2-core machine: placement needs slots, the work itself is light in these tests. A new
        # instance with a temporary folder of its own (short: Ray's socket paths have a length limit), never a
        # `ray start` cluster another test started on this machine
        temp_dir = tempfile.mkdtemp(prefix="/tmp/rlt-")
        kept.ensure_token()  # as `rlflow server up` does: `ray start` turns authentication on when a token exists
        started = subprocess.Popen(
            local_ray_command(port, 16, temp_dir),
            env={**os.environ, **LOCAL_RAY_PROCESS_ENV},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        end_with_this_process(started.pid, temp_dir)
        kept.use_token_authentication()  # `ray start`'s default, as for the local Ray of `rlflow server up`
        deadline = time.monotonic() + 120
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                assert started.poll() is None and time.monotonic() < deadline, "the test process's Ray did not start"
                time.sleep(0.25)
        ray.init(
            address=f"127.0.0.1:{port}",
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}},
        )
    yield ray
    # Nothing here: the driver is shut down by Ray's own exit handler, after the process reported its last test. A
    # `ray.shutdown()` here could end the test process before that report: a thread of Ray's that touches the core
    # worker just after it is gone quick-exits the process (CI, twice, a test process "Not properly terminated" in
    # its last teardown, its driver log ending "The core worker process is not initialized yet or already shutdown").


def end_with_this_process(group: int, temp_dir: str) -> None:
    """A watcher of its own that ends process group ``group`` (the test process's `ray start`: SIGKILL, the whole
    group at once, as its GCS shuts down gracefully for tens of seconds on SIGTERM, for an instance that keeps
    nothing) and removes ``temp_dir`` once this process has ended, however it ended (a crash or a kill included)."""
    import subprocess
    import sys

    watch = (
        "import os, shutil, signal, sys, psutil\n"
        "psutil.Process(int(sys.argv[1])).wait()\n"
        "try:\n    os.killpg(int(sys.argv[2]), signal.SIGKILL)\nexcept ProcessLookupError:\n    pass\n"
        "shutil.rmtree(sys.argv[3], ignore_errors=True)\n"
    )
    subprocess.Popen(
        [sys.executable, "-c", watch, str(os.getpid()), str(group), temp_dir],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


@pytest.fixture(scope="session")
def services(tmp_path_factory):
    """Real Prefect and MLflow servers (SQLite, 127.0.0.1, free ports) and the local Ray of `rlflow server up`, for
    the whole session: every `rlflow` process a test starts joins that Ray, as a user's runs do."""
    from flows.ops.preflight import apply_service_env
    from flows.ops.services import CONTROLLER, ServiceConfig, start_services, stop_services
    from flows.plumbing import kept

    config = ServiceConfig(
        state_dir=tmp_path_factory.mktemp("rlflow-home"),
        prefect_port=free_port(),
        mlflow_port=free_port(),
        ray_port=free_port(),
    )
    saved = {k: os.environ.get(k) for k in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "RLFLOW_LOCAL_RAY", CONTROLLER)}
    # the controller fork server takes the commands of an environment like its own: this process's, with Ray's token
    # setting as this process has it once it joined its Ray (tests/rlflow_cli.py: the commands' environment)
    kept.use_token_authentication()
    urls = start_services(config)
    apply_service_env(urls)
    SESSION_SERVICES.update(urls)
    yield urls
    SESSION_SERVICES.clear()
    stop_services(config)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def sft_warmed_tiny(ray_cluster, services, tmp_path_factory) -> Path:
    """The folder of the tiny model after the demo's SFT warm-up (flows/configs/demo-sft.yaml: 700 steps of 2-digit
    addition; here on one worker, with no validation, checkpoint or published model), run once in this process for
    the modules that start from it: test_promotion's lineages (the gate's outcomes there are those of this model)
    and test_training's GRPO."""
    from in_process import train_here

    runs = tmp_path_factory.mktemp("sft-warmed")
    train_here(
        "sft", "demo-sft", f"trainer.runs_dir={runs}", "trainer.run_name=warm", "trainer.test_freq=0",
        "trainer.save_freq=0", "trainer.log_model=false", "trainer.n_workers=1",
    )  # fmt: skip
    return runs / "warm" / "final_model"


@pytest.fixture
def prefect_proxy(services):
    """A proxy in front of the session's Prefect server, and the environment that sends a command through it."""
    port = int(services["PREFECT_API_URL"].rsplit(":", 1)[1].split("/", 1)[0])
    from faults import TcpProxy

    proxy = TcpProxy(port)
    proxy.start()
    yield proxy, {"PREFECT_API_URL": f"http://127.0.0.1:{proxy.port}/api"}
    proxy.stop()
