"""End to end: the training flows against a real Prefect server, a real MLflow server and local Ray.

Checked through the services' own APIs: the Prefect flow run with one task run per stage per step, the
checkpoint / progress / MLflow-link artifacts; the MLflow run's per-step metrics, params, samples table and model.
Worker faults injected from outside (SIGKILL, SIGSTOP of Ray worker processes): the run replaces what died,
resumes from the step-2 checkpoint in the same MLflow run and finishes with the same metrics and weights as an
uninterrupted run; past trainer.max_restarts it fails listing the faults; a bug fails at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import signal
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from faults import Injector, ProcessWatch, after, busy_worker, checkpoint_exists
from mlflow.tracking import MlflowClient
from prefect import flow
from prefect_api import settled_task_runs
from safetensors.torch import load_file

from flows.config import ConfigError, load_config, runs_root
from flows.controller.groups import end_kept_groups, ray_task_runner
from flows.controller.run_checkpoints import RUN_FIELDS
from flows.controller.run_state import TrainState
from flows.grpo import grpo
from flows.lineages.lineage import read_result
from flows.online_dpo import online_dpo
from flows.ppo import ppo
from flows.sft import sft
from rlworkers.checkpoint import list_checkpoints, read_json
from rlworkers.models.tiny import ensure_tiny_model

pytestmark = pytest.mark.slow  # starts services, trains or installs: `make test-quick` leaves it out

FLOWS = {"grpo": grpo, "sft": sft, "ppo": ppo, "online_dpo": online_dpo}
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def env(ray_cluster, services, tmp_path_factory):
    model = ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")
    return {"model": str(model), "runs": str(tmp_path_factory.mktemp("runs"))}


def small_config(env, name: str, *extra: str):
    return load_config(
        "demo",
        [
            f"model.path={env['model']}",
            f"trainer.runs_dir={env['runs']}",
            f"trainer.run_name={name}",
            "trainer.total_steps=3",
            "trainer.save_freq=2",
            "trainer.test_freq=2",
            "trainer.keep_last_checkpoints=2",
            "data.train_batch_size=8",
            "data.val_batch_size=8",
            "rollout.n=4",
            "actor.ppo_mini_batch_size=16",
            "actor.ppo_micro_batch_size_per_gpu=8",
            "critic.ppo_mini_batch_size=16",
            "critic.ppo_micro_batch_size_per_gpu=8",
            "trainer.log_samples=4",
            "trainer.log_model=false",
            "trainer.n_workers=1",  # one actor process fewer per run; the tests of data parallelism ask for 2
            *extra,
        ],
    )


def run_flow(name: str, config):
    state = FLOWS[name].with_options(task_runner=ray_task_runner())(config=config, return_state=True)
    return state, state.result()


def mlflow_run(run_name: str):
    client = MlflowClient()
    experiment = client.get_experiment_by_name("rlflow")
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.`rlflow.run_name` = '{run_name}'")
    assert len(runs) == 1, f"expected one MLflow run for {run_name}, found {len(runs)}"
    return client, runs[0]


async def prefect_view(flow_run_id):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    task_runs = await asyncio.to_thread(settled_task_runs, flow_run_id)
    async with get_client() as client:
        flow_run = await client.read_flow_run(flow_run_id)
        artifacts = await client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return flow_run, task_runs, artifacts


def test_grpo_flow_end_to_end(env):
    name = f"e2e-grpo-{uuid.uuid4().hex[:6]}"
    config = small_config(env, name, "trainer.log_model=true", "trainer.n_workers=2")  # the demo's 2 workers
    state, metrics = run_flow("grpo", config)
    assert state.is_completed()
    assert {"critic/score/mean", "actor/pg_loss", "timing_s/gen", "perf/orchestration_overhead_frac"} <= set(metrics)

    flow_run, task_runs, artifacts = asyncio.run(prefect_view(state.state_details.flow_run_id))
    per_stage = Counter(task_run.name.split("-step-")[0] for task_run in task_runs)
    updates = {t.name for t in task_runs if t.name.startswith("update_actor")}
    assert updates == {f"update_actor-step-{s}" for s in (1, 2, 3)}
    for stage in (
        "generate_sequences",
        "compute_reward",
        "compute_ref_log_prob",
        "compute_advantage",
        "update_actor",
    ):
        assert per_stage.get(stage) == 3, (stage, per_stage)  # one task run per stage per step
    assert "compute_log_prob" not in per_stage  # the demo preset's bypass mode: the rollout's log-probs are old
    assert per_stage.get("save_checkpoint") == 2 and per_stage.get("validate") == 3  # steps 2, 3 (+ step 0)
    assert all(t.state.is_completed() for t in task_runs)
    # step 2's generation was submitted during step 1, waiting for its update (no validation or checkpoint between);
    # step 3's after step 2's checkpoint
    ids = {t.name: str(t.id) for t in task_runs}
    waits = {t.name: {str(i.id) for i in t.task_inputs.get("wait_for", [])} for t in task_runs}
    assert waits["generate_sequences-step-2"] == {ids["update_actor-step-1"]}
    assert waits["generate_sequences-step-3"] == waits["generate_sequences-step-1"] == set()
    keys = {a.key for a in artifacts}
    assert {f"{name}-checkpoints", f"{name}-progress", f"{name}-mlflow", f"{name}-result"} <= keys
    assert next(a for a in artifacts if a.key == f"{name}-progress").data == 100.0  # every step's update arrived
    assert flow_run.name == name  # the Prefect flow run is named after the training run
    checkpoint_rows = [row for a in artifacts if a.key == f"{name}-checkpoints" for row in _table_rows(a)]
    assert sorted(row["step"] for row in checkpoint_rows) == [2, 3]
    link = next(a for a in artifacts if a.key == f"{name}-mlflow")
    # a checkpoint holds the controller's TrainState and what names its run, nothing else; the last one, the state
    # the run ended in (the data loader's position that result.json records too)
    root = runs_root(config)
    trainer_state = read_json(f"{root}/checkpoints/step_3/trainer_state.json")
    assert set(trainer_state) == {f.name for f in dataclasses.fields(TrainState)} | set(RUN_FIELDS)
    assert TrainState.from_checkpoint(trainer_state) == TrainState(3, read_result(root)["data_cursor"], None)

    client, run = mlflow_run(name)
    assert run.info.run_id in link.data
    assert run.data.tags["prefect.flow_run_id"] == str(flow_run.id)
    assert run.data.tags["prefect.flow_run_url"].startswith("http://127.0.0.1")
    for metric in (
        "critic/score/mean",
        "actor/pg_loss",
        "actor/entropy",
        "response_length/mean",
        "timing_s/gen",
        "timing_s/step",
        "perf/orchestration_overhead_frac",
        "perf/throughput",
    ):
        assert [m.step for m in client.get_metric_history(run.info.run_id, metric)] == [1, 2, 3], metric
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/score/mean")] == [0, 2, 3]
    assert run.data.params["actor.optim.lr"] == "0.0001" and run.data.params["rollout.n"] == "4"
    assert run.data.params["precision.autocast"] == "none"  # the demo computes in float32 (tests/test_precision.py)
    startup = {
        k for k in run.data.metrics if k.startswith("timing_s/startup/")
    }  # flows/controller/startup.py, at step 0
    assert {f"timing_s/startup/{p}" for p in ("imports", "ray", "worker_groups", "validate_start")} <= startup
    assert [m.step for m in client.get_metric_history(run.info.run_id, "timing_s/startup/worker_groups")] == [0]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "timing_s/publish")] == [3]
    artifacts_paths = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"samples", "checkpoints"} <= artifacts_paths
    samples = client.load_table(
        experiment_id=run.info.experiment_id, artifact_file="samples/step_000002.json", run_ids=[run.info.run_id]
    )
    assert len(samples) == 4 and {"prompt", "response", "ground_truth", "score"} <= set(samples.columns)
    import mlflow

    model = mlflow.transformers.load_model(run.data.tags["final_model_uri"], return_type="components")
    assert model["model"].config.hidden_size == 256
    # its model card (the final model's README.md): the start model's license, so MLflow asks no hub for one
    logged = Path(mlflow.artifacts.download_artifacts(run.data.tags["final_model_uri"]))
    assert yaml.safe_load((logged / "model_card_data.yaml").read_text())["license"] == "apache-2.0"
    # checkpoints on disk: retention kept the last two, each committed with a manifest
    assert [step for step, _ in list_checkpoints(f"{runs_root(config)}/checkpoints")] == [2, 3]


def worker_pids(title: str) -> set[int]:
    """Processes under this one (this test process's Ray) whose title starts with ``title``."""
    import psutil

    pids = set()
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if process.cmdline() and process.cmdline()[0].startswith(title):
                pids.add(process.pid)
    return pids


def test_the_next_run_of_the_process_trains_in_the_same_worker_processes_exactly_as_in_new_ones(env):
    """The test process's Ray outlives its flow runs, so a run's worker groups are kept for the next run: that
    run builds its workers in the same processes (no process start, no imports) and trains bitwise as the first
    run did in new processes. A run of another shape (one actor worker instead of two) gets new processes, and the
    kept ones of the other shape end; ``end_kept_groups`` ends the rest."""
    end_kept_groups()
    assert not worker_pids("ray::ActorRolloutRefWorker") and not worker_pids("ray::RewardWorker")
    base = f"reuse-{uuid.uuid4().hex[:6]}"
    shape = ("trainer.n_workers=2", "reward.num_workers=1", "trainer.test_freq=0")
    metrics, pids = {}, {}
    for name in ("new", "reused"):
        state, metrics[name] = run_flow("grpo", small_config(env, f"{base}-{name}", *shape))
        assert state.is_completed(), state.message
        pids[name] = (worker_pids("ray::ActorRolloutRefWorker"), worker_pids("ray::RewardWorker"))
    assert len(pids["new"][0]) == 2 and len(pids["new"][1]) == 1, pids
    assert pids["reused"] == pids["new"]
    for key in ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
        assert metrics["reused"][key] == metrics["new"][key], key
    first = load_file(f"{env['runs']}/{base}-new/final_model/model.safetensors")
    second = load_file(f"{env['runs']}/{base}-reused/final_model/model.safetensors")
    assert all(torch.equal(first[k], second[k]) for k in first)

    state, _ = run_flow("grpo", small_config(env, f"{base}-one", "trainer.n_workers=1", "trainer.test_freq=0"))
    assert state.is_completed(), state.message
    actors = worker_pids("ray::ActorRolloutRefWorker")
    assert len(actors) == 1 and not actors & pids["new"][0], (actors, pids)
    assert not worker_pids("ray::RewardWorker")  # a rule scores in the stage: the kept reward worker ended
    assert end_kept_groups() == 1
    assert not worker_pids("ray::ActorRolloutRefWorker")


def test_a_colocated_reference_gives_the_kl_of_a_reference_pool_of_its_own(env):
    """trainer.colocate_ref: the reference lives in the actor's processes (no reference group); its log-probs, and
    so the KL loss the actor trains with, are those of a reference on a pool of its own (``resource_pool``, here two
    processes, data-parallel), step by step, and the KL is not zero (the reference is the start model, not the
    policy being trained: an entropy bonus moves the policy while the untrained model's rewards are all zero)."""
    pools = ("resource_pool.spec={train: [1], ref: [2]}", "resource_pool.mapping={actor: train, ref: ref}")
    histories = {}
    for colocate in (False, True):
        name = f"coloc-{colocate}-{uuid.uuid4().hex[:6]}"
        placement = ("trainer.colocate_ref=true",) if colocate else pools
        state, _ = run_flow("grpo", small_config(env, name, *placement, "actor.entropy_coeff=0.1"))
        assert state.is_completed(), state.message
        if not colocate:  # kept for the next run: the actor's process and the reference pool's two
            assert len(worker_pids("ray::ActorRolloutRefWorker")) == 3
        client, run = mlflow_run(name)
        histories[colocate] = [m.value for m in client.get_metric_history(run.info.run_id, "actor/kl_loss")]
    assert len(worker_pids("ray::ActorRolloutRefWorker")) == 1  # the reference pool ended when not taken
    assert len(histories[True]) == 3 and any(value > 0 for value in histories[True]), histories
    assert histories[True] == pytest.approx(histories[False], rel=1e-3, abs=1e-9), histories


def test_bypass_mode_trains_as_recomputing_the_old_log_probs_does(env):
    """algorithm.rollout_correction.bypass_mode (verl's): the rollout's log-probs are the old policy's, so no
    compute_log_prob task runs; with the HF rollout in float32 they are the actor's own (same weights), so the
    updates match the recomputing run's step by step. An entropy bonus moves the policy (the untrained model's
    rewards are all zero), so the PPO ratio and KL the metrics show are not trivially 1 and 0."""
    histories, stages = {}, {}
    for bypass in (False, True):
        name = f"bypass-{bypass}-{uuid.uuid4().hex[:6]}"
        flag = f"algorithm.rollout_correction.bypass_mode={str(bypass).lower()}"
        state, _ = run_flow("grpo", small_config(env, name, flag, "actor.entropy_coeff=0.1"))
        assert state.is_completed(), state.message
        _, task_runs, _ = asyncio.run(prefect_view(state.state_details.flow_run_id))
        stages[bypass] = Counter(task_run.name.split("-step-")[0] for task_run in task_runs)
        client, run = mlflow_run(name)
        histories[bypass] = {
            key: [m.value for m in client.get_metric_history(run.info.run_id, key)]
            for key in ("actor/ppo_kl", "actor/kl_loss", "actor/entropy")
        }
    assert stages[False]["compute_log_prob"] == 3 and "compute_log_prob" not in stages[True], stages
    assert stages[True]["update_actor"] == 3 and stages[True]["compute_ref_log_prob"] == 3
    assert any(value != 0 for value in histories[True]["actor/ppo_kl"]), histories
    for key, values in histories[False].items():
        assert len(values) == 3 and histories[True][key] == pytest.approx(values, rel=1e-3, abs=1e-6), key


def test_rollout_correction_weighs_the_policy_loss_and_logs_verls_metrics(env, tmp_path):
    """algorithm.rollout_correction's rollout_is and rollout_rs (verl's decoupled mode) in a run: the HF rollout
    samples in float32 with the actor's own weights, so the ratios are 1 (the mean weight 1, nothing rejected by
    seq_max_k3 <= 10); truncated at 1e-6, every token's weight is 1e-6, and so is the policy gradient (a reward of
    distinct characters: the advantages are not zero; no KL loss and no entropy bonus, so the policy loss is all the
    gradient there is: its norm is ~4 without the weights on the tiny model, ~4e-6 with them)."""
    name = f"rollout-corr-{uuid.uuid4().hex[:6]}"
    correction = "algorithm.rollout_correction"
    config = small_config(
        env, name, distinct_reward(tmp_path), "actor.use_kl_loss=false", "actor.entropy_coeff=0",
        f"{correction}.bypass_mode=false", f"{correction}.rollout_is=token", f"{correction}.rollout_is_threshold=1e-6",
        f"{correction}.rollout_rs=seq_max_k3", f"{correction}.rollout_rs_threshold=10",
        "trainer.total_steps=2", "trainer.test_freq=0", "trainer.save_freq=0",
    )  # fmt: skip
    state, _ = run_flow("grpo", config)
    assert state.is_completed(), state.message
    client, run = mlflow_run(name)

    def history(key):
        return [m.value for m in client.get_metric_history(run.info.run_id, key)]

    assert history("rollout_corr/rollout_is_mean") == pytest.approx([1.0, 1.0], abs=1e-3)
    assert history("rollout_corr/rollout_is_ratio_fraction_high") == [1.0, 1.0]
    assert history("rollout_corr/rollout_rs_masked_fraction") == [0.0, 0.0]
    assert len(history("rollout_corr/kl")) == 2
    assert any(value != 0 for value in history("critic/advantages/max")), history("critic/advantages/max")
    assert all(norm < 1e-3 for norm in history("actor/grad_norm")), history("actor/grad_norm")


def test_one_step_off_trains_each_batch_one_update_behind(env, tmp_path):
    """async_training.staleness=1 in a GRPO run: step s+1's generation runs before step s's update (the Prefect
    timeline shows it), so its batch is one update behind when trained (``async/staleness_max`` 1), except after the
    step-2 checkpoint, where nothing is in flight (0 at step 3: the pipeline drains there and the checkpoint's data
    position is 2 batches, as on-policy); rollout correction sees the drift: its KL against the policy of now
    is larger on the stale steps than on the fresh ones (a large learning rate and a reward of distinct characters,
    so that one update moves the policy)."""
    name = f"one-step-off-{uuid.uuid4().hex[:6]}"
    config = small_config(
        env, name, distinct_reward(tmp_path), "async_training.staleness=1", "actor.optim.lr=0.01",
        "algorithm.rollout_correction.bypass_mode=false", "algorithm.rollout_correction.rollout_is=token",
        "trainer.total_steps=4", "trainer.save_freq=2", "trainer.test_freq=0",
    )  # fmt: skip
    state, _ = run_flow("grpo", config)
    assert state.is_completed(), state.message
    client, run = mlflow_run(name)

    def history(key):
        return [m.value for m in client.get_metric_history(run.info.run_id, key)]

    assert history("async/staleness_max") == [0.0, 1.0, 0.0, 1.0]
    kl = [abs(value) for value in history("rollout_corr/kl")]
    assert min(kl[1], kl[3]) > 10 * max(kl[0], kl[2], 1e-9), kl
    saved = read_json(f"{runs_root(config)}/checkpoints/step_2/trainer_state.json")
    assert saved["loader"]["position"] == 2, saved["loader"]  # batches handed out: steps 1 and 2, none in flight
    assert saved["policy_versions"] == {"actor": 2, "rollout": 2}  # one pool: the actor's weights sample
    _, task_runs, _ = asyncio.run(prefect_view(state.state_details.flow_run_id))
    started = {task_run.name: task_run.start_time for task_run in task_runs}
    assert started["generate_sequences-step-2"] < started["update_actor-step-1"], started
    assert started["generate_sequences-step-4"] < started["update_actor-step-3"], started
    assert started["generate_sequences-step-3"] > started["update_actor-step-2"], started


def test_a_rollout_pool_of_its_own_generates_beside_the_update_and_recovers_from_losing_its_worker(env, tmp_path):
    """rollout.n_workers=1: the training generations run in a rollout worker of their own, which gets the actor's
    weights after each update (a sync_rollout_weights task, none after the last step); one step off, step s+1's
    generation runs while step s's update does (the timeline overlaps). The rollout samples with the weights sent to
    it: after the step-2 checkpoint (nothing in flight) step 3's batch is on-policy, version 2 (staleness 0) and its
    KL to the policy of now is as small as step 1's (the start weights both sides); the stale steps' KL is larger.
    Then the same run with its rollout worker killed during step 3's generation: the run replaces it, restores the
    step-2 checkpoint, sends it the weights, and ends with the same weights as the run without the fault (each
    step's draws come from the step's seed)."""
    base = f"rollout-pool-{uuid.uuid4().hex[:6]}"
    settings = (
        distinct_reward(tmp_path), "rollout.n_workers=1", "async_training.staleness=1",
        "actor.optim.lr=0.01", "algorithm.rollout_correction.bypass_mode=false",
        "algorithm.rollout_correction.rollout_is=token", "trainer.total_steps=4", "trainer.save_freq=2",
        "trainer.test_freq=0", "trainer.max_restarts=1",
        "rollout.response_length=12",  # a generation long enough for the fault injector to find it running
    )  # fmt: skip
    name = f"{base}-clean"
    state, _ = run_flow("grpo", small_config(env, name, *settings))
    assert state.is_completed(), state.message
    client, run = mlflow_run(name)

    def history(key):
        return [m.value for m in client.get_metric_history(run.info.run_id, key)]

    assert history("async/staleness_max") == [0.0, 1.0, 0.0, 1.0]
    kl = [abs(value) for value in history("rollout_corr/kl")]
    assert min(kl[1], kl[3]) > 10 * max(kl[0], kl[2], 1e-9), kl
    _, task_runs, _ = asyncio.run(prefect_view(state.state_details.flow_run_id))
    runs = {task_run.name: task_run for task_run in task_runs}
    assert sorted(n for n in runs if n.startswith("sync_rollout_weights")) == [
        f"sync_rollout_weights-step-{step}" for step in (1, 2, 3)
    ]
    assert runs["generate_sequences-step-2"].start_time < runs["update_actor-step-1"].end_time, runs
    assert runs["generate_sequences-step-4"].start_time < runs["update_actor-step-3"].end_time, runs
    # the weights each pool had: the rollout's are sent after each update but the last
    versions = [read_json(f"{env['runs']}/{name}/checkpoints/step_{s}/trainer_state.json") for s in (2, 4)]
    assert [saved["policy_versions"] for saved in versions] == [{"actor": 2, "rollout": 2}, {"actor": 4, "rollout": 3}]

    config = small_config(env, f"{base}-faults", *settings)
    injector = Injector([(checkpoint_exists(runs_root(config), 2), "ray::ActorRolloutRefWorker.generate_sequences",
                          signal.SIGKILL)])  # fmt: skip
    injector.start()
    try:
        state, _ = run_flow("grpo", config)
    finally:
        injector.stop()
    assert len(injector.done) == 1 and state.is_completed(), state.message
    client, run = mlflow_run(f"{base}-faults")
    assert [m.value for m in client.get_metric_history(run.info.run_id, "fault/restarts")] == [1]
    clean = load_file(f"{env['runs']}/{base}-clean/final_model/model.safetensors")
    recovered = load_file(f"{env['runs']}/{base}-faults/final_model/model.safetensors")
    assert all(torch.equal(clean[k], recovered[k]) for k in clean)


def test_a_rollout_pool_of_its_own_samples_with_the_gathered_weights_of_a_sharded_actor(env, tmp_path):
    """actor.strategy=fsdp2 with rollout.n_workers=1: the two actor ranks train their shards, and after each update
    the weights gathered from them reach the rollout process, which holds the whole model. The on-policy steps after
    a checkpoint's drain (steps 1 and 3) sample with the actor's weights of then, so their KL to the policy is as small
    as at the start; one step off (2 and 4), larger; the checkpoints name each pool's version."""
    name = f"fsdp-rollout-pool-{uuid.uuid4().hex[:6]}"
    state, _ = run_flow("grpo", small_config(
        env, name, distinct_reward(tmp_path), "actor.strategy=fsdp2", "trainer.n_workers=2", "rollout.n_workers=1",
        "async_training.staleness=1", "actor.optim.lr=0.01", "algorithm.rollout_correction.bypass_mode=false",
        "algorithm.rollout_correction.rollout_is=token", "trainer.total_steps=4", "trainer.save_freq=2",
        "trainer.test_freq=0",
    ))  # fmt: skip
    assert state.is_completed(), state.message
    client, run = mlflow_run(name)

    def history(key):
        return [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]

    assert history("async/staleness_max") == [0, 1, 0, 1]
    kl = [abs(value) for value in history("rollout_corr/kl")]
    assert min(kl[1], kl[3]) > 10 * max(kl[0], kl[2], 1e-9), kl
    versions = [read_json(f"{env['runs']}/{name}/checkpoints/step_{s}/trainer_state.json") for s in (2, 4)]
    assert [saved["policy_versions"] for saved in versions] == [{"actor": 2, "rollout": 2}, {"actor": 4, "rollout": 3}]


def test_a_rule_reward_scores_in_the_stage_as_a_reward_worker_does(env, tmp_path):
    """reward.num_workers=0 (the default for a rule): the compute_reward stage scores the generated batch itself,
    and no reward process ever starts; the scores are the ones a reward worker (reward.num_workers=1) gives, step
    by step (a length reward, so they are not all zero)."""
    reward = tmp_path / "length.py"
    reward.write_text("def score(prompts, responses, **columns):\n    return [len(r) for r in responses]\n")
    end_kept_groups()  # the reward workers an earlier test's run kept would be seen
    scores, seen = {}, {}
    for workers in (0, 1):
        name = f"reward-{workers}-{uuid.uuid4().hex[:6]}"
        config = small_config(env, name, f"reward.reward_fn={reward}:score", f"reward.num_workers={workers}")
        with ProcessWatch("ray::RewardWorker") as watch:
            state, _ = run_flow("grpo", config)
        assert state.is_completed(), state.message
        client, run = mlflow_run(name)
        scores[workers] = [m.value for m in client.get_metric_history(run.info.run_id, "critic/score/mean")]
        seen[workers] = watch.seen
    assert seen == {0: False, 1: True}
    assert len(scores[0]) == 3 and all(value > 0 for value in scores[0]), scores
    assert scores[0] == scores[1]


def _table_rows(artifact):
    import json

    data = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
    return data if isinstance(data, list) else [dict(zip(data.keys(), row)) for row in zip(*data.values())]


def test_worker_faults_are_recovered_and_the_run_matches_an_uninterrupted_one(env):
    """Four faults from outside in one run: an actor rank killed during its update (a DDP step), an actor rank
    stopped during generation (a hang: the stage time limit ends it), the reward worker killed, and an actor rank
    killed during generation. Each time the run replaces what died, restores the step-2 checkpoint and redoes the
    steps; it ends with the same weights."""
    base = f"faults-{uuid.uuid4().hex[:6]}"
    overrides = (
        "trainer.total_steps=4",
        "trainer.test_freq=0",
        "trainer.save_freq=2",
        "trainer.stage_timeout_s=15",
        "trainer.stage_timeout_s_per_sample=0",
        "trainer.max_restarts=4",
        "reward.num_workers=1",  # a reward worker process, to kill
        "trainer.n_workers=2",  # a DDP step for a rank to die in
    )
    clean_state, clean_metrics = run_flow("grpo", small_config(env, f"{base}-clean", *overrides))
    config = small_config(env, f"{base}-faults", *overrides)
    injector = Injector([])

    def reward_replaced() -> bool:  # the run noticed the reward worker's death and started a new one
        new = busy_worker("ray::RewardWorker")
        return after(injector, 3)() and new is not None and new.pid != injector.done[2][1]

    injector.plan = [
        (checkpoint_exists(runs_root(config), 2), "ray::ActorRolloutRefWorker.update_actor", signal.SIGKILL),
        (after(injector, 1), "ray::ActorRolloutRefWorker.generate_sequences", signal.SIGSTOP),
        (
            # once the run is training again: during a generation, the longest stage, which the step's reward
            # follows (a short stage such as the reference's can pass between two looks under the suite's load)
            lambda: after(injector, 2)() and busy_worker("ray::ActorRolloutRefWorker.generate_sequences"),
            "ray::RewardWorker",
            signal.SIGKILL,
        ),
        (reward_replaced, "ray::ActorRolloutRefWorker.generate_sequences", signal.SIGKILL),  # a 4th restart
    ]
    injector.start()
    try:
        state, metrics = run_flow("grpo", config)
    finally:
        injector.stop()
    assert [sig for _, _, sig in injector.done] == [signal.SIGKILL, signal.SIGSTOP, signal.SIGKILL, signal.SIGKILL]
    assert clean_state.is_completed() and state.is_completed()

    _, task_runs, artifacts = asyncio.run(prefect_view(state.state_details.flow_run_id))
    failed = {t.name.split("-step-")[0] for t in task_runs if t.state.is_failed()}
    assert {"update_actor", "generate_sequences"} <= failed, failed
    progress = next(a for a in artifacts if a.key == f"{base}-faults-progress")
    assert "4 restart(s)" in progress.description

    client, run = mlflow_run(f"{base}-faults")
    assert run.info.status == "FINISHED"
    assert [m.value for m in client.get_metric_history(run.info.run_id, "fault/restarts")] == [1, 2, 3, 4]
    # Same seed, every fault rewound to the step-2 checkpoint: bitwise the same as the uninterrupted run.
    for key in ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
        assert metrics[key] == clean_metrics[key], key
    clean_weights = load_file(f"{env['runs']}/{base}-clean/final_model/model.safetensors")
    weights = load_file(f"{env['runs']}/{base}-faults/final_model/model.safetensors")
    assert all(torch.equal(clean_weights[k], weights[k]) for k in clean_weights)


def distinct_reward(folder) -> str:
    """A reward of distinct characters: the untrained model's responses differ in it, so the advantages are not 0."""
    (folder / "distinct.py").write_text(
        "def score(prompts, responses, **columns):\n    return [len(set(r)) for r in responses]\n"
    )
    return f"reward.reward_fn={folder / 'distinct.py'}:score"


def digit_reward(folder) -> str:
    """A reward that differs between the untrained model's responses (the exact reward scores them all 0)."""
    (folder / "digits.py").write_text(
        "def score(prompts, responses, **columns):\n    return [sum(c.isdigit() for c in r) for r in responses]\n"
    )
    return f"reward.reward_fn={folder / 'digits.py'}:score"


def test_fsdp2_ranks_killed_or_hung_are_replaced_and_the_run_matches_an_uninterrupted_one(env, tmp_path):
    """actor.strategy=fsdp2: a rank SIGKILLed in its sharded update (mid-collective) and a rank stopped during
    generation (a hang); each time every rank restores its shard of the step-2 checkpoint and the steps are redone.
    The final weights (gathered from the shards) equal an uninterrupted fsdp2 run's, bit for bit."""
    base = f"fsdp-faults-{uuid.uuid4().hex[:6]}"
    overrides = (
        "actor.strategy=fsdp2",
        "trainer.n_workers=2",
        "trainer.total_steps=4",
        "trainer.test_freq=0",
        "trainer.save_freq=2",
        "trainer.stage_timeout_s=15",
        "trainer.stage_timeout_s_per_sample=0",
        "trainer.max_restarts=2",
        digit_reward(tmp_path),
    )
    clean_state, clean_metrics = run_flow("grpo", small_config(env, f"{base}-clean", *overrides))
    config = small_config(env, f"{base}-faults", *overrides)
    injector = Injector([])
    injector.plan = [
        (checkpoint_exists(runs_root(config), 2), "ray::ActorRolloutRefWorker.update_actor", signal.SIGKILL),
        (after(injector, 1), "ray::ActorRolloutRefWorker.generate_sequences", signal.SIGSTOP),
    ]
    injector.start()
    try:
        state, metrics = run_flow("grpo", config)
    finally:
        injector.stop()
    assert [sig for _, _, sig in injector.done] == [signal.SIGKILL, signal.SIGSTOP]
    assert clean_state.is_completed() and state.is_completed()
    client, run = mlflow_run(f"{base}-faults")
    assert [m.value for m in client.get_metric_history(run.info.run_id, "fault/restarts")] == [1, 2]
    for key in ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
        assert metrics[key] == clean_metrics[key], key
    checkpoint = f"{runs_root(config)}/checkpoints/step_4/actor/shards"
    assert sorted(os.listdir(checkpoint)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # shards, no full model
    clean_weights = load_file(f"{env['runs']}/{base}-clean/final_model/model.safetensors")
    weights = load_file(f"{env['runs']}/{base}-faults/final_model/model.safetensors")
    assert clean_weights.keys() == weights.keys()
    assert all(torch.equal(clean_weights[k], weights[k]) for k in clean_weights)


def test_ppo_with_actor_and_critic_sharded_gives_the_ddp_run_numbers(env, tmp_path):
    """The same PPO job (GAE, a critic) with actor.strategy and critic.strategy ddp, then fsdp2: the metrics of
    every step agree to float tolerance (the sums run in another order), and both publish a whole model."""
    histories = {}
    for strategy in ("ddp", "fsdp2"):
        name = f"ppo-{strategy}-{uuid.uuid4().hex[:6]}"
        extra = [
            "algorithm.adv_estimator=gae",
            f"actor.strategy={strategy}",
            f"critic.strategy={strategy}",
            "trainer.n_workers=2",
            digit_reward(tmp_path),
        ]
        state, _ = run_flow("ppo", small_config(env, name, "trainer.total_steps=2", "trainer.test_freq=0", *extra))
        assert state.is_completed()
        client, run = mlflow_run(name)
        histories[strategy] = {
            key: [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]
            for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm")
        }
        assert os.path.isfile(f"{env['runs']}/{name}/final_model/model.safetensors")
    for key, values in histories["ddp"].items():
        assert len(values) == 2
        assert histories["fsdp2"][key] == pytest.approx(values, rel=1e-3, abs=1e-5), key


def test_faults_past_the_budget_fail_the_run_and_list_them(env):
    name = f"budget-{uuid.uuid4().hex[:6]}"
    config = small_config(env, name, "trainer.total_steps=3", "trainer.test_freq=0", "trainer.max_restarts=0")
    injector = Injector([(lambda: True, "ray::ActorRolloutRefWorker.update_actor", signal.SIGKILL)])
    injector.start()
    try:
        state = grpo.with_options(task_runner=ray_task_runner())(config=config, return_state=True)
    finally:
        injector.stop()
    assert state.is_failed()
    assert "FaultBudgetExhausted" in state.message and "more than trainer.max_restarts=0" in state.message
    assert "actor rank(s) [" in state.message and "update_actor-step-" in state.message
    client, run = mlflow_run(name)
    assert run.info.status == "FAILED"


def test_an_error_with_every_worker_alive_fails_at_once(env, tmp_path):
    """A reward function that raises is a bug, not a fault: no restart, the error names the function and the line."""
    (tmp_path / "broken.py").write_text("def score(prompts, responses, **columns):\n    return 1 / 0\n")
    name = f"broken-{uuid.uuid4().hex[:6]}"
    config = small_config(env, name, f"reward.reward_fn={tmp_path / 'broken.py'}:score")
    state = grpo.with_options(task_runner=ray_task_runner())(config=config, return_state=True)
    assert state.is_failed()
    assert "broken.py:score raised ZeroDivisionError: division by zero" in state.message
    assert "broken.py line 2" in state.message
    client, run = mlflow_run(name)
    assert not client.get_metric_history(run.info.run_id, "fault/restarts")


def test_bad_model_or_data_fail_before_any_worker_or_mlflow_run(env, tmp_path):
    long_prompts = tmp_path / "prompts.jsonl"
    long_prompts.write_text('{"prompt": "1+1=", "answer": "2"}\n' + '{"prompt": "' + "9" * 80 + '=", "answer": "1"}\n')
    no_answer = tmp_path / "no_answer.jsonl"
    no_answer.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2="}\n')
    verl_score = tmp_path / "verl_score.py"
    verl_score.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
    )
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]}\n')
    cases = [
        ("grpo", ["model.path=/no/such/model"], "model.path='/no/such/model': no such folder"),
        (
            "grpo",
            [f"data.train_files=[{long_prompts}]"],
            "prompts.jsonl line 2: the prompt has 82 tokens, more than data.max_prompt_length=16",
        ),
        ("grpo", ["trainer.steps_per_task=2"], "trainer.steps_per_task=2 applies to SFT only"),
        (  # a rule that compares with the answer, a row without one: named by its line, before anything starts
            "grpo",
            [f"data.train_files=[{no_answer}]", "reward.reward_fn=exact"],
            "no_answer.jsonl line 3 has no ground truth",
        ),
        (  # verl's compute_score would get ground_truth=None
            "grpo",
            [f"data.train_files=[{no_answer}]", f"custom_reward_function.path={verl_score}"],
            "no_answer.jsonl line 3 has no ground truth",
        ),
        (
            "sft",
            [f"data.train_files=[{chat}]", f"data.val_files=[{long_prompts}]", "data.max_prompt_length=128"],
            "chat.jsonl line 1: column 'messages' holds chat messages and the tokenizer of",
        ),
    ]
    for algorithm, overrides, message in cases:
        name = f"bad-input-{uuid.uuid4().hex[:6]}"
        state = FLOWS[algorithm].with_options(task_runner=ray_task_runner())(
            config=small_config(env, name, *overrides), return_state=True
        )
        assert state.is_failed() and message in state.message, state.message
        experiment = MlflowClient().get_experiment_by_name("rlflow")  # None when no run was ever started
        assert experiment is None or not MlflowClient().search_runs(
            [experiment.experiment_id], filter_string=f"tags.`rlflow.run_name` = '{name}'"
        )


