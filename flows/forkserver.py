"""`rlflow` commands that start in a fraction of a second: the controller fork server kept by `rlflow server up`.

A run's controller spends most of a short run importing torch, transformers, Prefect, MLflow and Ray
(docs/performance.md). `rlflow server up` starts, beside the servers, a process that imports all of it once and
then waits on a unix socket (``<state_dir>/controller.sock``; ``$RLFLOW_CONTROLLER`` in env.sh names it). An
`rlflow` command (the client, ``main``: it imports nothing heavy) sends it its arguments, working directory,
environment and its standard streams (the descriptors themselves); the server forks a child that becomes the
command, in that directory and environment, writing to those streams, as if the command's own process had
imported everything. The client then only waits: it exits with the child's exit status (or dies of the same
signal), passes on the signals it gets (Ctrl-C, SIGTERM, SIGHUP, ...), and when it dies without passing anything
on (SIGKILL of its process group, as an operator or the kernel's OOM killer does), the child kills itself and its
process group at once, as it would have died with it. A child's process group is its own: what the run started
(a Ray of its own) goes with it, as it does with a command's process.

The server refuses a command, which then runs in the client's process as it does without a server, when:

- the client's environment differs from the one the server started with in a variable that something may read
  while it is imported (``_may_differ``: only Prefect's settings, which the child reads again, variables read when
  used, the shell's own and those the imports set may differ); or its Python, its options or its checkout differ;
- a module the server imported changed on disk since it started (a `git pull`, an edit, an upgrade): the server
  then starts again, with the code as it is now, once the commands it forked have ended;
- a Python thread other than its main one runs in the server (a fork copies only the calling thread). The idle
  native threads torch and pyarrow's allocator start at import are there, as when a PyTorch DataLoader forks its
  workers: both libraries are made for a fork after their import.

``rlflow server`` and ``rlflow worker`` always run in their own process. Each refusal is said in the server's log
(``<state_dir>/logs/controller.log``).
"""

from __future__ import annotations

import array
import contextlib
import gc
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

CONTROLLER_ENV = "RLFLOW_CONTROLLER"  # the server's socket (env.sh exports it; flows/services.py starts the server)
SOCKET_NAME = "controller.sock"
_OWN_PROCESS_COMMANDS = ("server", "worker")  # a server that stops the fork server; a Prefect worker that lives long
_FORWARDED = (
    signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH,
    signal.SIGCONT,
)  # fmt: skip
# variables read when used, not at import: Prefect's settings (read again in the child), MLflow's, rlflow's, the
# object store's credentials, Ray's address and what `ray.init` sets in a parent that joined a Ray (Python's
# breakpoint hook, Ray's usage statistics); and those of the terminal or of the process that started the command
# (pytest's, for each test), which no library reads
_READ_WHEN_USED_PREFIXES = ("PREFECT_", "MLFLOW_", "RLFLOW_", "AWS_")
_READ_AT_IMPORT_PREFIXES = ("PREFECT_LOGGING_",)  # Prefect's logging is set up when it is imported
_SHELL_OWN = {
    "_", "PWD", "OLDPWD", "SHLVL", "COLUMNS", "LINES", "RAY_ADDRESS", "PYTHONBREAKPOINT", "RAY_USAGE_STATS_ENABLED",
    "WINDOWID", "TERM_SESSION_ID", "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "TMUX_PANE", "STY", "GPG_TTY",
    "XDG_SESSION_ID", "PYTEST_CURRENT_TEST",
}  # fmt: skip


def socket_path(environ=os.environ) -> Path | None:
    """Where the fork server of this shell's servers listens: ``$RLFLOW_CONTROLLER``, else in the default state
    folder (``.rlflow`` in the current directory, or ``$RLFLOW_HOME``; flows/services.py). ``RLFLOW_CONTROLLER=``
    (set, empty): none, every command runs in its own process."""
    if CONTROLLER_ENV in environ:
        return Path(environ[CONTROLLER_ENV]) if environ[CONTROLLER_ENV] else None
    return Path(environ.get("RLFLOW_HOME") or ".rlflow").expanduser().resolve() / SOCKET_NAME


# ---------------------------------------------------------------------------------------------- the client


