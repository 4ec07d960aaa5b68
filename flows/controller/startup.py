"""Where a run's fixed cost goes: its start-up phases timed from the moment its process started, logged at step 0 as
``timing_s/startup/<phase>`` (and ``timing_s/publish`` at the end), and said in one line when the run starts.

The phases, in order: ``imports`` (the interpreter, Prefect, Ray, MLflow, torch and the flow's modules, up to the
flow's call), ``flow_start`` (Prefect creates the flow run and validates the config), ``checks`` (the servers, the
lineage's lock), ``ray`` (start a local Ray, or join a cluster), ``data`` (tokenizer, rows and their checks, the start
model), ``tracking`` (the MLflow run and its params), ``worker_groups`` (worker processes start, import, load the
model), ``restore`` (a checkpoint, when resuming) and ``validate_start`` (the start model's validation at step 0).
``bench/startup.py`` runs a short job and prints their shares. A run in a process that ran another before (tests,
notebooks) times its ``imports`` from the end of the previous one."""

from __future__ import annotations

import time

import psutil


class StartupClock:
    """Seconds per phase: ``mark(phase)`` ends ``phase`` now, and the next phase starts."""

    def __init__(self, since: float):
        self.last = since
        self.phases: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.time()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last
        self.last = now

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/startup/{phase}": seconds for phase, seconds in self.phases.items()}

    def summary(self) -> str:
        total = sum(self.phases.values())
        parts = ", ".join(f"{phase} {seconds:.1f}" for phase, seconds in self.phases.items())
        return f"{total:.1f} s from the process's start ({parts})"


_previous_run_ended: float | None = None  # a process that runs several flows (tests, notebooks)
_called: StartupClock | None = None
_command_started: float | None = None  # a command forked by the controller fork server: its client's start


def process_started(when: float) -> None:
    """This run's command started at ``when``, not when this process did (flows/plumbing/forkserver.py: the process was
    forked from one that had imported everything; its ``imports`` phase is the client's start and the fork)."""
    global _command_started
    _command_started = when


def _since() -> float:
    return _previous_run_ended or _command_started or psutil.Process().create_time()


def mark_flow_called() -> None:
    """What a flow's caller (``flows.launch.run_training``) marks when it calls the flow: the end of ``imports``."""
    global _called
    _called = StartupClock(_since())
    _called.mark("imports")


def run_clock() -> StartupClock:
    """The clock of the run starting now, in the flow's body: ``flow_start`` ends here. Under a Prefect worker (no
    ``mark_flow_called``) everything before is one phase, ``imports``."""
    global _called
    clock, _called = _called or StartupClock(_since()), None
    clock.mark("flow_start" if clock.phases else "imports")
    return clock


def run_ended() -> None:
    """The next run of this process starts its clock here."""
    global _previous_run_ended
    _previous_run_ended = time.time()
