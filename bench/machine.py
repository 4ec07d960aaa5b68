"""What the machine a bench ran on is, and how fast it was then, for the figures printed beside it.

The same CPU model (``lscpu``'s name and flags) has run the same work up to 2x apart on different days: a virtual
machine's host shares its cores, and the time a neighbour takes can be counted as this machine's CPU time rather
than as steal. ``cpu_description`` names the CPU; ``machine_speed`` measures it now, on one thread, so that two runs
of a bench (or of the suite) can be compared: a dense float32 matrix product (what training and generation are made
of) and a plain Python loop (what the controllers, servers and test processes are made of).
"""

from __future__ import annotations

import os
import platform
import time


def cpu_description() -> str:
    import torch

    from rlworkers.workers.common import cpu_bf16_features

    name = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    native = " and ".join(cpu_bf16_features()) or "no native bf16"
    return f"{name}, {os.cpu_count()} logical CPUs, torch {torch.backends.cpu.get_cpu_capability()}, {native}"


def machine_cpu_s() -> float:
    """CPU seconds the whole machine has been busy (every process: a run's own Ray is not under this process once
    the run's process exited, the local Ray's processes are): a figure for an otherwise idle machine."""
    import psutil

    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0) - getattr(times, "steal", 0.0)


def machine_speed(repeats: int = 5) -> str:
    """One thread's speed now: float32 GEMM GFLOPS (1024 x 1024) and the seconds of a 5M-step Python loop, the best
    of ``repeats`` each (the best is the machine, the rest is what else ran meanwhile)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        torch.mm(a, b)
        gemm_s = min(_timed(lambda: torch.mm(a, b)) for _ in range(repeats))
    finally:
        torch.set_num_threads(threads)
    loop_s = min(_timed(_python_loop) for _ in range(repeats))
    return f"1-thread float32 GEMM {2 * 1024**3 / gemm_s / 1e9:.0f} GFLOPS, 5M-step Python loop {loop_s:.2f} s"


def _python_loop() -> int:
    total = 0
    for i in range(5_000_000):
        total += i
    return total


def _timed(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


if __name__ == "__main__":
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    print(f"CPU: {cpu_description()}")
    print(f"speed: {machine_speed()}")
