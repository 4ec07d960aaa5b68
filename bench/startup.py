"""A run's fixed cost: `rlflow train` of a 2-step tiny job, with the servers up, from the command to its exit, and
where that time goes (the run's own ``timing_s/startup/*`` metrics, flows/controller/startup.py; its steps;
``timing_s/publish``; the rest is the shutdown: workers released, the MLflow run closed, Ray stopped, the process's
exit).

Each job runs ``--repeat`` times in a Ray of its own (the baseline: no local Ray given, the command in a process of
its own), then, after one run that starts the processes, ``--repeat`` times in the local Ray of `rlflow server up`
(flows/plumbing/kept.py: each run takes the worker processes and task host the run before kept) with the command in its
own process (``RLFLOW_CONTROLLER=``), and ``--repeat`` times so in a child of the controller fork server of `rlflow
server up` (flows/plumbing/forkserver.py: everything imported); the median of each phase is printed with its share of
the median wall time, with the CPU seconds the machine was busy (run it on an otherwise idle machine), and the ratios
to the baseline. ``--source DIR`` runs the `rlflow` of another checkout of the code (e.g. a `git
worktree` of an older commit) with this environment, for a before/after in one sitting: a checkout without the
startup metrics shows its wall time only. The CPU's capability is printed beside the figures (they depend on it).

    .venv/bin/python bench/startup.py [--jobs sft,grpo] [--repeat 3] [--source DIR]

``--in-process``: the runs of a process whose Ray outlives them (a notebook, a sweep, the tests), one after another
in this process, every other one after ``flows.controller.groups.end_kept_groups()``: it prints, for the runs that built
their workers in the processes the run before kept and for those that started new ones, the median wall time, the
``worker_groups`` phase and the CPU seconds the whole process tree used, and their ratios (kept / new).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_description, machine_cpu_s, machine_speed  # noqa: E402 (after ROOT joins the path)
from flows.ops.services import free_port  # noqa: E402

JOBS = {
    "sft": ["sft", "--config", "demo-sft", "trainer.total_steps=2"],
    "grpo": ["grpo", "--config", "demo", "trainer.total_steps=2"],
}


def run_once(job: str, runs_dir: Path, source: Path, env: dict) -> dict[str, float]:
    name = f"startup-{job}-{uuid.uuid4().hex[:6]}"
    rlflow = ["-m", "flows"] if (source / "flows" / "__main__.py").exists() else ["-m", "flows.cli"]  # (older code)
    command = [sys.executable, *rlflow, "train", *JOBS[job]]
    command += [f"trainer.runs_dir={runs_dir}", f"trainer.run_name={name}"]
    cpu, start = machine_cpu_s(), time.perf_counter()
    done = subprocess.run(command, cwd=source, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return {"wall": wall, "cpu": machine_cpu_s() - cpu, **phases_of(name)}


def phases_of(run_name: str) -> dict[str, float]:
    """The run's start-up phases, its steps and its publishing, from its MLflow run (empty for code without them)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    experiments = [e.experiment_id for e in client.search_experiments()]
    found = client.search_runs(experiments, filter_string=f"tags.`rlflow.run_name` = '{run_name}'")
    if not found:
        return {}
    run = found[0]
    metrics = run.data.metrics
    phases = {k.removeprefix("timing_s/startup/"): v for k, v in metrics.items() if k.startswith("timing_s/startup/")}
    if not phases:
        return {}
    steps = client.get_metric_history(run.info.run_id, "timing_s/step")
    phases["steps"] = sum(m.value for m in steps)
    phases["publish"] = metrics.get("timing_s/publish", 0.0)
    return phases


