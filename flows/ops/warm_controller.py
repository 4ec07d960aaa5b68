"""The controller fork server's own process (flows/plumbing/forkserver.py says what it is for and how a command reaches
it): it imports what a command uses, listens on the socket, and forks a child per command it takes, which becomes the
command; it refuses a command whose environment differs in what imports read, or that comes after the code it
imported changed on disk (it then starts again with the code as it is now), and says why in its log. `rlflow
server up` starts it as ``python flows/ops/warm_controller.py <socket>`` (flows/ops/services.py)."""

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

# variables read when used, not at import: Prefect's settings (read again in the child), MLflow's, rlflow's, the
# object store's credentials, Ray's address and what `ray.init` sets in a parent that joined a Ray (Python's
# breakpoint hook, Ray's usage statistics), torch.distributed's rendezvous (read when a process group starts, which a
# controller never does; a test process that ran one in-process has them); and those of the terminal or of what
# started the command or the server (make's, when `make demo` started the servers; pytest's), which no library reads
_READ_WHEN_USED_PREFIXES = ("PREFECT_", "MLFLOW_", "RLFLOW_", "AWS_", "TORCHELASTIC_")
_READ_AT_IMPORT_PREFIXES = ("PREFECT_LOGGING_",)  # Prefect's logging is set up when it is imported
_MAY_DIFFER = {
    "_", "PWD", "OLDPWD", "SHLVL", "COLUMNS", "LINES", "RAY_ADDRESS", "PYTHONBREAKPOINT", "RAY_USAGE_STATS_ENABLED",
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "WINDOWID", "TERM_SESSION_ID", "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "TMUX_PANE", "STY", "GPG_TTY",
    "XDG_SESSION_ID", "MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES", "PYTEST_CURRENT_TEST",
    "_MLFLOW_TELEMETRY_SESSION_ID",
}  # fmt: skip
# _MLFLOW_TELEMETRY_SESSION_ID only names MLflow's telemetry session: MLflow sets it when a process makes its telemetry
# client and sets a new one when the client is made again, so a parent that used MLflow (a test process, a notebook)
# passes the server one value and its later commands another; refusing for it refused every command of such a parent.


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

    import flows.ops.cli  # noqa: F401  (typer, the services, the preflight checks)
    import flows.ops.demo  # noqa: F401
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
        from flows.plumbing.forkserver import checkout, python_identity

        uid = array.array("i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid != os.getuid():
            return "another user's command"
        if self.stale:
            return "the code changed since the server started: it restarts"
        if request["python"] != python_identity() or request["checkout"] != checkout():
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
    return name.startswith(_READ_WHEN_USED_PREFIXES) or name in _MAY_DIFFER


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
        from flows.ops.cli import run_command

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

    import flows.ops.cli
    from flows.controller import startup

    prefect.context.refresh_global_settings_context()  # PREFECT_* of the command's environment
    prefect.logging.configuration.setup_logging(incremental=False)  # its handlers write to the command's stderr
    flows.ops.cli.console = Console()  # whether stdout is a terminal, its width and colours
    startup.process_started(started)


if __name__ == "__main__":
    # run as a file (flows/ops/services.py): the checkout this file is in is the one it serves, whichever is installed
    # (so nothing of rlflow is imported above)
    sys.path[0] = str(Path(__file__).resolve().parents[2])
    from flows.ops.warm_controller import serve as serve_this_checkout

    serve_this_checkout(Path(sys.argv[1]))
