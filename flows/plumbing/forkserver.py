"""`rlflow` commands that start in a fraction of a second: the controller fork server kept by `rlflow server up`.

A run's controller spends most of a short run importing torch, transformers, Prefect, MLflow and Ray
(docs/performance.md). `rlflow server up` starts, beside the servers, a process that imports all of it once and
then waits on a unix socket (``<state_dir>/controller.sock``; ``$RLFLOW_CONTROLLER`` in env.sh names it). An
`rlflow` command (the client: flows/__main__.py, with ``run_forked`` here; it imports nothing heavy) sends it its
arguments, working directory, environment and its standard streams (the descriptors themselves); the server forks a
child that becomes the command, in that directory and environment, writing to those streams, as if the command's own
process had imported everything. The client then only waits: it exits with the child's exit status (or dies of the
same signal), passes on the signals it gets (Ctrl-C, SIGTERM, SIGHUP, ...), and when it dies without passing
anything on (SIGKILL of its process group, as an operator or the kernel's OOM killer does), the child kills itself
and its process group at once, as it would have died with it. A child's process group is its own: what the run
started (a Ray of its own) goes with it, as it does with a command's process.

The server (flows/ops/warm_controller.py) refuses a command, which then runs in the client's process as it does without
a server, when:

- the client's environment differs from the one the server started with in a variable that something may read
  while it is imported (``warm_controller._may_differ``: only Prefect's settings, which the child reads again,
  variables read when used, the shell's own and those the imports set may differ); or its Python, its options or
  its checkout differ;
- a module the server imported changed on disk since it started (a `git pull`, an edit, an upgrade): the server
  then starts again, with the code as it is now, once the commands it forked have ended;
- a Python thread other than its main one runs in the server (a fork copies only the calling thread). The idle
  native threads torch and pyarrow's allocator start at import are there, as when a PyTorch DataLoader forks its
  workers: both libraries are made for a fork after their import.

``rlflow server`` and ``rlflow worker`` always run in their own process. Each refusal is said in the server's log
(``<state_dir>/logs/controller.log``).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
from pathlib import Path

CONTROLLER_ENV = "RLFLOW_CONTROLLER"  # the server's socket (env.sh exports it; flows/ops/services.py starts the server)
SOCKET_NAME = "controller.sock"
OWN_PROCESS_COMMANDS = ("server", "worker")  # a server that stops the fork server; a Prefect worker that lives long
_FORWARDED = (
    signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH,
    signal.SIGCONT,
)  # fmt: skip


def socket_path(environ=os.environ) -> Path | None:
    """Where the fork server of this shell's servers listens: ``$RLFLOW_CONTROLLER``, else in the default state
    folder (``.rlflow`` in the current directory, or ``$RLFLOW_HOME``; flows/ops/services.py). ``RLFLOW_CONTROLLER=``
    (set, empty): none, every command runs in its own process."""
    if CONTROLLER_ENV in environ:
        return Path(environ[CONTROLLER_ENV]) if environ[CONTROLLER_ENV] else None
    return Path(environ.get("RLFLOW_HOME") or ".rlflow").expanduser().resolve() / SOCKET_NAME


def run_forked(argv: list[str]) -> int | None:
    """Have the fork server run ``argv``: its exit code (minus a signal's number when it died of one), or None when
    no server is up or it refused (the caller runs the command itself)."""
    path = socket_path()
    if path is None or not path.exists():
        return None
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(str(path))
    except OSError:  # a socket left by a server that died
        client.close()
        return None
    files = client.makefile("rb")
    streams = [fd if _is_open(fd) else os.open(os.devnull, os.O_RDWR) for fd in (0, 1, 2)]
    me = os.pidfd_open(os.getpid())  # the child watches it: it dies with this process
    request = {
        "argv": argv,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "python": python_identity(),
        "checkout": checkout(),
        "started": process_start(),
    }
    child, pending = None, []  # signals that come before the child does are passed on once it does

    def pass_on(signum, _frame):
        if child is None:
            pending.append(signum)
        else:
            _send(child, signum)

    before = {sig: signal.signal(sig, pass_on) for sig in _FORWARDED}
    try:
        socket.send_fds(client, [json.dumps(request).encode() + b"\n"], [*streams, me])
        reply = _read_message(files)
    except (BrokenPipeError, ConnectionResetError):  # it closed before taking the command (it restarts): no child
        reply = None
    os.close(me)
    if reply is None or "refused" in reply:
        client.close()
        for sig, handler in before.items():
            signal.signal(sig, handler)
        for sig in pending:  # to this process, which runs the command itself
            os.kill(os.getpid(), sig)
        return None
    child = reply["pid"]
    for sig in pending:
        _send(child, sig)
    # Ctrl-Z: the child stops too; `fg` sends SIGCONT, passed on
    signal.signal(signal.SIGTSTP, lambda _s, _f: (_send(child, signal.SIGSTOP), os.kill(os.getpid(), signal.SIGSTOP)))
    ended = _read_message(files)
    if ended is None:  # the server went away first (`rlflow server down`): wait for the child, its status unknown
        with contextlib.suppress(ProcessLookupError):
            select.select([os.pidfd_open(child)], [], [])
        return 1
    return ended["exit"]


def _send(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _read_message(files) -> dict | None:
    line = files.readline()
    return json.loads(line) if line else None


def python_identity() -> list:
    return [sys.executable, sys.version, list(sys.warnoptions), list(sys.flags)]


def checkout() -> str:
    return str(Path(__file__).resolve().parents[2])


def start_ticks(pid: int | str = "self") -> int:
    """When process ``pid`` started, in clock ticks since the machine booted (/proc/<pid>/stat's 22nd field; the
    fields after the command's name start at the 3rd)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def process_start() -> float:
    """This process's start (seconds since the epoch), from /proc: what a run's start-up phases count from."""
    ticks = start_ticks()
    boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")
