"""The controller fork server (flows/plumbing/forkserver.py, flows/ops/warm_controller.py), started as `rlflow server
up` starts it but on its own: a command it takes runs in its forked child, with its exit code, its streams and its name;
one whose environment differs in what imports read, or that comes after the server's code changed on disk, runs in its
own process as without a server, and the server starts again with the code as it is now. (Runs through it, killed
ones included: tests/test_local_ray.py and every `rlflow` command of the suite, tests/rlflow_cli.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.ops import warm_controller
from flows.plumbing import forkserver
from flows.plumbing.servers import http_ok

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fork_server(tmp_path_factory):
    """The server, started on a module of this test's (``marker``) besides rlflow's: the code whose change it
    notices. Yields the environment its commands run with, the marker's file and the server's log."""
    folder = tmp_path_factory.mktemp("forkserver")
    marker = folder / "forkserver_test_marker.py"
    marker.write_text("")
    sock, log = folder / forkserver.SOCKET_NAME, folder / "controller.log"
    start = (
        f"import sys; sys.path.insert(0, {str(folder)!r}); import forkserver_test_marker; "
        f"sys.argv = ['warm_controller.py', {str(sock)!r}]; import runpy; "
        f"runpy.run_path({warm_controller.__file__!r}, run_name='__main__')"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env["_MLFLOW_TELEMETRY_SESSION_ID"] = "the-starting-process-used-mlflow"  # as `rlflow server up` from a notebook
    with open(log, "ab") as out:
        server = subprocess.Popen(
            [sys.executable, "-c", start], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_until_serving(sock, log)
        yield {**env, forkserver.CONTROLLER_ENV: str(sock)}, marker, log
    finally:
        server.kill()
        server.wait(30)


def wait_until_serving(sock: Path, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not http_ok(f"unix://{sock}", timeout=1.0):
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)


def rlflow(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def log_lines_since(log: Path, offset: int) -> str:
    return log.read_text()[offset:]


def test_a_command_runs_forked_with_its_exit_code_streams_and_name(fork_server):
    env, _, log = fork_server
    offset = len(log.read_text())
    done = rlflow(env, "train", "no-such-algorithm")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "unknown algorithm 'no-such-algorithm'" in done.stderr and "Usage: rlflow train" in done.stderr
    forked = log_lines_since(log, offset)
    assert "`train no-such-algorithm`" in forked and "refused" not in forked, forked

    done = rlflow(env, "--help")
    assert done.returncode == 0 and "Usage: rlflow" in done.stdout, done.stderr[-2000:]


def test_a_command_whose_environment_differs_in_what_imports_read_runs_in_its_own_process(fork_server):
    env, _, log = fork_server
    offset = len(log.read_text())
    done = rlflow({**env, "HF_HUB_OFFLINE": "1"}, "train", "no-such-algorithm")
    assert done.returncode == 2 and "unknown algorithm" in done.stderr, done.stderr[-2000:]
    said = log_lines_since(log, offset)
    assert "refused `train no-such-algorithm`: the environment differs in HF_HUB_OFFLINE" in said, said

    # what the child reads again (Prefect's settings), what is read when used (MLflow's), the shell's own: forked
    offset = len(log.read_text())
    differ = {"PREFECT_API_URL": "http://127.0.0.1:9/api", "MLFLOW_TRACKING_URI": "http://127.0.0.1:9", "COLUMNS": "91"}
    # MLflow names a telemetry session by it when a process first uses MLflow, a new one after its client is reset
    differ["_MLFLOW_TELEMETRY_SESSION_ID"] = "a-later-session-of-the-parent"
    done = rlflow({**env, **differ}, "train", "no-such-algorithm")
    assert done.returncode == 2, done.stderr[-2000:]
    said = log_lines_since(log, offset)
    assert "refused" not in said and "`train no-such-algorithm`" in said, said


def test_after_its_code_changed_the_server_refuses_then_starts_again_with_the_new_code(fork_server):
    env, marker, log = fork_server
    sock = Path(env[forkserver.CONTROLLER_ENV])
    offset = len(log.read_text())
    marker.write_text("CHANGED = True\n")  # an edit, a `git pull`
    done = rlflow(env, "train", "no-such-algorithm")
    assert done.returncode == 2 and "unknown algorithm" in done.stderr, done.stderr[-2000:]
    said = log_lines_since(log, offset)
    assert "forkserver_test_marker.py): restarting" in said and "refused `train no-such-algorithm`" in said, said

    time.sleep(1)  # the restarted server binds its socket again once it imported everything
    wait_until_serving(sock, log)
    offset = len(log.read_text())
    done = rlflow(env, "train", "no-such-algorithm")
    assert done.returncode == 2, done.stderr[-2000:]
    said = log_lines_since(log, offset)
    assert "refused" not in said and "`train no-such-algorithm`" in said, said


def test_a_server_that_closes_before_taking_the_command_lets_the_command_run_itself(tmp_path, monkeypatch):
    """A server that restarts (the code changed) closes its socket with connections not yet taken: a command that
    connected then must run in its own process (``run_forked`` returns None), not fail on the broken pipe (two
    commands started at once, one taken, one in the socket's backlog, failed so)."""
    import socket

    path = tmp_path / "controller.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)
    monkeypatch.setenv(forkserver.CONTROLLER_ENV, str(path))
    real_start = forkserver.process_start

    def server_goes_away_after_the_connect():  # called while the request is built: connected, not yet sent
        listener.close()
        return real_start()

    monkeypatch.setattr(forkserver, "process_start", server_goes_away_after_the_connect)
    assert forkserver.socket_path() == path
    assert forkserver.run_forked([sys.executable, "train", "--help"]) is None
