"""Which test used the suite's CPU, and on what: joins the processes ``bench/cpu_by_process.py --processes`` recorded
with the tests' timeline tests/conftest.py writes under ``RLFLOW_TEST_TIMELINE``, and prints each module's and the
costliest tests' CPU seconds by kind of process and how many processes of each kind they started.

CPU is counted when it was used (each process's record has its CPU over time): a process's CPU between two of its
samples is the test's that was running then in the pytest process it descends from (a command a test ran, a Ray
the test process started and its workers; the pytest process's own: the flows a test runs in it). A process that
descends from no test process, or from a `ray start --head` (the session's local Ray, whose kept workers both pytest
processes' runs use; a test's cluster), shares it between the tests running then, one share each; CPU used while
no test ran (the session's start, its end) is "(between tests)". A process is counted as started by the test that
was running, in the same way, when it started. (Records without samples count a process's whole CPU at its start.)

    RLFLOW_TEST_TIMELINE=/tmp/tests.jsonl .venv/bin/python bench/cpu_by_process.py --processes /tmp/processes.jsonl \\
        -- make test
    .venv/bin/python bench/suite_by_test.py /tmp/tests.jsonl /tmp/processes.jsonl
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
from pathlib import Path

SHORT = {
    "Ray worker actors (rlworkers)": "workers",
    "task host and other Ray tasks": "hosts",
    "Ray's own processes": "ray",
    "rlflow CLI (controller)": "cli",
    "deployment run (controller)": "deploy",
    "Ray workers that never started": "idle-ray",
    "test processes (pytest)": "pytest",
}


def load(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def attribute(tests: list[dict], processes: list[dict]) -> tuple[dict, dict]:
    """Per test: CPU seconds by kind of process (and ``(wall s)``, the test's own time), and processes started."""
    test_pids = {test["pid"] for test in tests}
    parent = {p["pid"]: p["ppid"] for p in processes}  # pids are not reused within a suite's hour, near enough
    command = {p["pid"]: p["cmdline"] for p in processes}
    by_pid = collections.defaultdict(list)  # pytest process -> its tests, in time order
    for test in sorted(tests, key=lambda t: t["start"]):
        by_pid[test["pid"]].append(test)
    starts = {pid: [t["start"] for t in runs] for pid, runs in by_pid.items()}

    def running(pid: int, at: float) -> dict | None:
        index = bisect.bisect_right(starts[pid], at) - 1
        return by_pid[pid][index] if index >= 0 and at <= by_pid[pid][index]["end"] + 1 else None

    def test_process_of(pid: int) -> int | None:
        for _ in range(50):
            pid = parent.get(pid)
            if pid is None or pid in test_pids:
                return pid
            if " start --head" in command.get(pid, ""):
                return None  # a Ray every test running then may use: the session's local Ray, a test's cluster
        return None

    def tests_at(owner: int | None, at: float) -> list[str]:
        found = [running(owner, at)] if owner else [running(pid, at) for pid in by_pid]
        return [test["test"] for test in found if test]

    cpu = collections.defaultdict(collections.Counter)
    started = collections.defaultdict(collections.Counter)
    for process in processes:
        kind = SHORT.get(process["kind"] or "Ray workers that never started", process["kind"])
        owner = process["pid"] if process["pid"] in test_pids else test_process_of(process["pid"])
        samples = process.get("samples") or [[process["start"], process["cpu_s"]]]
        before = 0.0
        for at, seconds in samples:
            owners = tests_at(owner, at) or ["(between tests)"]
            for test in owners:
                cpu[test][kind] += (seconds - before) / len(owners)
            before = seconds
        if process["pid"] in test_pids:
            continue
        owners = tests_at(owner, process["start"])
        for test in owners:
            started[test][kind] += 1 / len(owners)
    for test in tests:
        cpu[test["test"]]["(wall s)"] += test["end"] - test["start"]
    return cpu, started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timeline")
    parser.add_argument("processes")
    parser.add_argument("--top", type=int, default=25, help="how many of the costliest tests to list")
    args = parser.parse_args()

    cpu, started = attribute(load(args.timeline), load(args.processes))

    modules = collections.defaultdict(collections.Counter)
    module_started = collections.defaultdict(collections.Counter)
    for test, kinds in cpu.items():
        modules[test.split("::")[0]].update(kinds)
        module_started[test.split("::")[0]].update(started[test])
    kinds = ["pytest", "workers", "hosts", "ray", "cli", "deploy", "idle-ray"]

    def row(name: str, used: collections.Counter, count: collections.Counter) -> str:
        total = sum(v for k, v in used.items() if k != "(wall s)")
        cells = "".join(f"{used[k]:7.0f}/{count[k]:<4.0f}" for k in kinds)
        return f"{used['(wall s)']:7.0f} {total:7.0f} {cells}  {name}"

    header = f"{'wall s':>7} {'CPU s':>7} " + "".join(f"{k + ' s/n':>12}" for k in kinds)
    print("By module (CPU seconds its tests used, by kind of process / how many processes they started):")
    print(header)
    order = sorted(modules, key=lambda m: -sum(v for k, v in modules[m].items() if k != "(wall s)"))
    for module in order:
        print(row(module, modules[module], module_started[module]))
    print(f"\nThe {args.top} costliest tests:")
    print(header)
    order = sorted(cpu, key=lambda t: -sum(v for k, v in cpu[t].items() if k != "(wall s)"))
    for test in order[: args.top]:
        print(row(test, cpu[test], started[test]))


if __name__ == "__main__":
    main()