def test_tracking_servers_that_stop_answering_mid_run_are_waited_for(env, services):
    """Prefect and MLflow both stop answering for 20 s (SIGSTOP of their process groups, as a stalled host or a
    full disk would) after the step-2 checkpoint: the run waits for them and ends Completed, with every step's
    metrics in MLflow and every task run in Prefect."""
    import os
    import threading
    import time

    name = f"stall-{uuid.uuid4().hex[:6]}"
    config = small_config(env, name, "trainer.total_steps=4", "trainer.test_freq=0")
    groups = [services["prefect_pid"], services["mlflow_pid"]]
    stalled = []

    def stall():
        ready = checkpoint_exists(runs_root(config), 2)
        deadline = time.monotonic() + 600
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.05)
        for group in groups:
            os.killpg(group, signal.SIGSTOP)
        stalled.append(time.monotonic())
        time.sleep(20)
        for group in groups:
            os.killpg(group, signal.SIGCONT)

    staller = threading.Thread(target=stall, daemon=True)
    staller.start()
    try:
        state = grpo.with_options(task_runner=ray_task_runner())(config=config, return_state=True)
    finally:
        staller.join(60)
        for group in groups:
            os.killpg(group, signal.SIGCONT)
    assert stalled, "the servers were never stopped"
    assert state.is_completed(), state.message
    client, run = mlflow_run(name)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "actor/pg_loss")] == [1, 2, 3, 4]
    _, task_runs, _ = asyncio.run(prefect_view(state.state_details.flow_run_id))
    assert {t.name for t in task_runs if t.name.startswith("update_actor")} == {
        f"update_actor-step-{s}" for s in (1, 2, 3, 4)
    }


