"""`rlflow ...` as a user types it (``python -m flows`` is the `rlflow` script): from the project root, with a wide
terminal (rich tables keep whole lines), in a child of the session's controller fork server once it answers
(flows/plumbing/forkserver.py; until then in a process of its own); and the worker processes such commands keep in a
local Ray."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def rlflow(
    *args: str, env: dict | None = None, timeout: float = 600, check: bool = True
) -> subprocess.CompletedProcess:
    """Run ``rlflow <args>`` and wait; with ``check``, a non-zero exit fails the test with the output's end."""
    done = subprocess.run(
        [sys.executable, "-m", "flows", *args],
        cwd=ROOT,
        env={**user_environment(), "COLUMNS": "300", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def rlflow_in_background(*args: str, env: dict | None = None) -> subprocess.Popen:
    """Start ``rlflow <args>`` in a session of its own (killing its process group takes its local Ray along);
    stdout and stderr together in ``.stdout``."""
    return subprocess.Popen(
        [sys.executable, "-m", "flows", *args],
        cwd=ROOT,
        env={**user_environment(), "COLUMNS": "300", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_for_controller(services: dict, timeout_s: float = 300) -> None:
    """Until the session's controller fork server answers (it imports everything first, and again after a change of
    the code it imported): the next command runs in its child."""
    import time

    from flows.plumbing.forkserver import CONTROLLER_ENV
    from flows.plumbing.servers import http_ok

    deadline = time.monotonic() + timeout_s
    while not http_ok(f"unix://{services[CONTROLLER_ENV]}", timeout=1.0):
        assert time.monotonic() < deadline, f"the controller fork server did not answer in {timeout_s} s"
        time.sleep(0.5)


def user_environment() -> dict[str, str]:
    """This process's environment as a user's shell has it: without the variable pytest sets for each test."""
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


def local_ray_workers(ray_pid: int) -> dict[int, str]:
    """pid -> Ray's title (``ray::<class>``, with ``.<method>`` while it runs one) of rlflow's worker actors and task
    hosts in the local Ray whose `ray start` process is ``ray_pid``, now."""
    found = {}
    for process in psutil.Process(ray_pid).children(recursive=True):
        try:
            name = process.name()
            rlflow_actor = name.startswith("ray::TaskHost") or (name.startswith("ray::") and "Worker" in name)
            if rlflow_actor and process.status() != psutil.STATUS_ZOMBIE:
                found[process.pid] = name
        except psutil.NoSuchProcess:
            continue
    return found
