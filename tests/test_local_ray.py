"""Runs of different processes in the local Ray of `rlflow server up` (the session's, tests/conftest.py): each
`rlflow train` joins it, the next one builds its workers in the processes the one before kept (flows/plumbing/kept.py)
and trains exactly as in new ones, unless code they imported changed on disk since; the processes a SIGKILLed run held
are ended by the registry, with nothing left."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
from rlflow_cli import local_ray_workers, rlflow, rlflow_in_background, wait_for_controller
from safetensors.torch import load_file

import rlworkers.workers.common
from rlworkers.models.tiny import ensure_tiny_model

pytestmark = pytest.mark.slow


def test_the_next_command_trains_in_the_processes_the_last_one_kept_and_a_killed_ones_are_ended(services, tmp_path):
    model = ensure_tiny_model(tmp_path / "tiny")
    common = ["sft", "--config", "demo-sft", f"model.path={model}", f"trainer.runs_dir={tmp_path}",
              "trainer.total_steps=2", "trainer.test_freq=0", "trainer.log_model=false", "trainer.log_samples=0",
              "trainer.n_workers=2"]  # fmt: skip
    first = rlflow("train", *common, "trainer.run_name=first")
    assert "Joining the local Ray of `rlflow server up`" in first.stdout + first.stderr
    kept = local_ray_workers(services["ray_pid"])
    assert sorted(kept.values()) == ["ray::ActorRolloutRefWorker"] * 2 + ["ray::TaskHost"], kept

    rlflow("train", *common, "trainer.run_name=second")
    assert local_ray_workers(services["ray_pid"]) == kept  # the same processes, idle again
    weights = [load_file(tmp_path / name / "final_model" / "model.safetensors") for name in ("first", "second")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])

    # code the kept processes imported changed on disk (an edit, a `git pull`): the next run starts new ones
    source = Path(rlworkers.workers.common.__file__)
    stat = source.stat()
    os.utime(source)
    try:
        rlflow("train", *common, "trainer.run_name=edited")
    finally:
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    edited = local_ray_workers(services["ray_pid"])
    assert len(edited) == 3 and not set(edited) & set(kept), (edited, kept)
    kept = edited

    # a run SIGKILLed (with its process group) while it trains in the kept processes: the registry ends them. Its
    # controller is a child of the session's controller fork server (restarted by the edit above: waited for), not
    # the command's process; it dies with the command
    wait_for_controller(services)
    killed = rlflow_in_background("train", *common, "trainer.run_name=killed", "trainer.total_steps=400")
    checkpoint = tmp_path / "killed" / "run.json"
    deadline = time.monotonic() + 300
    while not checkpoint.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(3)  # training
    assert set(local_ray_workers(services["ray_pid"])) == set(kept)  # (named by the method each runs now)
    controller = [
        process
        for process in psutil.process_iter(["cmdline"])
        if process.pid != killed.pid and "trainer.run_name=killed" in " ".join(process.info["cmdline"] or [])
    ]
    assert len(controller) == 1 and controller[0].ppid() != killed.pid, controller
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait(30)
    assert not psutil.wait_procs(controller, timeout=30)[1]
    gone = psutil.wait_procs([psutil.Process(pid) for pid in kept if psutil.pid_exists(pid)], timeout=60)[1]
    assert not gone, [p.pid for p in gone]
    assert local_ray_workers(services["ray_pid"]) == {}

    last = rlflow("train", *common, "trainer.run_name=after")  # new processes, same numbers
    assert "Joining the local Ray" in last.stdout + last.stderr
    after = load_file(tmp_path / "after" / "final_model" / "model.safetensors")
    assert all(torch.equal(weights[0][k], after[k]) for k in after)
    assert not set(local_ray_workers(services["ray_pid"])) & set(kept)


JOIN_A_NEW_LOCAL_RAY = """
import os, signal, socket, subprocess, sys, tempfile, time
import ray
from flows.plumbing import kept
from flows.ops.services import free_port, local_ray_command

if sys.argv[1] == "with-token":
    kept.ensure_token()  # what `rlflow server up` does before `ray start`
port, temp_dir = free_port(), tempfile.mkdtemp(prefix="/tmp/rlt-")
head = subprocess.Popen(local_ray_command(port, 2, temp_dir), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                        start_new_session=True)
try:
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert head.poll() is None and time.monotonic() < deadline
            time.sleep(0.25)
    kept.use_token_authentication()  # a run's join (flows/plumbing/task_runner.py)
    try:
        ray.init(address=f"127.0.0.1:{port}", log_to_driver=False)
        print("joined", ray.cluster_resources()["CPU"], flush=True)
        ray.shutdown()  # before its Ray ends: a driver whose Ray is gone waits for it at exit
    except Exception as error:
        print("refused", type(error).__name__)
finally:
    os.killpg(head.pid, signal.SIGKILL)
"""


@pytest.mark.parametrize("token", ["with-token", "without"])
def test_a_machine_where_ray_never_ran_gets_a_token_before_the_local_ray_starts(tmp_path, token):
    """On a new machine (no ~/.ray/auth_token) `ray start` leaves Ray's token authentication off, and a run's join,
    which sends a token, is refused: the local Ray of `rlflow server up` (and each test process's) is started after
    ``kept.ensure_token`` made one, with Ray's own function."""
    import subprocess
    import sys

    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(home)}
    done = subprocess.run(
        [sys.executable, "-c", JOIN_A_NEW_LOCAL_RAY, token],
        env=env,
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    last = done.stdout.strip().splitlines()[-1:] or [done.stderr[-2000:]]
    if token == "with-token":
        assert last == ["joined 2.0"], done.stderr[-2000:]
        assert len((home / ".ray" / "auth_token").read_text()) >= 32
    else:
        assert last == ["refused AuthenticationError"], done.stderr[-2000:]
        assert not (home / ".ray" / "auth_token").exists()


def test_a_holder_is_its_pid_and_its_start_in_ticks_since_boot_not_the_wall_clock():
    """The registry tells a live holder from a dead one (or a new process with its pid) by the start recorded with it;
    a start derived from the wall clock moved when the clock was adjusted and a live run's groups were ended."""
    import subprocess
    import sys

    from flows.plumbing import kept
    from flows.plumbing.forkserver import start_ticks

    pid, started = kept.holder()
    assert pid == os.getpid() and isinstance(started, int)
    assert kept._holder_alive((pid, started))
    assert not kept._holder_alive((pid, started + 1))  # another process that got this pid later
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child_started = start_ticks(child.pid)
    child.wait()
    assert not kept._holder_alive((child.pid, child_started))  # gone
