"""`rlflow` ends without Python's tear-down (flows.ops.cli.run_command), but only after what Python's exit runs first:
the threads that are not daemons, the exit handlers, then the streams' flush; with the command's own exit code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# a command run as the console script runs it, with a thread still working and an exit handler that prints
# without flushing (stdout is a pipe: block-buffered, lost unless the streams are flushed before the process ends)
PROGRAM = """
import atexit, sys, threading, time
from flows.ops.cli import run_command
atexit.register(lambda: print("exit handler"))
threading.Thread(target=lambda: (time.sleep(2), print("thread done"))).start()
sys.argv = ["rlflow", *sys.argv[1:]]
run_command()
"""


@pytest.mark.parametrize(("args", "code"), [(["--help"], 0), (["train", "no-such-algorithm"], 2)])
def test_the_command_ends_after_its_threads_and_exit_handlers_with_its_code(args, code):
    done = subprocess.run([sys.executable, "-c", PROGRAM, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    # the thread, still sleeping when the command was done (unless the machine is slower than 2 s for it), was
    # waited for; the exit handler's line, printed last, reached the pipe
    assert "thread done" in lines and lines[-1] == "exit handler", done.stdout[-2000:]
