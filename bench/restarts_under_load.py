"""Crash restarts under load, with a plain Prefect worker: does every killed run come back and finish?

Queues ``--runs`` short lineage runs (GRPO on the tiny model) on ``--deployments`` deployments of the rlflow pool,
served by a plain ``prefect worker start --pool rlflow`` (not ``rlflow worker``: no backup restart loop), SIGKILLs
the flow-run processes of ``--kills`` of them at a random moment of their first attempt (as the kernel's OOM
killer would), keeps the
server's database busy with API traffic (``--load-threads`` clients reading flow runs and writing artifacts, as fast as
the server answers or ``--load-interval-s`` apart), and
waits until every run is final. It prints, per run, its final state, its crashes and restarts and the seconds from
each Crashed to its restart, and what the Prefect server logged about dead letters and its database.

It measures the servers the environment points at (``PREFECT_API_URL``, ``MLFLOW_TRACKING_URI``), e.g. a pair on
PostgreSQL (``rlflow server up --postgres postgresql://...``) or the SQLite default (``rlflow server up``)::

    source .rlflow/env.sh
    .venv/bin/python bench/restarts_under_load.py --runs 20 --deployments 4 --kills 8

It creates the pool, the deployments ``grpo/load-<tag>-<i>`` (lineages ``load-<tag>-<i>``) and rlflow's automations in
that server, and starts and stops its own worker. Give it the server's log (``--server-log``, default
``.rlflow/logs/prefect.log``) to count dead letters. Takes ~15 minutes for 20 runs on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flows.config import RLConfig  # noqa: E402
from flows.lineages.lineage import RESTART_STATE_NAME  # noqa: E402
from flows.ops.deploy import POOL, TAG, deploy_all, ensure_automations, ensure_work_pool  # noqa: E402

FINAL = {"COMPLETED", "FAILED", "CANCELLED"}


def job(lineage: str, runs_dir: str) -> dict:
    """A short lineage run: 6 GRPO steps on the tiny model, a checkpoint every 2, one worker."""
    config = {
        "trainer": {"lineage": lineage, "runs_dir": runs_dir, "total_steps": 6, "save_freq": 2, "test_freq": 0,
                    "n_workers": 1, "ray_num_cpus": 2, "log_samples": 0},
        "data": {"train_batch_size": 8, "val_batch_size": 64},
        "rollout": {"n": 2, "response_length": 4},
        "actor": {"ppo_mini_batch_size": 16, "ppo_micro_batch_size_per_gpu": 16},
    }  # fmt: skip
    RLConfig.model_validate(config)  # fails here, not in the worker
    return config


def write_deployments(folder: Path, names: list[str], tag: str, runs_dir: str) -> Path:
    """A prefect.yaml like deployments/prefect.yaml: same pool, pull step, tags and no-overlap limit."""
    spec = {
        "name": "rlflow-load",
        "pull": [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $RLFLOW_PROJECT_DIR }}"}}],
        "deployments": [
            {
                "name": name,
                "entrypoint": "flows/grpo.py:grpo",
                "work_pool": {
                    "name": POOL,
                    "job_variables": {
                        "env": {
                            "PREFECT_API_URL": os.environ["PREFECT_API_URL"],
                            "MLFLOW_TRACKING_URI": os.environ["MLFLOW_TRACKING_URI"],
                            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30",
                        }
                    },
                },
                "tags": [TAG, "load"],
                "concurrency_limit": {"limit": 1, "collision_strategy": "ENQUEUE"},
                "parameters": {"config": job(f"load-{tag}-{i}", runs_dir)},
            }
            for i, name in enumerate(names)
        ],
    }
    path = folder / "prefect.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def flow_run_processes() -> dict[str, psutil.Process]:
    """flow run id -> its process (the process worker starts each with PREFECT__FLOW_RUN_ID in its environment)."""
    found = {}
    for process in psutil.process_iter(["cmdline"]):
        try:
            run_id = process.environ().get("PREFECT__FLOW_RUN_ID")
            if run_id and "prefect.engine" in " ".join(process.info["cmdline"] or []):
                found[run_id] = process
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def keep_database_busy(stop: threading.Event, counts: dict, interval_s: float) -> None:
    """API traffic beside the runs: list flow runs, write an artifact, again and again (``interval_s`` apart)."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        while not stop.is_set():
            try:
                client.read_flow_runs(limit=200)
                create_markdown_artifact(markdown=f"load {uuid.uuid4().hex}", key="load-traffic")
                counts["requests"] += 2
            except Exception as error:  # what a busy server answers is part of the measurement
                counts["errors"] += 1
                counts["last_error"] = repr(error)[:200]
            stop.wait(interval_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--deployments", type=int, default=4)
    parser.add_argument("--kills", type=int, default=8, help="runs whose first attempt is killed")
    parser.add_argument(
        "--kill-after-s", type=float, nargs=2, default=(5.0, 40.0), help="a target is killed this long into its run"
    )
    parser.add_argument("--runs-dir", default=str(ROOT / "runs"), help="trainer.runs_dir of the runs")
    parser.add_argument("--limit", type=int, default=2, help="flow runs at once (the worker's --limit)")
    parser.add_argument("--load-threads", type=int, default=2)
    parser.add_argument(
        "--load-interval-s", type=float, default=0.0, help="pause between a load thread's request pairs (0: none)"
    )
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-log", default=str(ROOT / ".rlflow" / "logs" / "prefect.log"))
    parser.add_argument("--out", default=None, help="write the per-run results here (JSON)")
    args = parser.parse_args()

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.deployments import run_deployment

    rng = random.Random(args.seed)
    tag = uuid.uuid4().hex[:4]
    names = [f"load-{tag}-{i}" for i in range(args.deployments)]
    log_start = Path(args.server_log).stat().st_size if Path(args.server_log).exists() else 0
    ensure_work_pool()
    with tempfile.TemporaryDirectory() as folder:
        deploy_all(write_deployments(Path(folder), names, tag, args.runs_dir))
    ensure_automations()
    worker = subprocess.Popen(
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--type", "process",
         "--limit", str(args.limit)],
        cwd=ROOT, stdout=open(Path(tempfile.gettempdir()) / f"load-worker-{tag}.log", "w"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    started = time.monotonic()
    run_ids = []
    for i in range(args.runs):
        flow_run = run_deployment(f"grpo/{names[i % args.deployments]}", timeout=0)
        run_ids.append(str(flow_run.id))
    print(f"{args.runs} runs queued on {args.deployments} deployments; worker limit {args.limit}", flush=True)

    stop, counts = threading.Event(), {"requests": 0, "errors": 0}
    load = [
        threading.Thread(target=keep_database_busy, args=(stop, counts, args.load_interval_s), daemon=True)
        for _ in range(args.load_threads)
    ]
    for thread in load:
        thread.start()
    killed: dict[str, float] = {}  # run id -> when
    targets: dict[str, float] = {}  # run id -> when to kill it: a random moment of its first attempt
    states = {}
    try:
        with get_client(sync_client=True) as client:
            while time.monotonic() - started < args.timeout_s:
                runs = client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=run_ids)), limit=len(run_ids)
                )
                states = {str(r.id): r for r in runs}
                if all(r.state_type.value in FINAL for r in runs) and len(runs) == len(run_ids):
                    break
                processes = flow_run_processes()
                now = time.monotonic()
                for run_id in list(targets):  # a target that ended before its moment: another run takes its place
                    if run_id not in killed and states[run_id].state_type.value != "RUNNING":
                        del targets[run_id]
                for run_id, process in processes.items():
                    running = run_id in states and states[run_id].state_type.value == "RUNNING"
                    if running and run_id not in targets and len(targets) < args.kills:
                        targets[run_id] = now + rng.uniform(args.kill_after_s[0], args.kill_after_s[1])
                    if running and run_id not in killed and targets.get(run_id, float("inf")) <= now:
                        process.send_signal(signal.SIGKILL)
                        killed[run_id] = time.time()
                        print(f"{now - started:6.0f} s  SIGKILL {states[run_id].name} (pid {process.pid})", flush=True)
                time.sleep(1)
            report = []
            for run_id in run_ids:
                history = sorted(client.read_flow_run_states(run_id), key=lambda s: s.timestamp)
                crashes = [s for s in history if s.type.value == "CRASHED"]
                restarts = [s for s in history if s.name == RESTART_STATE_NAME]
                delays = []
                for crash in crashes:
                    after = [s for s in restarts if s.timestamp >= crash.timestamp]
                    delays.append(round((after[0].timestamp - crash.timestamp).total_seconds(), 1) if after else None)
                who = sorted({("worker" if "rlflow worker" in (s.message or "") else "automation") for s in restarts})
                report.append(
                    {
                        "run": states[run_id].name,
                        "deployment": names[run_ids.index(run_id) % args.deployments],
                        "final": states[run_id].state_type.value,
                        "message": (states[run_id].state.message or "")[:120],
                        "killed": run_id in killed,
                        "crashes": len(crashes),
                        "restarts": len(restarts),
                        "crash_to_restart_s": delays,
                        "restarted_by": who,
                    }
                )
    finally:
        stop.set()
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:  # Prefect's worker can take minutes to wind down: not measured here
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(30)
    elapsed = time.monotonic() - started
    for row in report:
        print(json.dumps(row))
    server_log = (
        Path(args.server_log).read_bytes()[log_start:].decode(errors="replace")
        if Path(args.server_log).exists()
        else ""
    )
    lines = server_log.splitlines()
    dead = [line for line in lines if "dead" in line.lower() and "letter" in line.lower()]
    locked = [line for line in lines if "database is locked" in line]
    final = [row["final"] for row in report]
    killed_rows = [row for row in report if row["killed"]]
    delays = [d for row in report for d in row["crash_to_restart_s"] if d is not None]
    summary = {
        "runs": len(report),
        "completed": final.count("COMPLETED"),
        "failed": final.count("FAILED"),
        "not_final": sum(f not in FINAL for f in final),
        "killed": len(killed_rows),
        "killed_then_completed": sum(row["final"] == "COMPLETED" for row in killed_rows),
        "crashes_never_restarted": sum(d is None for row in report for d in row["crash_to_restart_s"]),
        "crash_to_restart_s": {"min": min(delays, default=None), "max": max(delays, default=None)},
        "dead_letters_in_server_log": len(dead),
        "database_locked_in_server_log": len(locked),
        "load_requests": counts["requests"],
        "load_errors": counts["errors"],
        "wall_s": round(elapsed),
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "runs": report}, indent=1))


if __name__ == "__main__":
    main()
