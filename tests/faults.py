"""Fault injection from outside the process under test, as the kernel or an operator would do it: find a Ray
worker by what it is doing right now (Ray titles a busy actor process ``ray::<Class>.<method>``) and signal it;
cut the network between the run and its object store (``TcpProxy``)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Callable

import psutil


@contextlib.contextmanager
def cpu_hogs(count: int):
    """``count`` processes that burn CPU until the block ends (another job on the machine)."""
    import subprocess
    import sys

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def busy_worker(title: str) -> psutil.Process | None:
    """The process under this one whose title starts with ``title`` (e.g. ``ray::ActorRolloutRefWorker.update_actor``):
    this test's Ray runs under this process, another test's (`make test` runs two at once) does not."""
    for process in psutil.Process().children(recursive=True):
        try:
            cmdline = process.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if cmdline and cmdline[0].startswith(title):
            return process
    return None


class ProcessWatch(threading.Thread):
    """``with ProcessWatch(title) as watch:`` looks for a process whose title starts with ``title`` every 0.2 s
    while the block runs; ``watch.seen`` says whether one ever ran."""

    def __init__(self, title: str):
        super().__init__(daemon=True)
        self.title, self.seen, self._done = title, False, threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.2):
            self.seen = self.seen or busy_worker(self.title) is not None

    def __enter__(self) -> ProcessWatch:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._done.set()
        self.join()


class Injector(threading.Thread):
    """Runs ``plan`` in the background: a list of (wait_until, title, signal) applied in order; each signal goes
    to the first process seen running ``title`` once ``wait_until()`` is true. ``done`` lists what was hit."""

    def __init__(self, plan: list[tuple[Callable[[], bool], str, int]], timeout_s: float = 600):
        super().__init__(daemon=True)
        self.plan, self.timeout_s = plan, timeout_s
        self.done: list[tuple[str, int, int]] = []  # (title, pid, signal)
        self.stopped: list[int] = []
        self._halt = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        for wait_until, title, sig in self.plan:
            while not self._halt.is_set() and time.monotonic() < deadline:
                process = busy_worker(title) if wait_until() else None
                if process is not None:
                    os.kill(process.pid, sig)
                    self.done.append((title, process.pid, sig))
                    if sig == signal.SIGSTOP:
                        self.stopped.append(process.pid)
                    break
                time.sleep(0.01)

    def stop(self) -> None:
        """End the plan and let stopped processes go on (the run ended them already, or they exit on their own)."""
        self._halt.set()
        self.join(5)
        for pid in self.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def checkpoint_exists(root: str, step: int) -> Callable[[], bool]:
    return lambda: (Path(root) / "checkpoints" / f"step_{step}" / "manifest.json").exists()


def after(injector: Injector, count: int) -> Callable[[], bool]:
    """True once ``injector`` has made ``count`` hits and the processes it hit are gone (recovery is under way)."""

    def ready() -> bool:
        hit = injector.done[:count]
        # a process that ends between two looks at it is gone, not an error of the injector's thread
        return len(hit) == count and not any(alive(pid) for _, pid, _ in hit)

    return ready


class TcpProxy(threading.Thread):
    """A TCP relay on 127.0.0.1 in front of ``target_port``: clients connect to ``port``. ``cut()`` is a network
    partition as an operator would make one (every open connection reset, new ones refused at once);
    ``restore()`` ends it. ``cut_at(marker, nth)`` partitions at an exact point of a protocol, whatever the load
    on the machine: the ``nth`` client request containing ``marker`` is refused before it is relayed, and so is
    every request and connection after it, while the requests already relayed finish (an HTTP request is a
    client chunk that starts with a method; the rest of a body already under way still passes). ``act_at(marker,
    action, nth)`` instead calls ``action(sender)`` with the pid of the process that sent that request (e.g. to kill
    it) and drops that request only: the proxy stays up for the client's next attempt."""

    def __init__(self, target_port: int):
        super().__init__(daemon=True)
        self.target_port = target_port
        self._trigger: tuple[bytes, int] | None = None
        self._action: Callable[[int | None], None] | bytes | None = None
        self._every = False  # answer_at(every=True): the trigger stays armed
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.is_cut = threading.Event()
        self._halt = threading.Event()
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self.answered: list[bytes] = []  # request lines answer_at answered

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                continue
            if self.is_cut.is_set():
                _reset(client)
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._open += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink, source is client), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, from_client: bool) -> None:
        try:
            while data := source.recv(65536):
                if from_client:
                    hit, action = self._triggered(data)
                    if hit and isinstance(action, bytes):  # answer_at: this request answered here, not relayed
                        source.sendall(action)
                        self.answered.append(data.split(b"\r\n", 1)[0])
                        return
                    if hit and action is not None:  # act_at: this request only
                        action(sender_pid(source))
                        _reset(source)
                        return
                    if hit or (self.is_cut.is_set() and _starts_request(data)):
                        self.is_cut.set()
                        _reset(source)
                        return
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def cut_at(self, marker: bytes, nth: int = 1) -> None:
        with self._lock:
            self._trigger, self._action, self._every = (marker, nth), None, False

    def act_at(self, marker: bytes, action: Callable[[int | None], None], nth: int = 1) -> None:
        with self._lock:
            self._trigger, self._action, self._every = (marker, nth), action, False

    def answer_at(
        self, marker: bytes, status: int = 503, reason: str = "Service Unavailable", nth: int = 1, every: bool = False
    ) -> None:
        """The ``nth`` request containing ``marker`` gets an HTTP error response from the proxy instead of the
        server's, as a loaded server or a gateway in front of it answers now and then (its request line lands in
        ``answered``); the connection then closes and the next ones are relayed. With ``every``, every request
        containing ``marker`` from the ``nth`` on (a server that stays down for that endpoint)."""
        body = f"{status} {reason}".encode()
        head = f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
        with self._lock:
            self._trigger, self._action = (marker, nth), (head + "Connection: close\r\n\r\n").encode() + body
            self._every = every

    def _triggered(self, data: bytes) -> tuple[bool, Callable[[int | None], None] | bytes | None]:
        """Whether ``data`` is the request the trigger waits for, and the action to take (None: cut)."""
        with self._lock:
            if self._trigger is None or self._trigger[0] not in data:
                return False, None
            marker, nth = self._trigger
            if nth > 1 or not self._every:
                self._trigger = None if nth == 1 else (marker, nth - 1)
            return nth == 1, self._action

    def cut(self) -> None:
        self.is_cut.set()
        with self._lock:
            for sock in self._open:
                _reset(sock)
            self._open.clear()

    def restore(self) -> None:
        self.is_cut.clear()

    def stop(self) -> None:
        self._halt.set()
        self.cut()
        self.listener.close()