def test_corrupt_checkpoint_falls_back_to_previous(env):
    name = f"corrupt-{uuid.uuid4().hex[:6]}"
    config = small_config(
        env,
        name,
        "trainer.total_steps=2",
        "trainer.save_freq=1",
        "trainer.test_freq=0",
        "trainer.keep_last_checkpoints=0",
    )
    data = config.data.model_copy(update={"train_batch_size": 16})
    state, _ = run_flow("sft", config.model_copy(update={"data": data}))
    assert state.is_completed()
    root = f"{runs_root(config)}/checkpoints"
    weights = Path(root) / "step_2" / "actor" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    weights.write_bytes(bytes(raw))
    resumed = config.model_copy(
        update={
            "trainer": config.trainer.model_copy(update={"total_steps": 3}),
            "data": config.data.model_copy(update={"train_batch_size": 16}),
        }
    )
    state, _ = run_flow("sft", resumed)
    assert state.is_completed()
    client, run = mlflow_run(name)
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "sft/loss")]
    assert steps.count(2) == 2 and steps.count(3) == 1  # step 2 was redone from the step-1 checkpoint


@pytest.mark.parametrize("algorithm", ["sft", "ppo", "online_dpo"])
def test_other_algorithms_run_end_to_end(env, algorithm, tmp_path):
    name = f"e2e-{algorithm}-{uuid.uuid4().hex[:6]}"
    # online DPO needs responses that score differently (the exact reward scores the random model's all 0: no pair)
    (tmp_path / "length.py").write_text(
        "def score(prompts, responses, **columns):\n    return [len(r) for r in responses]\n"
    )
    extra = {
        "sft": ["data.train_batch_size=16"],
        "ppo": ["algorithm.adv_estimator=gae", "trainer.total_steps=3"],
        "online_dpo": [f"reward.reward_fn={tmp_path / 'length.py'}:score"],
    }[algorithm]
    state, metrics = run_flow(algorithm, small_config(env, name, "trainer.total_steps=2", *extra))
    assert state.is_completed()
    expected = {"sft": "sft/loss", "ppo": "critic/vf_loss", "online_dpo": "actor/dpo_loss"}[algorithm]
    assert expected in metrics
    client, run = mlflow_run(name)

    def history(key):
        return [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]

    if algorithm == "online_dpo":  # pairs formed, and the first update moved the policy away from the reference
        assert min(history("dpo/pairs")) > 0
        first, second = history("dpo/reward_margin")
        assert first == pytest.approx(0, abs=1e-6)  # before any update the policy is the reference: margin 0
        assert abs(second) > 1e-4 and history("actor/dpo_loss")[0] == pytest.approx(math.log(2), abs=1e-4)
    if algorithm == "ppo":  # the critic learned: its value loss falls over the run's steps
        losses = history("critic/vf_loss")
        assert len(losses) == 3 and losses[-1] < losses[0], losses
    if algorithm == "ppo":  # step 2's generation was submitted during step 1's updates, waiting for both
        _, task_runs, _ = asyncio.run(prefect_view(state.state_details.flow_run_id))
        ids = {t.name: str(t.id) for t in task_runs}
        waits = {t.name: {str(i.id) for i in t.task_inputs.get("wait_for", [])} for t in task_runs}
        assert waits["generate_sequences-step-2"] == {ids["update_actor-step-1"], ids["update_critic-step-1"]}
        assert all(t.state.is_completed() for t in task_runs)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "timing_s/step")] == list(
        range(1, len(history("timing_s/step")) + 1)
    )