def main() -> NoReturn:
    """The `rlflow` command: run by the fork server when one is up and takes it, else in this process."""
    if sys.argv[1:2] and sys.argv[1] in _OWN_PROCESS_COMMANDS:
        code = None
    else:
        code = run_forked(sys.argv)
    if code is None:
        from flows.cli import run_command

        run_command()
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:  # the command died of signal -code: so does this process, for whoever waits for it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


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
        "python": _python(),
        "checkout": _checkout(),
        "started": _process_start(),
    }
    child, pending = None, []  # signals that come before the child does are passed on once it does

    def pass_on(signum, _frame):
        if child is None:
            pending.append(signum)
        else:
            _send(child, signum)

    before = {sig: signal.signal(sig, pass_on) for sig in _FORWARDED}
    socket.send_fds(client, [json.dumps(request).encode() + b"\n"], [*streams, me])
    os.close(me)
    reply = _read_message(files)
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


def _python() -> list:
    return [sys.executable, sys.version, list(sys.warnoptions), list(sys.flags)]


def _checkout() -> str:
    return str(Path(__file__).resolve().parents[1])


def _process_start() -> float:
    """This process's start (seconds since the epoch), from /proc: what a run's start-up phases count from."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------- the server


def serve(path: Path) -> NoReturn:
    """Import what a command uses, then fork a child for each command sent to ``path`` until SIGTERM."""
    from rlworkers.process_start import collector_off_while_importing

    started = time.time()  # what changed on disk after this is not what the server runs
    env = dict(os.environ)
    with collector_off_while_importing():
        _import_what_commands_use()
    gc.freeze()  # what the imports made lives as long as the server: children's collections skip it
    _Server(path, started, env).run()


def _import_what_commands_use() -> None:
    import setproctitle  # noqa: F401

    import flows.cli  # noqa: F401  (typer, the services, the preflight checks)
    import flows.demo  # noqa: F401
    from flows.launch import ALGORITHMS, get_flow

    for algorithm in ALGORITHMS:  # torch, transformers, Prefect, MLflow, Ray and each flow's modules
        get_flow(algorithm)
    for name in _ALSO_IMPORTED_BY_A_RUN:
        __import__(name)


# what a run imports when it gets there (sys.modules after a 2-step run, against the flows' imports): Prefect's flow
# engine, MLflow's transformers flavour (with peft and transformers' pipelines) and GitPython (its run context),
# Ray's Arrow serialization (pyarrow's datasets)
_ALSO_IMPORTED_BY_A_RUN = ("prefect.flow_engine", "mlflow.transformers", "git", "ray._private.arrow_serialization")


class _Server:
    """The loop: accept a command, fork its child (or refuse), tell each client how its child ended."""

    def __init__(self, path: Path, started: float, env: dict[str, str]):
        self.path, self.started, self.env = path, started, env
        # what the imports set in the environment (Ray's client mode, torch's compile cache, MLflow's session): the
        # same imports in the command's own process would have set them
        self.set_by_imports = {k: v for k, v in os.environ.items() if env.get(k) != v}
        self.children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, the client's connection)
        self.stale = False
        path.unlink(missing_ok=True)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # only this user may connect (the peer's uid is checked as well)
        try:
            self.listener.bind(str(path))
        finally:
            os.umask(old_umask)
        self.listener.listen(16)
        self.bound = path.stat().st_ino
        signal.signal(signal.SIGTERM, self.stop)

    def stop(self, _signum=None, _frame=None) -> NoReturn:
        """`rlflow server down`: nothing answers on the socket once this returns; the children run on."""
        self.listener.close()
        with contextlib.suppress(OSError):
            if self.path.stat().st_ino == self.bound:  # (not a socket a server started since bound there)
                self.path.unlink()
        os._exit(0)

    def run(self) -> NoReturn:
        _log(f"serving on {self.path}, {time.time() - self.started:.1f} s after the server's start")
        while True:
            if self.stale and not self.children:  # start again with the code as it is now: same command, same pid
                self.listener.close()
                os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], self.env)
            ready, _, _ = select.select([self.listener, *self.children], [], [])
            for item in ready:
                if item is self.listener:
                    connection, _ = self.listener.accept()
                    self.stale = self.stale or _changed_since(self.started)
                    child = self.take_command(connection)
                    if child is None:
                        connection.close()
                    else:
                        self.children[os.pidfd_open(child)] = (child, connection)
                else:
                    self.tell_how_it_ended(item)

    def tell_how_it_ended(self, pidfd: int) -> None:
        pid, connection = self.children.pop(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        _reply(connection, {"exit": -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)})
        connection.close()

    def take_command(self, connection: socket.socket) -> int | None:
        """Fork the child that runs the command sent on ``connection``: its pid, or None when refused (the client
        was told why)."""
        message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 4)
        while message and not message.endswith(b"\n"):
            more = connection.recv(1 << 20)
            if not more:
                break
            message += more
        try:
            if len(fds) != 4:  # `rlflow server status` connects and closes: nothing to run
                return None
            request = json.loads(message)
            reason = self.refusal(connection, request)
            if reason is not None:
                _log(f"refused `{' '.join(request['argv'][1:])}`: {reason}")
                _reply(connection, {"refused": reason})
                return None
            pid = os.fork()
            if pid == 0:
                self.listener.close()
                for pidfd, (_, other) in self.children.items():
                    os.close(pidfd)
                    other.close()
                env = request["env"]  # where it starts as the server did, the imports changed it as they did here
                env.update({k: v for k, v in self.set_by_imports.items() if env.get(k) == self.env.get(k)})
                _become_the_command(request, fds, connection)
            _reply(connection, {"pid": pid})
            _log(f"pid {pid}: `{' '.join(request['argv'][1:])}`")
            return pid
        finally:
            for fd in fds:
                os.close(fd)

    def refusal(self, connection: socket.socket, request: dict) -> str | None:
        """Why the command cannot run in a child of this server, or None."""
        uid = array.array("i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid != os.getuid():
            return "another user's command"
        if self.stale:
            return "the code changed since the server started: it restarts"
        if request["python"] != _python() or request["checkout"] != _checkout():
            return "another Python, other options, or another checkout"
        env = request["env"]
        differ = sorted(k for k in set(self.env) | set(env) if self.env.get(k) != env.get(k))
        # (what the imports set: a client whose parent imported the same libraries has it too)
        read_at_import = [k for k in differ if not _may_differ(k) and k not in self.set_by_imports]
        if read_at_import:
            return f"the environment differs in {', '.join(read_at_import[:5])}"
        if threading.active_count() > 1:
            return "a Python thread runs in the server (a fork copies only one)"
        return None


def _may_differ(name: str) -> bool:
    if name.startswith(_READ_AT_IMPORT_PREFIXES):
        return False
    return name.startswith(_READ_WHEN_USED_PREFIXES) or name in _SHELL_OWN


def _changed_since(started: float) -> bool:
    """Whether a file of a module the server imported changed after ``started`` (said in the log)."""
    from rlworkers.loading import modules_changed_since_start

    changed = modules_changed_since_start(since=started)
    if changed:
        _log(f"{len(changed)} imported files changed since the start (e.g. {changed[0]}): restarting")
    return bool(changed)


def _reply(connection: socket.socket, message: dict) -> None:
    try:
        connection.sendall(json.dumps(message).encode() + b"\n")
    except OSError:  # the client is gone (its child saw it and ended)
        pass


def _log(line: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}", flush=True)


def _become_the_command(request: dict, fds: list[int], connection: socket.socket) -> NoReturn:
    """In the forked child: the command's process, as if it had started with everything imported."""
    try:
        import setproctitle

        os.setsid()  # a process group of its own: what the run starts goes with it
        # in ps and top: the command, not the server (before the environment changes: setproctitle uses its memory)
        setproctitle.setproctitle(" ".join(["rlflow", *request["argv"][1:]]))
        stdin, stdout, stderr, client = fds
        for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, target)
        for fd in (stdin, stdout, stderr):
            if fd > 2:
                os.close(fd)
        connection.close()
        for sig in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _die_with(client)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["rlflow", *request["argv"][1:]]  # its usage lines name the command, not this file
        sys.stdout.reconfigure(line_buffering=sys.stdout.isatty())
        _as_if_started_now(request["started"])
        from flows.cli import run_command

        run_command()  # ends the process
    except BaseException as error:  # noqa: BLE001  (a child never returns to the server's loop)
        print(f"rlflow: the forked command failed to start: {error!r}", file=sys.stderr, flush=True)
    os._exit(1)


def _die_with(client_pidfd: int) -> None:
    """The client's death (its pidfd readable) kills this process and its group at once, from a thread."""

    def watch() -> None:
        select.select([client_pidfd], [], [])
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="rlflow-client-watch", daemon=True).start()


def _as_if_started_now(started: float) -> None:
    """What the imports read from the server's process when they ran, read again from the command's."""
    import prefect.context
    import prefect.logging.configuration
    from rich.console import Console

    import flows.cli
    from flows import startup

    prefect.context.refresh_global_settings_context()  # PREFECT_* of the command's environment
    prefect.logging.configuration.setup_logging(incremental=False)  # its handlers write to the command's stderr
    flows.cli.console = Console()  # whether stdout is a terminal, its width and colours
    startup.process_started(started)


if __name__ == "__main__":
    # run as a file (flows/services.py): the checkout this file is in is the one it serves, whichever is installed
    sys.path[0] = _checkout()
    from flows.forkserver import serve as serve_this_checkout

    serve_this_checkout(Path(sys.argv[1]))
