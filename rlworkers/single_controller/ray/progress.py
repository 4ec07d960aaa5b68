"""Slow or hung? What a worker-group call that ran past its time limit is doing, told from outside its processes.

A rank that is still working burns CPU time; a hung one does not: a stopped process (SIGSTOP, a debugger), a
deadlock, a wait for a peer that is gone. So at the limit the ranks still running are watched for ``PROBE_S``: if
none of them is stopped and one of them used at least ``MIN_CPU_SHARE`` of a core meanwhile, the call is slow (a
busy machine, a long validation) and gets another window; otherwise it is hung. The CPU time is read where the
process runs: here with psutil, on another node by a Ray task placed there. Nothing the worker has to report, so it
holds for every worker class, vLLM's engine and a tool call alike.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from rlworkers.single_controller.errors import WorkerProcess

logger = logging.getLogger(__name__)

PROBE_S = 5.0  # how long the late ranks are watched
MIN_CPU_SHARE = 0.05  # of one core, over PROBE_S: a process that gets less than this is not working


def cpu_seconds(pids: Sequence[int]) -> dict[int, tuple[float, bool] | None]:
    """``{pid: (CPU seconds so far, stopped?)}`` of processes on this node (None: gone)."""
    import psutil

    found: dict[int, tuple[float, bool] | None] = {}
    for pid in pids:
        try:
            process = psutil.Process(pid)
            times, status = process.cpu_times(), process.status()
            found[pid] = (times.user + times.system, status in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE))
        except psutil.Error:
            found[pid] = None
    return found


def _sample(processes: Sequence[WorkerProcess]) -> list[tuple[float, bool] | None]:
    """``cpu_seconds`` of each process, read on its own node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    by_node: dict[str, list[int]] = {}
    for process in processes:
        by_node.setdefault(process.node_id, []).append(process.pid)
    found: dict[tuple[str, int], tuple[float, bool] | None] = {}
    remote = {
        node: ray.remote(cpu_seconds)
        .options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
        .remote(pids)
        for node, pids in by_node.items()
        if node != here
    }
    for node, pids in by_node.items():
        if node == here:
            found.update({(node, pid): value for pid, value in cpu_seconds(pids).items()})
    for node, ref in remote.items():
        try:
            found.update({(node, pid): value for pid, value in ray.get(ref, timeout=30).items()})
        except Exception:  # the node does not answer: its processes count as gone
            found.update({(node, pid): None for pid in by_node[node]})
    return [found[(p.node_id, p.pid)] for p in processes]


def still_working(method: str, processes: Sequence[WorkerProcess | None]) -> bool:
    """Whether the late ranks of ``method`` (their ``processes``) are working: none stopped or gone, and one of
    them used at least ``MIN_CPU_SHARE`` of a core over ``PROBE_S``. Takes ``PROBE_S``."""
    if not processes or any(p is None for p in processes):
        return False  # a group built from handles knows no processes: the time limit alone decides
    before = _sample(processes)
    time.sleep(PROBE_S)
    after = _sample(processes)
    if any(s is None or s[1] for s in before + after):
        return False
    used = max(b[0] - a[0] for a, b in zip(before, after))
    working = used >= MIN_CPU_SHARE * PROBE_S
    logger.warning(
        "%r past its time limit on %d rank(s), which %s (%.1f s of CPU in %.0f s)",
        method,
        len(processes),
        "are working: waiting another window" if working else "are not working: hung",
        used,
        PROBE_S,
    )
    return working