def test_sft_steps_in_blocks_train_as_one_step_per_task_does(env):
    """trainer.steps_per_task=3: one task per block of steps, blocks end at checkpoints; every step is logged, and
    the run trains exactly as one step per task does (same seed: the same losses)."""
    base = f"sft-blocks-{uuid.uuid4().hex[:6]}"
    extra = ("trainer.total_steps=7", "trainer.save_freq=5", "trainer.test_freq=0", "data.train_batch_size=16")
    runs = {}
    for size in (1, 3):
        state, _ = run_flow("sft", small_config(env, f"{base}-{size}", *extra, f"trainer.steps_per_task={size}"))
        assert state.is_completed()
        runs[size] = state
    _, task_runs, _ = asyncio.run(prefect_view(runs[3].state_details.flow_run_id))
    sft_runs = {t.name: t.state.type.value for t in task_runs if t.name.startswith("sft_step")}
    assert sft_runs == {f"sft_step-step-{a}-to-{b}": "COMPLETED" for a, b in ((1, 3), (4, 5), (6, 7))}
    assert [step for step, _ in list_checkpoints(f"{env['runs']}/{base}-3/checkpoints")] == [5, 7]
    losses = {}
    for size in (1, 3):
        client, run = mlflow_run(f"{base}-{size}")
        history = client.get_metric_history(run.info.run_id, "sft/loss")
        losses[size] = [m.value for m in sorted(history, key=lambda m: m.step)]
        overhead = client.get_metric_history(run.info.run_id, "perf/orchestration_overhead_frac")
        assert sorted(m.step for m in overhead) == list(range(1, 8))
    assert len(losses[3]) == 7 and losses[3] == losses[1]


