"""Slow or hung? What a worker-group call that ran past its time limit is doing, told from outside its processes.

An actor runs its calls in its process's main thread. Working, that thread computes: it is running, or waiting for a
core on a busy machine (state R), and its CPU time grows as far as it gets a core. Hung, it is stopped (SIGSTOP, a
debugger), or it sleeps on something that does not come (a deadlock, a peer that is gone: state S or D). So at the
limit the main threads of the ranks still running are watched for ``PROBE_S``: if none of them is stopped or gone
and one of them was runnable most of the time or used ``MIN_CPU_S``, the call is slow (a busy machine, a long
validation) and gets another window; otherwise it is hung. (The process as a whole is no measure: Ray's own threads
in it keep using a little CPU whatever the call does; and CPU time alone is none on a machine so busy that a working
thread gets almost no core.) The threads are read where they run: here, or on another node by a Ray task placed
there. Nothing the worker has to report, so it holds for every worker class, vLLM's engine and a tool call alike.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence

from rlworkers.single_controller.errors import WorkerProcess

logger = logging.getLogger(__name__)

PROBE_S = 5.0  # how long the late ranks are watched
STEP_S = 0.25  # how often their main threads are looked at meanwhile
MIN_RUNNABLE = 0.5  # share of the looks that found the thread running or waiting for a core
MIN_CPU_S = 0.05  # or main-thread CPU seconds over PROBE_S


def main_thread(pid: int) -> tuple[float, str] | None:
    """(CPU seconds, state letter) of the main thread of process ``pid`` on this node (Linux /proc; None: gone)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), fields[0]


def watch(pids: Sequence[int], seconds: float, pause: Callable[[float], None] = time.sleep) -> dict:
    """``{pid: (CPU seconds used, share of looks runnable, stopped or gone?)}`` of the main threads of processes on
    this node over ``seconds`` (``pause``: how to wait between looks; {} when it ended early: the calls answered)."""
    first = {pid: main_thread(pid) for pid in pids}
    runnable = dict.fromkeys(pids, 0)
    looks, started = 0, time.monotonic()
    while time.monotonic() - started < seconds:
        before = time.monotonic()
        pause(STEP_S)
        if time.monotonic() - before < STEP_S * 0.9:
            return {}
        looks += 1
        for pid in pids:
            seen = main_thread(pid)
            runnable[pid] += bool(seen and seen[1] == "R")
    last = {pid: main_thread(pid) for pid in pids}
    return {
        pid: (
            last[pid][0] - first[pid][0] if first[pid] and last[pid] else 0.0,
            runnable[pid] / max(looks, 1),
            not first[pid] or not last[pid] or last[pid][1] in "TtZX",
        )
        for pid in pids
    }


def _watch_all(processes: Sequence[WorkerProcess], pause: Callable[[float], None]) -> dict | None:
    """``watch`` of every process on its own node, keyed by (node, pid); None when the calls answered meanwhile."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    by_node: dict[str, list[int]] = {}
    for process in processes:
        by_node.setdefault(process.node_id, []).append(process.pid)
    remote = {
        node: ray.remote(watch)
        .options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
        .remote(pids, PROBE_S)
        for node, pids in by_node.items()
        if node != here
    }
    found = {}
    if here in by_node:
        local = watch(by_node[here], PROBE_S, pause)
        if not local:
            return None
        found.update({(here, pid): value for pid, value in local.items()})
    for node, ref in remote.items():
        try:
            found.update({(node, pid): value for pid, value in ray.get(ref, timeout=PROBE_S + 30).items()})
        except Exception:  # the node does not answer: its processes count as gone
            found.update({(node, pid): (0.0, 0.0, True) for pid in by_node[node]})
    return found


def still_working(
    method: str, processes: Sequence[WorkerProcess | None], pause: Callable[[float], None] = time.sleep
) -> bool:
    """Whether the late ranks of ``method`` (their ``processes``) are working: none stopped or gone, and the main
    thread of one of them runnable most of the time or using ``MIN_CPU_S`` over ``PROBE_S`` (``pause``: the caller's
    wait, which ends sooner when the ranks answer meanwhile). Takes ``PROBE_S``."""
    if not processes or any(p is None for p in processes):
        return False  # a group built from handles knows no processes: the time limit alone decides
    found = _watch_all(processes, pause)
    if found is None:
        return True  # they answered meanwhile
    seen = [found[(p.node_id, p.pid)] for p in processes]
    working = not any(stopped for _, _, stopped in seen) and any(
        cpu >= MIN_CPU_S or share >= MIN_RUNNABLE for cpu, share, _ in seen
    )
    logger.warning(
        "%r past its time limit on %d rank(s), which %s (main threads: %s)",
        method,
        len(processes),
        "are working: waiting another window" if working else "are not working: hung",
        ", ".join(f"{cpu:.2f} s of CPU, runnable {share:.0%}{', stopped' if s else ''}" for cpu, share, s in seen),
    )
    return working
