"""`rlflow train` stopped from outside, as `timeout`, a scheduler or a container stop does it: SIGTERM mid-run ends
the MLflow run KILLED and the Prefect flow run Crashed, after the workers are stopped (the command exits 143, naming
what to do); the same command then resumes from the last checkpoint and ends with the weights of a run that was
never stopped, bit for bit (same machine). That uninterrupted run goes through a Prefect server that answers one of
its requests with 503 (the prefect_proxy fixture of tests/conftest.py): a transient server error does not stop a run."""

from __future__ import annotations

import signal
import time
import uuid

import pytest
from mlflow.tracking import MlflowClient
from rlflow_cli import rlflow, rlflow_in_background
from safetensors.torch import load_file

from flows.lineages.lineage import RunRecord
from rlworkers.models.tiny import ensure_tiny_model

pytestmark = pytest.mark.slow


def test_sigterm_ends_both_runs_and_the_same_command_resumes_bitwise(services, prefect_proxy, tmp_path):
    name = f"stopped-{uuid.uuid4().hex[:6]}"
    common = [
        "train", "sft", "--config", "demo-sft", f"model.path={ensure_tiny_model(tmp_path / 'tiny')}",
        f"trainer.runs_dir={tmp_path / 'runs'}", "trainer.total_steps=30", "trainer.save_freq=10",
        "trainer.test_freq=0", "trainer.log_samples=0", "trainer.log_model=false", "trainer.steps_per_task=1",
        "data.train_batch_size=16", "data.val_batch_size=8", "actor.ppo_mini_batch_size=16",
        "actor.ppo_micro_batch_size_per_gpu=8", "trainer.n_workers=1",
    ]  # fmt: skip
    stopped = rlflow_in_background(*common, f"trainer.run_name={name}")
    root = tmp_path / "runs" / name
    deadline = time.monotonic() + 300
    while not list((root / "checkpoints").glob("step_10/manifest*")):
        assert stopped.poll() is None, stopped.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no step-10 checkpoint after 300 s"
        time.sleep(0.2)
    stopped.send_signal(signal.SIGTERM)
    output = stopped.communicate(timeout=120)[0]
    assert stopped.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "the MLflow run is KILLED" in output and "resumes from the run's last checkpoint" in output

    record = RunRecord.read(str(root))
    assert MlflowClient().get_run(record.mlflow_run_id).info.status == "KILLED"
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(record.prefect_flow_run_id)
    assert flow_run.state.is_crashed() and "termination signal" in flow_run.state.message
    assert not (root / "final_model").exists()

    rlflow(*common, f"trainer.run_name={name}")  # the same command: resumes (trainer.resume=auto)
    proxy, through_proxy = prefect_proxy
    proxy.answer_at(b"POST /api/artifacts/")  # the run's first artifact (its MLflow link), made by rlflow's code
    rlflow(*common, f"trainer.run_name={name}-straight", env=through_proxy)
    assert proxy.answered == [b"POST /api/artifacts/ HTTP/1.1"], proxy.answered
    assert MlflowClient().get_run(record.mlflow_run_id).info.status == "FINISHED"  # the same MLflow run, continued
    resumed = load_file(root / "final_model" / "model.safetensors")
    straight = load_file(tmp_path / "runs" / f"{name}-straight" / "final_model" / "model.safetensors")
    assert resumed.keys() == straight.keys()
    assert all((resumed[k] == straight[k]).all() for k in straight), "the resumed run's weights differ"