@pytest.mark.parametrize("algorithm", ["sft", "grpo"])
def test_a_validation_that_reaches_stop_at_val_score_ends_training_at_its_step(env, algorithm):
    """trainer.stop_at_val_score: the first validation after step 0 whose val/score/mean reaches it (0: any score
    does, so the first one, at step 2 of 7) makes its step the run's last: no step trains after it, the model of that
    step is checkpointed and published, the checkpoint says where the run stopped, and the run asked again has
    nothing to do. SFT in blocks of steps, GRPO with its next generation submitted ahead."""
    name = f"{algorithm}-stop-{uuid.uuid4().hex[:6]}"
    extra = ["trainer.total_steps=7", "trainer.test_freq=2", "trainer.save_freq=5", "trainer.stop_at_val_score=0"]
    extra += ["trainer.steps_per_task=3"] if algorithm == "sft" else []
    state, _ = run_flow(algorithm, small_config(env, name, *extra))
    assert state.is_completed()
    client, run = mlflow_run(name)
    loss = "sft/loss" if algorithm == "sft" else "actor/pg_loss"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, loss)) == [1, 2]
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "val/score/mean")) == [0, 2]
    assert read_result(f"{env['runs']}/{name}")["steps"] == 2
    checkpoints = list_checkpoints(f"{env['runs']}/{name}/checkpoints")
    assert [step for step, _ in checkpoints] == [2]
    saved = TrainState.from_checkpoint(read_json(f"{checkpoints[0][1]}/trainer_state.json"))
    assert saved.step == 2 and saved.stopped_at == 2
    again = FLOWS[algorithm].with_options(task_runner=ray_task_runner())(
        config=small_config(env, name, *extra), return_state=True
    )
    assert again.is_failed() and "stopped at step 2" in again.message


