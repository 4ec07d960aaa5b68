"""Fault injection from outside the process under test, as the kernel or an operator would do it: find a Ray
worker by what it is doing right now (Ray titles a busy actor process ``ray::<Class>.<method>``) and signal it."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import psutil


def busy_worker(title: str) -> psutil.Process | None:
    """The process whose title starts with ``title`` (e.g. ``ray::ActorRolloutRefWorker.update_actor``)."""
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if cmdline and cmdline[0].startswith(title):
            return process
    return None


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
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGCONT)


def checkpoint_exists(root: str, step: int) -> Callable[[], bool]:
    return lambda: (Path(root) / "checkpoints" / f"step_{step}" / "manifest.json").exists()


def after(injector: Injector, count: int) -> Callable[[], bool]:
    """True once ``injector`` has made ``count`` hits and the processes it hit are gone (recovery is under way)."""
    def ready() -> bool:
        hit = injector.done[:count]
        return len(hit) == count and not any(psutil.pid_exists(pid) and psutil.Process(pid).status() !=
                                             psutil.STATUS_ZOMBIE for _, pid, _ in hit)
    return ready
