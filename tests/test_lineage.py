"""Lineages against real Prefect and MLflow servers: each run starts from the lineage's champion and the data its
parent had not seen, registers its model, and is promoted only if validation held; a complete run is not re-run
silently; a model reference that does not exist fails before any worker starts, naming what exists.

Validation scores come from reward functions the test writes (a constant per run), so promotion and rejection are
decided by the real registry logic on known numbers, not by the luck of a few training steps.
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from rlflow_cli import rlflow
from safetensors.torch import load_file

from flows.config import load_config
from flows.controller.groups import ray_task_runner
from flows.lineages.lineage import RunRecord, read_result
from flows.sft import sft
from rlworkers.models.tiny import ensure_tiny_model

pytestmark = pytest.mark.slow  # starts services, trains or installs: `make test-quick` leaves it out


@pytest.fixture(scope="module")
def env(ray_cluster, services, tmp_path_factory):
    model = ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")
    rewards = tmp_path_factory.mktemp("rewards")
    for name, value in (("good", 0.6), ("worse", 0.3)):
        (rewards / f"{name}.py").write_text(
            f"def score(prompts, responses, **columns):\n    return [{value}] * len(responses)\n"
        )
    return {"model": str(model), "runs": str(tmp_path_factory.mktemp("runs")), "rewards": rewards}


def lineage_config(env, lineage: str, reward: str, *extra: str):
    return load_config(
        "demo-sft",
        [
            f"model.path={env['model']}",
            f"trainer.runs_dir={env['runs']}",
            f"trainer.lineage={lineage}",
            "trainer.run_name=null",  # the preset names a run; a lineage names each run itself
            "trainer.total_steps=2",
            "trainer.save_freq=2",
            "trainer.test_freq=0",
            "trainer.steps_per_task=1",  # a task run per step: the UI test looks for sft_step-step-1 and -2
            "data.train_batch_size=16",
            "data.val_batch_size=8",
            "actor.ppo_mini_batch_size=16",
            "actor.ppo_micro_batch_size_per_gpu=8",
            "trainer.log_samples=0",
            f"reward.reward_fn={env['rewards'] / reward}.py:score",
            *extra,
        ],
    )


def run_sft(config):
    state = sft.with_options(task_runner=ray_task_runner())(config=config, return_state=True)
    return state


@pytest.fixture(scope="module")
def lineage_runs(env):
    """Two runs of one lineage: the first scores 0.6 in validation, the second 0.3."""
    lineage = f"lin-{uuid.uuid4().hex[:6]}"
    states = [run_sft(lineage_config(env, lineage, reward)) for reward in ("good", "worse")]
    for state in states:
        assert state.is_completed(), state.message
    return lineage, states


def test_lineage_runs_continue_model_and_data_and_promote_only_improvements(env, lineage_runs):
    lineage, _ = lineage_runs
    client = MlflowClient()
    runs = client.search_runs(
        [client.get_experiment_by_name(lineage).experiment_id], order_by=["attributes.start_time ASC"]
    )
    assert len(runs) == 2
    one, two = runs
    assert one.info.run_name.startswith(f"{lineage}-") and one.info.run_name != two.info.run_name
    record_one = RunRecord.read(f"{env['runs']}/{one.info.run_name}")
    record_two = RunRecord.read(f"{env['runs']}/{two.info.run_name}")
    # The first run started from model.path (no champion yet), the second from the first run's registered model.
    assert record_one.model_uri == env["model"] and record_one.parent_run_id is None
    assert record_two.model_uri == f"models:/{lineage}/1" and record_two.parent_run_id == one.info.run_id
    start_weights = load_file(f"{record_two.model_dir}/model.safetensors")
    final_one = load_file(f"{env['runs']}/{one.info.run_name}/final_model/model.safetensors")
    assert all(torch.equal(start_weights[k], final_one[k]) for k in final_one)
    # Data: 2 steps x 16 rows each; the second run continues at the third batch of the same epoch.
    result_one = read_result(f"{env['runs']}/{one.info.run_name}")
    result_two = read_result(f"{env['runs']}/{two.info.run_name}")
    assert (result_one["data_cursor"]["epoch"], result_one["data_cursor"]["position"]) == (0, 2)
    assert record_two.data_cursor == result_one["data_cursor"]
    assert (result_two["data_cursor"]["epoch"], result_two["data_cursor"]["position"]) == (0, 4)
    # Each run has its own metrics and the lineage tags.
    for run in (one, two):
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "sft/loss")]
        assert steps == [1, 2]
        assert run.data.tags["rlflow.lineage"] == lineage and run.info.status == "FINISHED"
    # Promotion: v1 (first version, not worse than its start model) became champion; v2 is not better than the
    # champion on the same examples with the same scorer (v1 = run two's start model, 0.3 each) and stays rejected.
    assert client.get_model_version_by_alias(lineage, "champion").version == "1"
    assert "first version, non-inferior to the start model (0.600 vs 0.600" in one.data.tags["rlflow.promotion"]
    v2 = client.get_model_version(lineage, "2")
    assert "not significantly better than champion v1 (this run's start model) (0.300 vs 0.300" in v2.tags["rejected"]
    assert v2.tags["rlflow.eval.validation.mean"] == "0.3" and v2.tags["rlflow.eval.validation.n"] == "8"
    assert result_two["decision"].startswith("v2 rejected")

    # `rlflow runs` shows the lineage, the parent and each version's fate.
    listed = rlflow("runs", "--lineage", lineage, env={"COLUMNS": "400"}, timeout=120)
    rows = {line.split("│")[1].strip(): line for line in listed.stdout.splitlines() if line.count("│") > 3}
    line_two = rows[two.info.run_name]
    assert lineage in line_two and one.info.run_name in line_two and "v2 rejected" in line_two  # parent: run one
    assert "v1 promoted" in rows[one.info.run_name]

    # Running the complete first run again trains nothing, so it fails and says so; the run is left as it was.
    again = run_sft(lineage_config(env, lineage, "good", f"trainer.run_name={one.info.run_name}"))
    assert again.is_failed() and "already trained its 2 steps" in again.message
    overrides = [
        f"model.path={env['model']}",
        f"trainer.runs_dir={env['runs']}",
        f"trainer.lineage={lineage}",
        f"trainer.run_name={one.info.run_name}",
        "trainer.total_steps=2",
        "data.train_batch_size=16",
        "actor.ppo_mini_batch_size=16",
        "actor.ppo_micro_batch_size_per_gpu=8",
    ]
    cli = rlflow("train", "sft", "--config", "demo-sft", *overrides, env={"COLUMNS": "400"}, timeout=300, check=False)
    assert cli.returncode == 1 and "already trained its 2 steps" in cli.stdout, cli.stdout[-2000:]
    assert len(client.search_model_versions(f"name = '{lineage}'")) == 2  # nothing was published again
    # ... unless asked to: the same run publishes again as a new version, without training.
    republished = run_sft(
        lineage_config(env, lineage, "good", f"trainer.run_name={one.info.run_name}", "trainer.republish=true")
    )
    assert republished.is_completed(), republished.message
    assert [m.step for m in client.get_metric_history(one.info.run_id, "sft/loss")] == [1, 2]
    assert read_result(f"{env['runs']}/{one.info.run_name}")["model_version"] == "3"


def test_missing_model_reference_fails_before_workers_start(env):
    config = lineage_config(env, f"ref-{uuid.uuid4().hex[:6]}", "good", "model.path=models:/no-such-model@champion")
    state = run_sft(config)
    assert state.is_failed()
    assert "no registered model 'no-such-model'" in state.message and "registered" in state.message
    assert not list(Path(env["runs"]).glob(f"{config.trainer.lineage}-*/run.json"))  # nothing was started


def test_crashes_are_counted_from_the_flow_run_state_history(services):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed, Pending, Running, Scheduled

    from flows.lineages.lineage import count_crashes

    @flow(name="crash-count-probe")
    def probe():
        return 1

    def crash(client, flow_run_id, times: int, restart_name: str) -> None:
        for _ in range(times):
            client.set_flow_run_state(flow_run_id, Running(), force=True)
            client.set_flow_run_state(flow_run_id, Crashed(message="killed"), force=True)
            client.set_flow_run_state(flow_run_id, Scheduled(name=restart_name), force=True)

    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(probe)
        client.set_flow_run_state(flow_run.id, Pending(), force=True)
        crash(client, flow_run.id, 2, "Restarting")  # two automatic restarts
        assert count_crashes(flow_run.id) == 2
        client.set_flow_run_state(flow_run.id, Scheduled(name="AwaitingRetry"), force=True)  # a person's Retry
        assert count_crashes(flow_run.id) == 0
        crash(client, flow_run.id, 1, "Restarting")
        assert count_crashes(flow_run.id) == 1
        # the same crash reported again after the automation's "Restarting" (worker and runner both report it)
        client.set_flow_run_state(flow_run.id, Crashed(message="killed"), force=True)
        client.set_flow_run_state(flow_run.id, Scheduled(name="Restarting"), force=True)
        assert count_crashes(flow_run.id) == 1


def test_ui_pages_show_stages_artifacts_metrics_and_versions(services, lineage_runs):
    """What a person sees in the Prefect and MLflow UIs (headless Chromium; screenshots in test-output/)."""
    from browser import Browser

    lineage, states = lineage_runs
    flow_run_id = states[0].state_details.flow_run_id
    client = MlflowClient()
    run = client.search_runs(
        [client.get_experiment_by_name(lineage).experiment_id], order_by=["attributes.start_time ASC"]
    )[0]
    with Browser(height=6000) as browser:  # tall enough that MLflow renders every metric section
        browser.open(f"{services['prefect_ui']}/runs/flow-run/{flow_run_id}", run.info.run_name)
        browser.click("Task Runs")
        text = browser.wait_for_text("sft_step-step-2")
        for name in ("validate-step-0", "sft_step-step-1", "save_checkpoint-step-2"):
            assert name in text
        assert "Completed" in text
        browser.screenshot("prefect-flow-run-task-runs")
        browser.click("Artifacts")
        text = browser.wait_for_text("-checkpoints")
        assert f"{run.info.run_name.lower()}-checkpoints" in text and f"{run.info.run_name.lower()}-result" in text
        browser.screenshot("prefect-flow-run-artifacts")

        run_url = f"{services['mlflow_ui']}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
        browser.open(f"{run_url}/model-metrics", "(sft/loss)", timeout_s=60)
        browser.wait_for_text("(val/score/mean)", timeout_s=60)  # sections render one after the other
        browser.screenshot("mlflow-run-metrics")
        text = browser.open(f"{services['mlflow_ui']}/#/models/{lineage}", "Version 2", timeout_s=60)
        assert "Version 1" in text and "champion" in text
        browser.screenshot("mlflow-registered-model")


def test_promote_by_hand_and_rollback_move_the_champion_with_their_reasons(env, lineage_runs):
    """v2 of the fixture's lineage was rejected by the gate: a person promotes it anyway, then rolls back to the
    champion before it; rolling back again goes further back, never forth to v2. Every move is in the history
    `rlflow runs --lineage` prints. (Earlier tests may have moved the champion: the test starts from whatever it is.)"""
    from flows.lineages.versions import champion_history

    lineage, _ = lineage_runs
    client = MlflowClient()

    def cli(*args: str) -> subprocess.CompletedProcess:
        return rlflow(*args, timeout=120, check=False)

    def champion() -> str:
        return client.get_model_version_by_alias(lineage, "champion").version

    before, moves = champion(), len(champion_history(client, lineage))
    assert before != "2" and champion_history(client, lineage)[0]["how"] == "promoted by its run"
    missing = cli("promote", lineage, "--version", "99", "--reason", "typo")
    assert missing.returncode == 1 and "has no version 99" in missing.stdout and "[1, 2" in missing.stdout
    promoted = cli("promote", lineage, "--version", "2", "--reason", "better on the new eval set")
    assert promoted.returncode == 0, promoted.stdout + promoted.stderr
    assert champion() == "2"
    assert client.get_model_version(lineage, "2").tags["rlflow.promoted"] == "by hand: better on the new eval set"

    rolled = cli("rollback", lineage, "--reason", "answers got worse in review")
    assert rolled.returncode == 0, rolled.stdout + rolled.stderr
    assert champion() == before
    assert client.get_model_version(lineage, "2").tags["rlflow.rolled_back"] == "answers got worse in review"
    history = champion_history(client, lineage)
    assert [(m["version"], m["previous"], m["how"]) for m in history[moves:]] == [
        ("2", before, "promoted by hand"),
        (before, "2", "rolled back from v2"),
    ]
    earlier = [m["version"] for m in history[:moves] if m["version"] != before]
    again = cli("rollback", lineage, "--reason", "once more")
    if earlier:  # further back, to the newest earlier champion
        assert again.returncode == 0 and champion() == earlier[-1], again.stdout
    else:
        assert again.returncode == 1 and "no earlier version was champion" in again.stdout
        assert champion() == before  # nothing moved
    assert champion() != "2"
    listed = cli("runs", "--lineage", lineage)
    assert listed.returncode == 0 and "champion history" in listed.stdout
    assert "rolled back from v2" in listed.stdout and "answers got worse in review" in listed.stdout
