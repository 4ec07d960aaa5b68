"""`rlflow ...` as a user types it: the CLI in a process of its own (so its own Ray), from the project root, with a
wide terminal (rich tables keep whole lines); and the worker processes such commands keep in a local Ray."""

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
        [sys.executable, "-m", "flows.cli", *args],
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "300", **(env or {})},
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
        [sys.executable, "-m", "flows.cli", *args],
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "300", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


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
