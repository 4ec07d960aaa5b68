"""trainer.runs_dir on object storage: a real S3-compatible server (moto's server mode) on 127.0.0.1, reached
through a TCP relay that the tests can cut like a network partition."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
import uuid

import boto3
import pytest
import torch
from faults import TcpProxy
from safetensors.torch import load

from flows.config import load_config, runs_root
from flows.ops.services import free_port
from rlworkers.checkpoint import (
    begin_checkpoint,
    commit_checkpoint,
    find_latest_checkpoint,
    list_checkpoints,
    verify_checkpoint,
    write_json,
)
from rlworkers.storage import cached_copy, local_dir, staged_dir

pytestmark = pytest.mark.slow  # starts services, trains or installs: `make test-quick` leaves it out

BUCKET = "rlflow-test"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server on 127.0.0.1 and a relay in front of it; this process's AWS_* variables point at the relay
    (the runs forward them to their Ray workers)."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                pytest.fail(f"moto's S3 server did not start on port {port}; see {log.name}")
            time.sleep(0.3)
    proxy = TcpProxy(port)
    proxy.start()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}",
        "AWS_MAX_ATTEMPTS": "2",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    direct = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}")  # the test's own view, never cut
    direct.create_bucket(Bucket=BUCKET)
    yield {"proxy": proxy, "client": direct, "url": f"s3://{BUCKET}"}
    proxy.stop()
    server.terminate()
    server.wait(10)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _keys(s3, prefix: str) -> list[str]:
    pages = s3["client"].get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))


def test_folders_round_trip_through_the_store(s3, tmp_path):
    url = f"{s3['url']}/storage-{uuid.uuid4().hex[:6]}/model"
    with staged_dir(url) as folder:
        os.makedirs(f"{folder}/sub")
        for rel in ("config.json", "sub/weights.bin"):
            with open(f"{folder}/{rel}", "w") as f:
                f.write(rel)
    assert [k.split("/model/")[1] for k in _keys(s3, url.split(f"{BUCKET}/")[1])] == ["config.json", "sub/weights.bin"]
    with local_dir(url) as folder:
        assert open(f"{folder}/sub/weights.bin").read() == "sub/weights.bin"
    assert not os.path.exists(folder)  # a temporary copy
    cached = cached_copy(url, tmp_path / "cache")
    assert cached_copy(url, tmp_path / "cache") == cached and open(f"{cached}/config.json").read() == "config.json"
    with pytest.raises(RuntimeError), staged_dir(f"{url}-failed") as folder:
        open(f"{folder}/half.bin", "w").close()
        raise RuntimeError("the writer failed")
    assert not _keys(s3, url.split(f"{BUCKET}/")[1] + "-failed")  # nothing uploaded after an error


def test_checkpoints_commit_and_fall_back_on_the_store(s3):
    root = f"{s3['url']}/ckpt-{uuid.uuid4().hex[:6]}/checkpoints"
    for step in (1, 2):
        step_dir = begin_checkpoint(root, step)
        write_json(f"{step_dir}/trainer_state.json", {"step": step})
        commit_checkpoint(step_dir, required=["trainer_state.json"])
    partial = begin_checkpoint(root, 3)
    write_json(f"{partial}/trainer_state.json", {"step": 3})  # no manifest: the save did not finish
    assert [step for step, _ in list_checkpoints(root)] == [1, 2, 3]
    assert find_latest_checkpoint(root)[0] == f"{root}/step_2"
    s3["client"].put_object(
        Bucket=BUCKET, Key=f"{root[len('s3://' + BUCKET) + 1 :]}/step_2/trainer_state.json", Body=b'{"step": 99}'
    )  # corrupted behind the run's back
    assert find_latest_checkpoint(root)[0] == f"{root}/step_1"
    verify_checkpoint(f"{root}/step_1")


def _config(runs: str, name: str, *extra: str):
    return load_config(
        "demo",
        [
            f"trainer.runs_dir={runs}",
            f"trainer.run_name={name}",
            "trainer.total_steps=6",
            "trainer.save_freq=2",
            "trainer.test_freq=0",
            "trainer.keep_last_checkpoints=2",
            "data.train_batch_size=8",
            "data.val_batch_size=8",
            "rollout.n=4",
            "actor.ppo_mini_batch_size=16",
            "actor.ppo_micro_batch_size_per_gpu=8",
            "trainer.log_samples=0",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def flows_env(ray_cluster, services, s3, tmp_path_factory):
    from rlworkers.models.tiny import ensure_tiny_model

    return {
        "model": str(ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")),
        "local_runs": str(tmp_path_factory.mktemp("runs")),
    }


def _run(config):
    from flows.controller.groups import ray_task_runner
    from flows.grpo import grpo

    state = grpo.with_options(task_runner=ray_task_runner())(config=config, return_state=True)
    return state


def test_a_run_on_s3_survives_a_store_outage_mid_save_and_matches_a_local_run(flows_env, s3):
    """GRPO with every checkpoint, the run record and the final model on S3. The network to the store is cut
    while the step-4 checkpoint is being written: the save fails with a clear error and the step-2 checkpoint is
    untouched. Once the store is back, the same command resumes from step 2 and ends with the weights of an
    uninterrupted run on a local disk."""
    name = f"s3-{uuid.uuid4().hex[:6]}"
    model = f"model.path={flows_env['model']}"
    clean = _run(_config(flows_env["local_runs"], name, model))
    assert clean.is_completed(), clean.message

    config = _config(f"{s3['url']}/runs", name, model, "trainer.log_model=true")
    prefix = f"runs/{name}/checkpoints/step_4/"
    proxy = s3["proxy"]
    proxy.cut_at(f"PUT /{BUCKET}/{prefix}".encode(), nth=2)  # the network goes once one file of step 4 is written
    try:
        failed = _run(config)
    finally:
        proxy.restore()
    assert failed.is_failed()
    assert "could not save checkpoint" in failed.message and f"{name}/checkpoints/step_4" in failed.message, (
        failed.message
    )
    assert f"{name}/checkpoints/step_2" in failed.message and "trainer.runs_dir" in failed.message
    root = f"{s3['url']}/runs/{name}/checkpoints"
    written = _keys(s3, prefix)
    assert written and f"{prefix}manifest.json" not in written, written  # half written, never committed
    assert find_latest_checkpoint(root)[0] == f"{root}/step_2"  # and the one before it is whole

    resumed = _run(config)
    assert resumed.is_completed(), resumed.message
    assert [step for step, _ in list_checkpoints(root)] == [4, 6]  # retention, after each commit
    final = _keys(s3, f"runs/{name}/final_model/")
    assert any(k.endswith("model.safetensors") for k in final) and any(
        k.endswith("tokenizer_config.json") for k in final
    )
    assert not any("actor_state" in k for k in final), final  # the model and tokenizer only
    weights = load(
        s3["client"].get_object(Bucket=BUCKET, Key=f"runs/{name}/final_model/model.safetensors")["Body"].read()
    )
    with open(f"{runs_root(_config(flows_env['local_runs'], name))}/final_model/model.safetensors", "rb") as f:
        clean_weights = load(f.read())
    assert all(torch.equal(clean_weights[k], weights[k]) for k in clean_weights)

    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    runs = client.search_runs(
        [client.get_experiment_by_name("rlflow").experiment_id], filter_string=f"tags.`rlflow.run_name` = '{name}'"
    )
    logged = [r for r in runs if r.data.tags.get("final_model_uri")]
    assert len(logged) == 1, "the S3 run logs its final model to MLflow"


def test_a_runs_dir_that_cannot_be_written_fails_before_anything_starts(flows_env, s3, tmp_path):
    config = _config(
        "s3://no-such-bucket-rlflow/runs", f"nobucket-{uuid.uuid4().hex[:6]}", f"model.path={flows_env['model']}"
    )
    state = _run(config)
    assert state.is_failed()
    assert "trainer.runs_dir='s3://no-such-bucket-rlflow/runs' cannot be written" in state.message, state.message
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    experiment = client.get_experiment_by_name("rlflow")
    if experiment:  # no MLflow run was opened for it
        assert not client.search_runs(
            [experiment.experiment_id], filter_string=f"tags.`rlflow.run_name` = '{config.trainer.run_name}'"
        )

    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o755)  # owned by this user (root here): another user cannot write it
    # As user nobody. The check runs once as root first, so that what it imports lazily is loaded before the switch:
    # nobody may not be able to read this checkout (a clone in a 0700 folder).
    check = (
        "import os, tempfile; from flows.config import load_config; "
        "from flows.controller.run_start import check_runs_dir_writable; "
        "check_runs_dir_writable(load_config('demo', [f'trainer.runs_dir={tempfile.mkdtemp()}'])); "
        f"config = load_config('demo', ['trainer.runs_dir={read_only}']); "
        "os.setgid(65534); os.setuid(65534); check_runs_dir_writable(config)"
    )
    if os.geteuid() != 0:
        pytest.skip("needs root to run the check as another user")
    result = subprocess.run(
        [sys.executable, "-c", check],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert result.returncode != 0
    assert f"trainer.runs_dir='{read_only}' cannot be written (PermissionError" in result.stderr, result.stderr[-2000:]


def test_a_sharded_run_writes_each_ranks_shard_to_the_store_and_resumes_from_them(flows_env, s3):
    """actor.strategy=fsdp2 with trainer.runs_dir on S3: each rank writes its own shard straight to the store (no
    gather), the manifest commits them, and a run asked for more steps resumes from those shards."""
    name = f"s3-fsdp-{uuid.uuid4().hex[:6]}"
    extra = (f"model.path={flows_env['model']}", "actor.strategy=fsdp2", "trainer.save_freq=2")
    first = _run(_config(f"{s3['url']}/runs", name, *extra, "trainer.total_steps=2"))
    assert first.is_completed(), first.message
    shards = _keys(s3, f"runs/{name}/checkpoints/step_2/actor/shards/")
    assert [key.rsplit("/", 1)[1] for key in shards] == [".metadata", "__0_0.distcp", "__1_0.distcp"], shards
    manifest = verify_checkpoint(f"{s3['url']}/runs/{name}/checkpoints/step_2")  # the shards' sha256 checked too
    assert {f"actor/shards/{f}" for f in (".metadata", "__0_0.distcp", "__1_0.distcp")} <= set(manifest["files"])
    more = _run(_config(f"{s3['url']}/runs", name, *extra, "trainer.total_steps=4"))
    assert more.is_completed(), more.message
    assert [step for step, _ in list_checkpoints(f"{s3['url']}/runs/{name}/checkpoints")][-1] == 4