def test_invalid_config_fails_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="actor.optim.lr"):
        load_config("demo", ["actor.optim.lr=-1"])
    with pytest.raises(ConfigError, match="actor.ppo_mini_batch_size"):
        load_config("demo", ["actor.ppo_mini_batch_size=7"])
    with pytest.raises(ConfigError, match="trainer.nonexistent"):
        load_config("demo", ["trainer.nonexistent=1"])
    result = subprocess.run(
        [sys.executable, "-m", "flows", "train", "grpo", "--config", "demo", "rollout.temperature=0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert result.returncode == 2
    assert "rollout.temperature" in result.stdout + result.stderr


def test_runs_command_lists_runs_with_links(services):
    client = MlflowClient()
    experiment = client.get_experiment_by_name("rlflow") or client.get_experiment(client.create_experiment("rlflow"))
    name = f"listed-{uuid.uuid4().hex[:6]}"
    run = client.create_run(
        experiment.experiment_id,
        run_name=name,
        tags={
            "rlflow.run_name": name,
            "algorithm": "grpo",
            "prefect.flow_run_url": "http://127.0.0.1:1/runs/flow-run/abc",
        },
    )
    for step in (1, 2, 3):
        client.log_metric(run.info.run_id, "timing_s/step", 1.0, step=step)
    env = {
        "PATH": "/usr/bin:/bin",
        "COLUMNS": "400",
        "PREFECT_API_URL": services["PREFECT_API_URL"],
        "MLFLOW_TRACKING_URI": services["MLFLOW_TRACKING_URI"],
    }
    result = subprocess.run(
        [sys.executable, "-m", "flows", "runs"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if name in line)
    assert "grpo" in line and " 3 " in line and "http://127.0.0.1:1/runs/flow-run/abc" in line
    assert f"runs/{run.info.run_id}" in line


@flow(name="progress-updates", persist_result=False)
def progress_updates(name: str, total: int, updates: list[tuple[int, int | None]]) -> int:
    """Send ``updates`` (step, restarts) to a new progress artifact at full speed; how many requests went out."""
    from flows.plumbing.tracking import ProgressArtifact

    progress = ProgressArtifact(name, total)
    count, submit = [0], progress._sending.submit
    progress._sending.submit = lambda fn: (count.__setitem__(0, count[0] + 1), submit(fn))[1]
    for step, restarts in updates:
        progress.update(step, restarts=restarts)
    progress.close()
    return count[0]


def test_the_progress_artifact_is_sent_at_most_once_a_second_but_always_its_last_step(services):
    from prefect.artifacts import Artifact

    from flows.plumbing.tracking import artifact_key

    name = f"progress-{uuid.uuid4().hex[:6]}"
    assert progress_updates(name, 100, [(step, None) for step in range(1, 51)]) <= 3  # first, maybe another, close
    assert Artifact.get(f"{artifact_key(name)}-progress").data == 50.0  # close sent the newest step

    name = f"progress-{uuid.uuid4().hex[:6]}"
    assert progress_updates(name, 10, [(1, None), (2, None), (2, 1), (10, None)]) == 3  # first, restart, last
    artifact = Artifact.get(f"{artifact_key(name)}-progress")
    assert artifact.data == 100.0 and "1 restart(s)" in artifact.description


def test_metrics_logged_without_waiting_go_in_few_requests_and_all_arrive(services, monkeypatch):
    from mlflow.utils import rest_utils

    from flows.plumbing.tracking import Tracker

    log_batches = []
    http_request = rest_utils.http_request

    def counted(**kwargs):
        if kwargs["endpoint"].endswith("/runs/log-batch"):
            log_batches.append(kwargs["endpoint"])
        return http_request(**kwargs)

    monkeypatch.setattr(rest_utils, "http_request", counted)
    tracker = Tracker("rlflow", f"buffered-{uuid.uuid4().hex[:6]}")
    for step in range(1, 21):  # as fast as the demo's SFT steps, faster
        tracker.log_metrics({"sft/loss": 1.0 / step, "timing_s/step": 0.1}, step, wait=False)
    tracker.flush()  # as before a checkpoint: every step is in MLflow now, the run still open
    history = MlflowClient().get_metric_history(tracker.run_id, "sft/loss")
    assert sorted(m.step for m in history) == list(range(1, 21))
    assert log_batches, "the metrics were not sent with log-batch requests"
    assert len(log_batches) <= 3, log_batches  # 20 steps, not one request per step
    tracker.finish()
