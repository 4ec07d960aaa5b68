"""Local services against real servers: one Prefect API server and one MLflow tracking server per module,
on free ports in a temporary state folder, stopped at the end (the last test checks that `stop` really stops)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path

import pytest
from faults import alive
from typer.testing import CliRunner

from flows.ops.cli import server_app
from flows.ops.preflight import apply_service_env
from flows.ops.services import ServiceConfig, _prefect_spec, free_port, service_status, start_services, stop_services
from flows.plumbing.servers import (
    MLFLOW_TRACKING_URI,
    PREFECT_API_URL,
    ServiceError,
    require_mlflow_tracking,
    require_prefect_api,
)

pytestmark = pytest.mark.slow


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _get(url: str) -> tuple[int, str]:
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=5) as response:
        return response.status, response.read().decode()


def _pids_with_args(*args: str) -> list[int]:
    """Live processes whose command line holds all of ``args`` (to find servers a test may have left)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
                stat = (entry / "stat").read_text()
                if all(arg.encode() in cmdline for arg in args) and stat[stat.rindex(")") + 2] != "Z":
                    pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    config = ServiceConfig(
        state_dir=tmp_path_factory.mktemp("rlflow_home"),
        prefect_port=free_port(),
        mlflow_port=free_port(),
        ray_port=free_port(),
        startup_timeout_s=120,
    )
    started = time.monotonic()
    try:
        urls = start_services(config)
        print(f"services started in {time.monotonic() - started:.1f} s")
        yield config, urls
    finally:
        stop_services(config)


@contextlib.contextmanager
def _prefect_settings_from_env():
    """Prefect reads its settings once, at import; rebuild them from the (monkeypatched) environment."""
    from prefect.context import SettingsContext, root_settings_context

    root = root_settings_context()
    with SettingsContext(profile=root.profile, settings=root.settings):
        yield


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No PREFECT_API_URL / MLFLOW_TRACKING_URI from the shell, a profile, ~/.prefect or a config in the cwd."""
    import mlflow.tracking._tracking_service.utils as tracking_utils

    for name in (PREFECT_API_URL, "PREFECT_PROFILE", "PREFECT_PROFILES_PATH", MLFLOW_TRACKING_URI, "RLFLOW_HOME"):
        monkeypatch.setenv(name, "")  # recorded first, so that undo restores the original whether it was set or not
        monkeypatch.delenv(name)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect_home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tracking_utils, "_tracking_uri", None)
    return monkeypatch


def test_start_writes_state_and_both_health_endpoints_answer(services):
    config, urls = services
    assert urls[PREFECT_API_URL] == f"http://127.0.0.1:{config.prefect_port}/api"
    assert urls[MLFLOW_TRACKING_URI] == f"http://127.0.0.1:{config.mlflow_port}"
    assert _get(urls[PREFECT_API_URL] + "/health") == (200, "true")
    assert _get(urls[MLFLOW_TRACKING_URI] + "/health") == (200, "OK")

    record = json.loads((config.state_dir / "services.json").read_text())
    assert record["prefect"]["pid"] == urls["prefect_pid"] and record["mlflow"]["pid"] == urls["mlflow_pid"]
    env_sh = (config.state_dir / "env.sh").read_text()
    assert f"export PREFECT_API_URL={urls[PREFECT_API_URL]}\n" in env_sh
    assert f"export MLFLOW_TRACKING_URI={urls[MLFLOW_TRACKING_URI]}\n" in env_sh
    assert (
        f"export RLFLOW_LOCAL_RAY=127.0.0.1:{config.ray_port}\n" in env_sh and record["ray"]["pid"] == urls["ray_pid"]
    )
    # the controller fork server (flows/plumbing/forkserver.py): its socket in the state folder, only for this user
    sock = config.state_dir / "controller.sock"
    assert f"export RLFLOW_CONTROLLER={sock}\n" in env_sh and record["controller"]["pid"] == urls["controller_pid"]
    # Both SQLite backends live in the state folder.
    assert (config.state_dir / "prefect" / "prefect.db").is_file()
    assert (config.state_dir / "mlflow" / "mlflow.db").is_file()


def test_the_prefect_server_records_task_runs_in_batches_unless_told_otherwise(services, monkeypatch):
    config, urls = services
    environ = Path(f"/proc/{urls['prefect_pid']}/environ").read_bytes().decode().split("\0")
    assert "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE=50" in environ
    assert "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL=1" in environ
    monkeypatch.setenv("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE", "1")
    assert _prefect_spec(config).env["PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE"] == "1"


def test_the_prefect_server_runs_at_the_ray_workers_priority_and_mlflow_at_the_shells(services):
    """The Prefect server records every task run's states while the workers train: at niceness 0 it took their
    cores whenever it woke; at Ray's worker niceness (15) it shares them (bench/overhead.py measures the step)."""
    import psutil

    _, urls = services
    assert psutil.Process(urls["prefect_pid"]).nice() == 15
    assert psutil.Process(urls["mlflow_pid"]).nice() == psutil.Process().nice()