def tree_cpu_s() -> float:
    """CPU seconds used so far by this process and every process under it, the exited ones included (a parent's
    ``children_*`` times hold its waited-for children's: Ray's raylet reaps the workers it started)."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def run_in_process(job: str, runs_dir: Path, end_kept_first: bool) -> dict[str, float]:
    from flows.config import load_config
    from flows.controller.groups import end_kept_groups, ray_task_runner
    from flows.controller.startup import mark_flow_called
    from flows.launch import get_flow

    if end_kept_first:
        end_kept_groups()
    algorithm, _, preset, *overrides = JOBS[job]
    name = f"startup-{job}-{uuid.uuid4().hex[:6]}"
    config = load_config(preset, [*overrides, f"trainer.runs_dir={runs_dir}", f"trainer.run_name={name}"])
    cpu, start = tree_cpu_s(), time.perf_counter()
    mark_flow_called()
    state = get_flow(algorithm).with_options(task_runner=ray_task_runner())(config=config, return_state=True)
    wall = time.perf_counter() - start
    if not state.is_completed():
        raise SystemExit(f"the {job} run failed: {state.message}")
    return {"wall": wall, "cpu": tree_cpu_s() - cpu, **phases_of(name)}


def report_in_process(job: str, results: list[tuple[bool, dict[str, float]]]) -> None:
    print(
        f"\n{' '.join(JOBS[job])} in this process, one run after another ({len(results)} runs, the first one left out)"
    )
    rows = {}
    for kept, label in ((True, "kept workers"), (False, "new workers")):
        runs = [r for k, r in results[1:] if k == kept]
        rows[label] = {
            key: statistics.median(r.get(key, 0.0) for r in runs) for key in ("wall", "worker_groups", "cpu")
        }
        print(
            f"  {label:<13} wall {rows[label]['wall']:6.1f} s   worker_groups {rows[label]['worker_groups']:6.1f} s   "
            f"CPU {rows[label]['cpu']:6.1f} s   (median of {len(runs)})"
        )
    kept, new = rows["kept workers"], rows["new workers"]
    ratios = ", ".join(f"{key} {kept[key] / new[key]:.2f}" for key in ("wall", "worker_groups", "cpu") if new[key])
    print(f"  kept / new: {ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", default="sft,grpo", help=f"comma-separated, of {', '.join(JOBS)}")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--source", type=Path, default=ROOT, help="the checkout whose rlflow runs (default: this)")
    parser.add_argument("--in-process", action="store_true", help="runs in this process: kept vs new workers")
    args = parser.parse_args()

    from flows.ops.preflight import apply_service_env
    from flows.ops.services import CONTROLLER, LOCAL_RAY, ServiceConfig, start_services, stop_services
    from flows.plumbing.servers import http_ok

    print(f"CPU: {cpu_description()}; {machine_speed()}")
    source = args.source.resolve()
    # the servers (the controller fork server among them) start from the commands' environment
    os.environ["PYTHONPATH"] = str(source)
    with tempfile.TemporaryDirectory(prefix="rlflow-startup-") as tmp:
        config = ServiceConfig(
            state_dir=Path(tmp) / "home", prefect_port=free_port(), mlflow_port=free_port(), ray_port=free_port()
        )
        urls = start_services(config)
        try:
            apply_service_env(urls)
            if args.in_process:
                import ray

                from flows.controller.groups import ray_settings

                _, init_kwargs = ray_settings(None, None)
                ray.init(address="local", **init_kwargs)
                for job in args.jobs.split(","):  # new, then kept and new in turn: the first pays the imports
                    flags = [True, *[i % 2 == 1 for i in range(2 * args.repeat)]]
                    results = [(kept, run_in_process(job, Path(tmp) / "runs", not kept)) for kept in flags]
                    report_in_process(job, results)
                return
            runs = Path(tmp) / "runs"
            forked = dict(os.environ)  # apply_service_env set the servers' URLs, the local Ray's, the fork server's
            own_process = {**forked, CONTROLLER: ""}
            own_ray = {k: v for k, v in own_process.items() if k != LOCAL_RAY}
            deadline = time.monotonic() + 600
            while not http_ok(f"unix://{urls[CONTROLLER]}") and time.monotonic() < deadline:
                time.sleep(1)  # the fork server imports everything first
            for job in args.jobs.split(","):
                own = [run_once(job, runs, source, own_ray) for _ in range(args.repeat)]
                report(job, own, source, "a Ray of its own (none given)")
                run_once(job, runs, source, own_process)  # starts the processes the next runs take: left out
                local = [run_once(job, runs, source, own_process) for _ in range(args.repeat)]
                report(job, local, source, "the local Ray of `rlflow server up`, in the processes the last run kept")
                in_child = [run_once(job, runs, source, forked) for _ in range(args.repeat)]
                report(job, in_child, source, "the same, the command forked by the controller fork server")
                baseline = {key: statistics.median(r[key] for r in own) for key in ("wall", "cpu")}
                for label, results in (("local Ray", local), ("and forked", in_child)):
                    ratios = ", ".join(
                        f"{key} {statistics.median(r[key] for r in results) / baseline[key]:.2f}" for key in baseline
                    )
                    print(f"  {label} / own Ray: {ratios}")
        finally:
            stop_services(config)


def report(job: str, results: list[dict[str, float]], source: Path, where: str) -> None:
    wall = statistics.median(r["wall"] for r in results)
    cpu = statistics.median(r["cpu"] for r in results)
    print(f"\n`rlflow train {' '.join(JOBS[job])}` ({source}) in {where}: {wall:.1f} s median of {len(results)}")
    print("  walls: " + ", ".join(f"{r['wall']:.1f}" for r in results) + f"; machine CPU {cpu:.1f} s")
    names = [k for k in results[0] if k not in ("wall", "cpu")]
    if not names:
        print("  (no timing_s/startup metrics: code from before flows/controller/startup.py)")
        return
    medians = {name: statistics.median(r.get(name, 0.0) for r in results) for name in names}
    medians["shutdown and the rest"] = max(0.0, wall - sum(medians.values()))
    for name, seconds in medians.items():
        print(f"  {name:<22} {seconds:6.1f} s  {100 * seconds / wall:5.1f}%")


if __name__ == "__main__":
    main()
