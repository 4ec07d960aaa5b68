"""Where a command's CPU goes, by kind of process: runs ``COMMAND`` (e.g. ``make test``), samples every process on
the machine every 2 s, and prints the CPU seconds each kind used (rlflow's controllers, task hosts, worker actors,
Ray's own processes, the Prefect and MLflow servers, vLLM, the test processes, ...) and how busy the machine's CPUs
were. On a machine whose CPUs are busy all the time (the 2-core CI machine under `make test`), the suite's wall time
is its CPU time over the cores: this table says which cut would shorten it.

The table is printed when the command ends, and also when this script is stopped (SIGTERM / SIGINT, as CI's time
limit does): at once, then the signal goes on to the command. A process that ends between two samples loses the CPU it
used since the last one (at most 2 s each).

    .venv/bin/python bench/cpu_by_process.py [--every 2] [--processes FILE] -- make test

``--processes FILE`` also writes one JSON line per process (pid, parent, start and last-seen time, CPU seconds, kind,
command line, and its CPU seconds so far at the samples where it used some): with the timeline tests/conftest.py
writes under ``RLFLOW_TEST_TIMELINE``, which test used what (``bench/suite_by_test.py``).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

MIN_SAMPLE_CPU_S = 0.05  # a process's CPU is recorded over time when it used this much since its last record

RAY_SYSTEM = ("gcs_server", "raylet", "dashboard", "log_monitor", "monitor.py", "runtime_env", "RuntimeEnvAgent")


def kind(cmdline: str, name: str) -> str | None:
    """The kind of process a command line is; None while it cannot tell yet (a Ray worker before its title)."""
    if "flows/ops/warm_controller.py" in cmdline:
        return "controller fork server"
    # the command (``python -m flows``, the `rlflow` script, ``-m flows.ops.cli``), or a fork server's child named after
    # it
    command = f"{cmdline} "
    if any(part in command for part in ("flows.ops.cli", " -m flows ", "bin/rlflow ")) or command.startswith("rlflow "):
        return "rlflow CLI (controller)"
    if "prefect.engine" in cmdline:
        return "deployment run (controller)"
    if cmdline.startswith("ray::"):
        title = cmdline.split()[0][len("ray::") :]
        if title == "IDLE":
            return None
        if "Dashboard" in title or "RuntimeEnv" in title:
            return "Ray's own processes"
        if "Worker" in title or "Critic" in title or "Reward" in title:
            return "Ray worker actors (rlworkers)"
        return "task host and other Ray tasks"
    if cmdline.split(" ", 1)[0].endswith(("/raylet", "/gcs_server")):  # their flags name default_worker.py
        return "Ray's own processes"
    if "default_worker.py" in cmdline:
        return None
    if any(part in cmdline for part in RAY_SYSTEM) and "ray" in cmdline:
        return "Ray's own processes"
    if "EngineCore" in name or "VLLM" in cmdline or "vllm" in cmdline.split(" ", 2)[:2]:
        return "vLLM engines"
    if "prefect" in cmdline and ("server" in cmdline or "uvicorn" in cmdline):
        return "Prefect server"
    if "prefect" in cmdline and "worker" in cmdline:
        return "Prefect workers"
    if "mlflow" in cmdline and any(part in cmdline for part in ("server", "uvicorn", "gunicorn", "huey")):
        return "MLflow server"
    if "postgres" in name or "postgres" in cmdline[:60]:
        return "PostgreSQL"
    if "chrom" in name:
        return "chromium"
    # pytest-xdist's worker processes are execnet's: ``python -u -c "import sys;exec(eval(sys.stdin.readline()))"``
    if any(part in cmdline for part in ("pytest", "execnet", "xdist", "exec(eval(sys.stdin.readline()))")):
        return "test processes (pytest)"
    if "python" in name or "python" in cmdline[:80]:
        return "other Python"
    return "other"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("--processes", help="write one JSON line per process to this file when the command ends")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure, e.g. -- make test")

    stopped: list[int] = []

    def stop(signum, _frame):
        stopped.append(signum)  # the loop ends within one sample, prints, then passes the signal on

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print_machine("before")
    before = {(p.pid, p.create_time()): sum(p.cpu_times()[:2]) for p in psutil.process_iter() if _alive(p)}
    machine_before, started = psutil.cpu_times(), time.monotonic()
    child = subprocess.Popen(command)

    used: dict[tuple[int, float], list] = {}  # (pid, start time) -> [CPU seconds, kind]
    seen: dict[tuple[int, float], dict] = {}  # (pid, start time) -> its parent, command line, last time seen
    while child.poll() is None and not stopped:
        for process in psutil.process_iter(["pid", "name", "create_time", "cpu_times"]):
            info = process.info
            if info["cpu_times"] is None:
                continue
            key = (info["pid"], info["create_time"])
            seconds = sum(info["cpu_times"][:2]) - before.get(key, 0.0)
            entry = used.setdefault(key, [0.0, None])
            entry[0] = seconds
            if args.processes:
                record = seen.setdefault(key, {"ppid": None, "cmdline": "", "samples": []})
                record["last"] = time.time()
                samples = record["samples"]  # [time, CPU seconds so far] whenever it used some since the last one
                if not samples or seconds - samples[-1][1] >= MIN_SAMPLE_CPU_S:
                    samples.append([round(record["last"], 1), round(max(seconds, 0.0), 2)])
                if not record["cmdline"] or entry[1] is None:  # a Ray worker: until its title says what it is
                    try:
                        record["ppid"], record["cmdline"] = process.ppid(), " ".join(process.cmdline())[:300]
                    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                        pass
            if entry[1] is None:  # Ray workers change their title once they know what they are
                try:
                    entry[1] = kind(" ".join(process.cmdline()), info["name"] or "")
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    pass
        time.sleep(args.every)
    print_table(used, machine_before, time.monotonic() - started)  # first: a stop may be followed by SIGKILL
    if not stopped:
        print_machine("after")
    if args.processes:
        with open(args.processes, "w") as out:
            for (pid, start), record in seen.items():
                seconds, what = used[(pid, start)]
                row = {"pid": pid, "start": start, "cpu_s": round(max(seconds, 0.0), 2), "kind": what, **record}
                out.write(json.dumps(row) + "\n")
    if stopped:
        child.send_signal(stopped[0])
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
        return 128 + stopped[0]
    return child.wait()


def _alive(process: psutil.Process) -> bool:
    try:
        process.cpu_times(), process.create_time()
        return True
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def print_machine(when: str) -> None:
    """The CPU and its speed now (bench/machine.py, in a process of its own: torch stays out of this one), so that
    suite runs on machines of the same name but of different speeds can be told apart."""
    script = Path(__file__).with_name("machine.py")
    try:
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
        said = done.stdout.strip().replace("\n", "; ") or done.stderr.strip()[-300:]
    except (OSError, subprocess.TimeoutExpired) as error:  # the figures are beside the suite, never in its way
        said = f"not measured ({error})"
    print(f"machine {when}: {said}", flush=True)


def print_table(used: dict, machine_before, wall_s: float) -> None:
    totals: dict[str, list] = {}
    for seconds, what in used.values():
        row = totals.setdefault(what or "Ray workers that never started", [0.0, 0])
        row[0] += max(seconds, 0.0)
        row[1] += 1
    machine = psutil.cpu_times()
    busy = sum(getattr(machine, f) - getattr(machine_before, f) for f in ("user", "system", "nice", "irq", "softirq"))
    cores = psutil.cpu_count() or 1
    counted = sum(seconds for seconds, _ in totals.values())
    share = busy / (wall_s * cores)
    print(f"\nCPU by kind of process over {wall_s / 60:.1f} min on {cores} CPUs ({share:.0%} busy):")
    print(f"  {busy / 60:.1f} CPU-min used on the machine, {counted / 60:.1f} of them by the processes below")
    steal = getattr(machine, "steal", 0.0) - getattr(machine_before, "steal", 0.0)
    print(f"  {steal / 60:.1f} CPU-min stolen by the host (time this machine wanted a CPU and its host ran another)")
    for what, (seconds, count) in sorted(totals.items(), key=lambda item: -item[1][0]):
        if seconds >= 1:
            print(f"  {seconds / 60:7.1f} CPU-min {seconds / max(counted, 1e-9):5.0%}  {count:5d} processes  {what}")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