def test_start_is_idempotent(services):
    config, urls = services
    started = time.monotonic()
    again = start_services(config)
    assert time.monotonic() - started < 5
    assert again == urls  # same pids, same URLs


def test_status_and_cli_report_healthy_services(services):
    config, urls = services
    status = service_status(config)
    for name in ("prefect", "mlflow", "ray"):
        assert status[name]["alive"] and status[name]["healthy"]
        assert status[name]["pid"] == urls[f"{name}_pid"]
    # the controller fork server answers once it imported everything (commands run in their own process till then)
    deadline = time.monotonic() + 300
    while not service_status(config)["controller"]["healthy"]:
        assert time.monotonic() < deadline and service_status(config)["controller"]["alive"]
        time.sleep(1)
    assert (config.state_dir / "controller.sock").stat().st_mode & 0o777 == 0o600

    runner = CliRunner()
    result = runner.invoke(server_app, ["status", "--state-dir", str(config.state_dir)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(
        server_app,
        [
            "up",
            "--state-dir",
            str(config.state_dir),
            "--prefect-port",
            str(config.prefect_port),
            "--mlflow-port",
            str(config.mlflow_port),
            "--ray-port",
            str(config.ray_port),
        ],
    )
    assert result.exit_code == 0, result.output
    assert f"source {config.state_dir / 'env.sh'}" in result.output.replace("\n", "")


def test_require_prefect_api_refuses_ephemeral_and_unreachable_servers(services, clean_env):
    _, urls = services
    with _prefect_settings_from_env(), pytest.raises(ServiceError) as refused:
        require_prefect_api()
    message = str(refused.value)
    assert "PREFECT_API_URL is not set" in message and "Ray worker" in message
    assert "rlflow server up" in message and "source .rlflow/env.sh" in message

    clean_env.setenv(PREFECT_API_URL, f"http://127.0.0.1:{free_port()}/api")
    with _prefect_settings_from_env(), pytest.raises(ServiceError, match="does not answer"):
        require_prefect_api()

    clean_env.setenv(PREFECT_API_URL, urls[PREFECT_API_URL])
    with _prefect_settings_from_env():
        assert require_prefect_api() == urls[PREFECT_API_URL]


def test_require_mlflow_tracking(services, clean_env, tmp_path):
    _, urls = services
    with pytest.raises(ServiceError, match="MLFLOW_TRACKING_URI is not set"):
        require_mlflow_tracking()
    clean_env.setenv(MLFLOW_TRACKING_URI, "sqlite:///mlflow.db")
    with pytest.raises(ServiceError, match="relative SQLite"):
        require_mlflow_tracking()
    clean_env.setenv(MLFLOW_TRACKING_URI, f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert require_mlflow_tracking() == f"sqlite:///{tmp_path / 'mlflow.db'}"
    clean_env.setenv(MLFLOW_TRACKING_URI, f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ServiceError, match="does not answer"):
        require_mlflow_tracking()
    clean_env.setenv(MLFLOW_TRACKING_URI, urls[MLFLOW_TRACKING_URI])
    assert require_mlflow_tracking() == urls[MLFLOW_TRACKING_URI]


def test_apply_service_env_points_this_process_at_the_services(services, clean_env):
    import prefect.context

    _, urls = services
    try:
        apply_service_env(urls)
        assert os.environ[PREFECT_API_URL] == urls[PREFECT_API_URL]
        # No settings context of our own here: apply_service_env refreshed the one prefect built at import.
        assert require_prefect_api() == urls[PREFECT_API_URL]
        assert require_mlflow_tracking() == urls[MLFLOW_TRACKING_URI]
    finally:
        clean_env.undo()
        prefect.context.refresh_global_settings_context()


def test_mlflow_client_logs_metrics_artifacts_and_models_over_http(services, clean_env, tmp_path):
    import mlflow
    from mlflow import MlflowClient

    config, urls = services
    clean_env.setenv(MLFLOW_TRACKING_URI, urls[MLFLOW_TRACKING_URI])
    client = MlflowClient(tracking_uri=urls[MLFLOW_TRACKING_URI])
    experiment_id = client.create_experiment("services-test")
    assert client.get_experiment(experiment_id).artifact_location == f"mlflow-artifacts:/{experiment_id}"

    run_id = client.create_run(experiment_id).info.run_id
    client.log_metric(run_id, "reward", 0.25, step=3)
    (tmp_path / "rollouts.txt").write_text("prompt -> response\n")
    client.log_artifact(run_id, str(tmp_path / "rollouts.txt"), artifact_path="samples")
    assert [m.value for m in client.get_metric_history(run_id, "reward")] == [0.25]
    assert [f.path for f in client.list_artifacts(run_id, "samples")] == ["samples/rollouts.txt"]
    on_disk = list((config.state_dir / "mlflow" / "artifacts").rglob("rollouts.txt"))
    assert len(on_disk) == 1 and on_disk[0].read_text() == "prompt -> response\n"

    class Identity(mlflow.pyfunc.PythonModel):
        def predict(self, context, model_input: list[int], params=None) -> list[int]:
            return model_input

    with mlflow.start_run(run_id=run_id):
        info = mlflow.pyfunc.log_model(name="identity", python_model=Identity(), pip_requirements=[])
    assert info.artifact_path.startswith(f"mlflow-artifacts:/{experiment_id}/models/")
    assert mlflow.pyfunc.load_model(info.model_uri).predict([1, 2]) == [1, 2]


def test_port_conflict_names_the_port_and_the_option(tmp_path):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        busy = squatter.getsockname()[1]
        config = ServiceConfig(
            state_dir=tmp_path / "state", prefect_port=busy, mlflow_port=free_port(), ray_port=free_port()
        )
        with pytest.raises(ServiceError, match=rf"Port {busy} .* in use.*--prefect-port"):
            start_services(config)
    assert not (config.state_dir / "services.json").exists()
    assert not _pids_with_args("--port", str(config.mlflow_port))  # nothing was started
    assert not _pids_with_args(f"--port={config.ray_port}")


def test_free_ports_are_outside_the_ones_ray_and_the_kernel_hand_out_and_a_non_http_answer_is_not_healthy():
    import threading

    from flows.ops.services import RAY_WORKER_PORTS
    from flows.plumbing.servers import http_ok, http_status

    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(50)}
    assert all(RAY_WORKER_PORTS.stop <= port < ephemeral_low for port in ports), sorted(ports)
    assert len(ports) > 40  # picked at random, not one after the other from the same start
    with socket.socket() as squatter:  # answers like a gRPC server (HTTP/2 frames) on a port a server was meant for
        squatter.bind(("127.0.0.1", free_port()))
        squatter.listen()
        port = squatter.getsockname()[1]

        def answer_in_binary():
            for _ in range(2):
                connection, _ = squatter.accept()
                with connection:
                    connection.sendall(b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x04\x00\x40\x00\x00\r\n\r\n")

        threading.Thread(target=answer_in_binary, daemon=True).start()
        assert http_status(f"http://127.0.0.1:{port}/health") is None
        assert not http_ok(f"http://127.0.0.1:{port}/api/health")


def test_failed_start_stops_what_it_started(tmp_path):
    config = ServiceConfig(
        state_dir=tmp_path / "state",
        prefect_port=free_port(),
        mlflow_port=free_port(),
        ray_port=free_port(),
        startup_timeout_s=0.5,
    )
    expected = r"did not answer .* within 0.5 s \(ServiceConfig.startup_timeout_s\)\. Last lines of"
    with pytest.raises(ServiceError, match=expected):
        start_services(config)
    assert not (config.state_dir / "services.json").exists()
    for port in (config.prefect_port, config.mlflow_port):
        assert not _pids_with_args("--port", str(port))
    assert not _pids_with_args(f"--port={config.ray_port}")


def test_stop_kills_both_and_is_idempotent(services):
    """Runs last: the module's servers and Ray are gone afterwards, the Ray's processes with it."""
    import psutil

    config, urls = services
    ray_processes = psutil.Process(urls["ray_pid"]).children(recursive=True)
    assert any(p.name() == "raylet" for p in ray_processes)
    assert stop_services(config) == {"prefect": True, "mlflow": True, "ray": True, "controller": True}
    for name in ("prefect", "mlflow"):
        assert not _pids_with_args("--port", str(getattr(config, f"{name}_port")))
    assert not [p for p in ray_processes if alive(p)]
    assert _port_free(config.prefect_port) and _port_free(config.mlflow_port) and _port_free(config.ray_port)
    with pytest.raises(OSError):
        _get(urls[PREFECT_API_URL] + "/health")
    assert not (config.state_dir / "services.json").exists()
    assert stop_services(config) == {"prefect": False, "mlflow": False, "ray": False, "controller": False}
    assert not any(s["alive"] or s["healthy"] for s in service_status(config).values()), service_status(config)
