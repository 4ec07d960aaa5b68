"""Scheduling as a user runs it: `rlflow deploy` on a real Prefect server, a real process worker (`rlflow worker`),
deployment runs triggered through the Prefect API, in the servers' local Ray; the tests run against the session's
servers (SQLite), and where the database makes a difference (the heartbeat automation) again on the PostgreSQL servers
of tests/test_topology.py (the worker's own restart and the manual approval on SQLite only, see below).

- two triggers of a lineage deployment, the first paused for manual approval longer than its lock's lease renewal:
  the second waits for the first (the lineage's lock, flows/lineages/run_lock.py), then starts from the first run's
  approved model and continues its data;
- SIGKILL of the flow-run process mid-run (as the OOM killer would) while the restart automation is disabled (as
  when the server drops its evaluation): the run is marked Crashed, `rlflow worker` starts a new attempt without
  any command, it resumes from the last checkpoint and ends Completed with the same weights as an uninterrupted
  run; no process of the dead attempt survives;
- the worker and its flow run die together: the heartbeat automation marks the run Crashed, the restart
  automation sets it "Restarting", and past trainer.max_crash_restarts the attempt ends Failed saying why.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch
from faults import alive
from mlflow.tracking import MlflowClient
from rlflow_cli import local_ray_workers
from safetensors.torch import load_file

from flows.config import flatten
from flows.lineages.lineage import RunRecord, read_result
from rlworkers.models.tiny import ensure_tiny_model

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


class Worker:
    """`rlflow worker` as a background process in its own session (so it can be killed with its children)."""

    def __init__(self, env: dict, log: Path):
        self.env, self.log = env, log
        self.process = None

    def start(self) -> None:
        with open(self.log, "a") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "flows", "worker"],
                env=self.env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self, sig: int = signal.SIGTERM) -> None:
        os.killpg(self.process.pid, sig)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


@contextlib.contextmanager
def deployment_worker(servers: dict, home: Path):
    """`rlflow deploy` to ``servers`` and an `rlflow worker` serving their pool, as the dict the tests read: the tiny
    model, the runs folder, the worker's log and process (the caller points this process's clients at ``servers``).
    Also tests/test_topology.py's, on PostgreSQL."""
    # the deployment runs join the servers' local Ray (`rlflow server up` beside `rlflow worker`, as a user runs them):
    # each run trains in the worker processes the run before kept, and a killed run's are ended by the registry
    env = {
        **os.environ,
        "PREFECT_API_URL": servers["PREFECT_API_URL"],
        "MLFLOW_TRACKING_URI": servers["MLFLOW_TRACKING_URI"],
        "RLFLOW_LOCAL_RAY": servers["RLFLOW_LOCAL_RAY"],
        "PYTHONPATH": str(ROOT),
        "PREFECT_WORKER_QUERY_SECONDS": "2",  # an operator's setting (default 10 s): runs start sooner after a trigger
    }
    deployed = subprocess.run(
        [sys.executable, "-m", "flows", "deploy"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    assert "rlflow: restart crashed runs" in deployed.stdout
    process = Worker(env, home / "worker.log")
    process.start()
    try:
        yield {
            "model": str(ensure_tiny_model(home / "tiny")),
            "runs": str(home / "runs"),
            "log": home / "worker.log",
            "process": process,
            "servers": servers,
        }
    finally:
        process.stop()


@pytest.fixture(scope="module")
def worker(services, tmp_path_factory):
    with deployment_worker(services, tmp_path_factory.mktemp("schedule")) as found:
        yield found


def sft_params(worker, **trainer):
    return {
        "config": {
            "model": {"path": worker["model"]},
            "data": {"train_batch_size": 16, "val_batch_size": 8},
            "actor": {"ppo_mini_batch_size": 16, "ppo_micro_batch_size_per_gpu": 8, "optim": {"lr": 1.0e-3}},
            "trainer": {"runs_dir": worker["runs"], "test_freq": 0, "log_samples": 0, **trainer},
        }
    }


def trigger(parameters: dict):
    from prefect.deployments import run_deployment

    return run_deployment("sft/weekly-sft", parameters=parameters, timeout=0)


def read_flow_run(flow_run_id):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id)


def wait_final(flow_run_id, worker, timeout_s: float = 420):
    """The flow run once it is final (Crashed is not: the automation restarts it). On a timeout the error shows
    the run's state history (what the automations did) and the worker's log (what the worker did)."""
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        flow_run = read_flow_run(flow_run_id)
        if flow_run.state.is_final() and flow_run.state.type.value != "CRASHED":
            return flow_run
        time.sleep(2)
    with get_client(sync_client=True) as client:
        states = sorted(client.read_flow_run_states(flow_run_id), key=lambda state: state.timestamp)
    history = "\n".join(
        f"  {s.timestamp:%H:%M:%S.%f} {s.type.value} {s.name!r}: {(s.message or '')[:150]}" for s in states
    )
    raise AssertionError(
        f"flow run {flow_run_id} not final after {timeout_s} s: {flow_run.state}\n"
        f"state history:\n{history}\nworker log:\n{Path(worker['log']).read_text()[-4000:]}"
    )


# On SQLite: the pause, the lease and the resume are the same API calls on both databases, and a lineage on
# PostgreSQL is tests/test_topology.py's, as is the heartbeat automation there (the last test's, run on both).
def test_a_lineage_trains_one_run_at_a_time_through_a_manual_approval(worker):
    """The deployment's run of a lineage pauses for a person's approval (trainer.promotion=manual) and is left
    paused longer than its lock's lease renewal period; `rlflow train` of the same lineage meanwhile waits instead of
    training. Approved through the API (what the UI's form sends), the first ends Completed and v1 is the champion;
    the second then starts from v1 and continues the data. (With a deployment concurrency limit, Prefect released
    the slot at the pause and the paused run was ended Crashed when its lease renewal failed.)"""
    from prefect.client.orchestration import get_client
    from rlflow_cli import rlflow_in_background

    from flows.lineages.run_lock import LEASE_S

    lineage = f"sched-{uuid.uuid4().hex[:6]}"
    params = sft_params(worker, lineage=lineage, total_steps=2, save_freq=2, promotion="manual")
    first = trigger(params)
    deadline = time.monotonic() + 420
    while not read_flow_run(first.id).state.is_paused():
        assert time.monotonic() < deadline and not read_flow_run(first.id).state.is_final(), read_flow_run(first.id)
        time.sleep(1)
    overrides = [f"{key}={value}" for key, value in flatten(params["config"]).items() if key != "trainer.promotion"]
    env = {key: worker["servers"][key] for key in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    second = rlflow_in_background("train", "sft", *overrides, env=env)
    try:
        time.sleep(LEASE_S + 10)  # past the lease's renewal period (and its length): the paused run must keep it
        assert read_flow_run(first.id).state.is_paused(), read_flow_run(first.id).state
        assert second.poll() is None and len(list(Path(worker["runs"]).glob(f"{lineage}-*"))) == 1  # waiting
        with get_client(sync_client=True) as client:
            client.resume_flow_run(first.id, run_input={"approve": True, "comment": "looked at it"})
        output, _ = second.communicate(timeout=420)
    finally:
        second.kill()
    assert second.returncode == 0, output[-3000:]
    assert f"another run of lineage '{lineage}' is running" in output  # it said why it waited
    first = wait_final(first.id, worker)
    assert first.state.is_completed(), first.state
    (second_name,) = [p.name for p in Path(worker["runs"]).glob(f"{lineage}-*") if p.name != first.name]

    record_one, record_two = (RunRecord.read(f"{worker['runs']}/{name}") for name in (first.name, second_name))
    assert record_one.model_uri == worker["model"]
    assert record_two.model_uri == f"models:/{lineage}/1" and record_two.parent_run_id == record_one.mlflow_run_id
    assert read_result(f"{worker['runs']}/{second_name}")["data_cursor"]["position"] == 4  # batches 3 and 4
    client = MlflowClient()
    one = client.get_model_version(lineage, "1")
    assert one.tags["rlflow.promoted"].startswith("approved by a person: looked at it")
    runs = [client.get_run(record.mlflow_run_id) for record in (record_one, record_two)]
    assert runs[1].info.start_time >= runs[0].info.end_time  # the second trained only after the first published
    for name, run in zip((first.name, second_name), runs):
        assert run.info.run_name == name and run.info.status == "FINISHED"
        assert [m.step for m in client.get_metric_history(run.info.run_id, "sft/loss")] == [1, 2]
    assert runs[0].data.tags["prefect.flow_run_id"] == str(first.id)


def wait_for_checkpoint(worker, run_name: str, step: int, timeout_s: float = 300) -> None:
    manifest = Path(worker["runs"]) / run_name / "checkpoints" / f"step_{step}" / "manifest.json"
    deadline = time.monotonic() + timeout_s
    while not manifest.exists():
        assert time.monotonic() < deadline, f"{run_name} never wrote its step-{step} checkpoint"
        time.sleep(0.2)


def _flow_run_process(flow_run_id) -> psutil.Process | None:
    for process in psutil.process_iter(["pid"]):
        try:
            if process.environ().get("PREFECT__FLOW_RUN_ID") == str(flow_run_id) and "prefect.engine" in " ".join(
                process.cmdline()
            ):
                return process
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return None


# On SQLite only: the restart by `rlflow worker` backs the automation up where its dropped trigger was seen; on
# PostgreSQL the automation restarts killed runs by itself (tests/test_topology.py, under load), which is tested there.
def test_killed_run_restarts_by_itself_and_matches_an_uninterrupted_run(worker):
    from prefect.automations import Automation
    from prefect.client.orchestration import get_client

    uid = uuid.uuid4().hex[:6]
    steps = {"total_steps": 40, "save_freq": 10, "log_model": False}
    # The server may drop the restart automation's evaluation of the crash (flows/ops/deploy.py): here an operator has
    # disabled it, and `rlflow worker` must restart the run by itself (the automation's own path is the next test's).
    restart = Automation.read(name="rlflow: restart crashed runs")
    restart.disable()
    try:
        clean = trigger(sft_params(worker, run_name=f"clean-{uid}", **steps))
        assert wait_final(clean.id, worker).state.is_completed()
        killed = trigger(sft_params(worker, run_name=f"killed-{uid}", **steps))  # in the processes clean kept
        # Found before the checkpoint appears, so that the kill follows it at once: the 30 steps after it take
        # only seconds, and a late kill would find the run finished.
        engine = _wait_for_flow_run_process(killed.id)
        wait_for_checkpoint(worker, f"killed-{uid}", 10)
        # the worker processes and task host the attempt holds
        trained_in = local_ray_workers(worker["servers"]["ray_pid"])
        attempt = [engine, *engine.children(recursive=True), *map(psutil.Process, trained_in)]
        engine.send_signal(signal.SIGKILL)
        kinds = {name.split(".")[0] for name in trained_in.values()}  # (titled by the method each runs now)
        assert kinds == {"ray::ActorRolloutRefWorker", "ray::TaskHost"}, trained_in
        final = wait_final(killed.id, worker, timeout_s=480)
    finally:
        restart.enable()
    assert final.state.is_completed(), final.state
    with get_client(sync_client=True) as client:
        states = sorted(client.read_flow_run_states(killed.id), key=lambda s: s.timestamp)
    history = [s.type.value for s in states]
    assert "CRASHED" in history and history.index("SCHEDULED", history.index("CRASHED")) > 0, history
    assert history[-1] == "COMPLETED"
    restarted = states[history.index("SCHEDULED", history.index("CRASHED"))]
    assert restarted.name == "Restarting" and restarted.message.startswith("rlflow worker:"), restarted
    # The new attempt resumed from a checkpoint: the MLflow run is the same, steps before it were not redone.
    record = RunRecord.read(f"{worker['runs']}/killed-{uid}")
    client = MlflowClient()
    run = client.get_run(record.mlflow_run_id)
    assert run.info.status == "FINISHED"
    losses = client.get_metric_history(run.info.run_id, "sft/loss")
    assert sorted({m.step for m in losses}) == list(range(1, 41))
    assert sum(1 for m in losses if m.step <= 10) == 10, "steps up to the checkpoint ran once"
    clean_weights = load_file(f"{worker['runs']}/clean-{uid}/final_model/model.safetensors")
    killed_weights = load_file(f"{worker['runs']}/killed-{uid}/final_model/model.safetensors")
    assert all(torch.equal(clean_weights[k], killed_weights[k]) for k in clean_weights)
    # no process of the dead attempt survives: its own, and those it trained in in the local Ray (the registry ended
    # them; the new attempt trained in new ones)
    survivors = [p for p in attempt if alive(p)]
    assert not survivors, [(p.pid, p.name(), json.dumps(p.cmdline()[:3])) for p in survivors]


def _wait_for_flow_run_process(flow_run_id, timeout_s: float = 120) -> psutil.Process:
    deadline = time.monotonic() + timeout_s
    while (process := _flow_run_process(flow_run_id)) is None:
        assert time.monotonic() < deadline, f"no process of flow run {flow_run_id} after {timeout_s} s"
        time.sleep(0.5)
    return process


def test_run_lost_with_its_worker_is_marked_crashed_restarted_and_capped(worker):
    """The worker and the flow run die together (a machine going away): only the heartbeats can tell. With
    trainer.max_crash_restarts=0 the restarted attempt must end Failed, saying why, instead of training. (On
    PostgreSQL too: tests/test_topology.py.)"""
    check_run_lost_with_its_worker(worker)


def check_run_lost_with_its_worker(worker) -> None:
    uid = uuid.uuid4().hex[:6]
    lost = trigger(
        sft_params(worker, run_name=f"lost-{uid}", total_steps=400, save_freq=10, max_crash_restarts=0, log_model=False)
    )
    wait_for_checkpoint(worker, f"lost-{uid}", 10)  # training, its heartbeats sent (the first one at its start)
    engine = _flow_run_process(lost.id)
    worker["process"].stop(signal.SIGKILL)  # the worker's session: the worker and the flow-run process
    # SIGKILL is delivered at once but a process with a few GiB mapped takes a moment to exit on a busy machine
    _, left = psutil.wait_procs([engine], timeout=30)
    assert not any(map(alive, left)), "the flow-run process outlived its worker"
    deadline = time.monotonic() + 300
    while read_flow_run(lost.id).state.type.value not in ("SCHEDULED", "FAILED", "COMPLETED"):
        assert time.monotonic() < deadline, f"still {read_flow_run(lost.id).state} after 300 s"
        time.sleep(3)
    assert read_flow_run(lost.id).state.name == "Restarting"
    worker["process"].start()  # the machine is back
    final = wait_final(lost.id, worker, timeout_s=300)
    assert final.state.is_failed()
    assert "capped at trainer.max_crash_restarts=0" in final.state.message
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        crashed = [s for s in client.read_flow_run_states(lost.id) if s.type.value == "CRASHED"]
    assert len(crashed) == 1 and "no heartbeat" in crashed[0].message