def sender_pid(accepted: socket.socket) -> int | None:
    """The pid of the process on this machine whose TCP socket is the other end of ``accepted`` (None: gone)."""
    with contextlib.suppress(OSError):
        peer = accepted.getpeername()
        for connection in psutil.net_connections(kind="tcp"):
            if connection.pid and connection.laddr and tuple(connection.laddr) == peer:
                return connection.pid
    return None


def kill_process_groups(*pids: int | None) -> None:
    """SIGKILL the process group of each of ``pids`` and wait until every process signalled has died (a zombie or
    gone; none is reaped here), as the kernel's OOM killer ends a process: nothing runs in them after this returns."""
    groups = set()
    for pid in pids:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):  # one that already ended has no group left to kill
                groups.add(os.getpgid(pid))
    members = [process for process in psutil.process_iter() if _group_of(process) in groups]
    for group in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(map(alive, members)) and time.monotonic() < deadline:
        time.sleep(0.005)


def _group_of(process: psutil.Process) -> int | None:
    try:
        return os.getpgid(process.pid)
    except ProcessLookupError:
        return None


def alive(process: psutil.Process | int) -> bool:
    """``process`` (or the pid) runs and is not a zombie, now; one that ends while it is looked at does not (never
    ``pid_exists`` then ``status``: the process may end in between, and the second raises NoSuchProcess)."""
    try:
        process = process if isinstance(process, psutil.Process) else psutil.Process(process)
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _starts_request(data: bytes) -> bool:
    return data.split(b" ", 1)[0] in (b"GET", b"PUT", b"POST", b"HEAD", b"DELETE", b"PATCH", b"OPTIONS")


def _reset(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST
        sock.close()
