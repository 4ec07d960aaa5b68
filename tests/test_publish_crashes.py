"""Publishing survives a crash at every step: a lineage run (`rlflow train`, its own Ray) is SIGKILLed, with its
Ray, at the moment it sends MLflow the request of the next step of publishing (a proxy in front of the MLflow server
sees the request and kills the run before relaying it, as the kernel's OOM killer could at any moment), and run
again; each attempt resumes and gets one step further:

1. registered its version, decided nothing: the next attempt finds that version instead of registering another;
2. decided (the decision is on the version), the alias not moved: the next attempt finishes that decision instead
   of gating again;
3. moved the alias, the move not yet in the champion history: the next attempt writes it, once;
4. published everything, the MLflow run still RUNNING: the next attempt finishes it, and only then is the run
   marked complete (result.json), so the lineage's next run continues from it.

In the end the lineage holds one version, promoted once, with one entry in its history, and its next run starts
from it and continues its data.
"""

from __future__ import annotations

import signal
import uuid

import pytest
from faults import TcpProxy, kill_process_groups
from mlflow.tracking import MlflowClient
from rlflow_cli import rlflow, rlflow_in_background

from flows.lineages.lineage import RunRecord, read_result
from flows.lineages.versions import DECISION_TAG, champion_history, moves
from rlworkers.models.tiny import ensure_tiny_model

# the module's runs (and the first test, its fixtures' runs) take minutes each; pyproject's 600 s per test was
# calibrated on a CPU with native bf16 and ran out on an AVX2-only one: 1200 s still ends a hung test
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

KILL_POINTS = [  # (request that is not sent, its n-th in the attempt, where publishing stands then)
    (b"PATCH /api/2.0/mlflow/model-versions/update", 1, "registered"),
    (b"POST /api/2.0/mlflow/registered-models/alias", 1, "decided"),  # (GET reads it)
    (b"POST /api/2.0/mlflow/registered-models/set-tag", 1, "alias moved"),
    (b"POST /api/2.0/mlflow/runs/update", 2, "published"),  # the first reopens the MLflow run as RUNNING
]


@pytest.fixture
def mlflow_proxy(services):
    port = int(services["MLFLOW_TRACKING_URI"].rsplit(":", 1)[1].strip("/"))
    proxy = TcpProxy(port)
    proxy.start()
    yield proxy
    proxy.stop()


def test_a_run_killed_at_each_step_of_publishing_publishes_once(services, mlflow_proxy, tmp_path):
    lineage = f"publish-{uuid.uuid4().hex[:6]}"
    common = [
        "--config", "demo-sft", f"model.path={ensure_tiny_model(tmp_path / 'tiny')}",
        f"trainer.runs_dir={tmp_path / 'runs'}", f"trainer.lineage={lineage}", "trainer.total_steps=2",
        "trainer.save_freq=2", "trainer.test_freq=0", "trainer.log_samples=0", "data.train_batch_size=16",
        "data.val_batch_size=8", "actor.ppo_mini_batch_size=16", "actor.ppo_micro_batch_size_per_gpu=8",
        "actor.optim.lr=1e-9",  # as good as its start model: promoted as the lineage's first version
        "trainer.n_workers=1",  # one actor process fewer in each of its seven runs
    ]  # fmt: skip
    through_proxy = {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{mlflow_proxy.port}"}
    client = MlflowClient()
    root = tmp_path / "runs" / "crashing"

    def state() -> dict:
        found = client.search_model_versions(f"name = '{lineage}'")
        record = RunRecord.read(str(root))
        return {
            "versions": sorted(v.version for v in found),
            "decided": [v.version for v in found if DECISION_TAG in (v.tags or {})],
            "champion": (client.get_registered_model(lineage).aliases or {}).get("champion") if found else None,
            "moves": len(moves(client, lineage)) if found else 0,
            "status": client.get_run(record.mlflow_run_id).info.status if record else None,
            "complete": read_result(str(root)) is not None,
        }

    expected = {
        "registered": {"versions": ["1"], "decided": [], "champion": None, "moves": 0},
        "decided": {"versions": ["1"], "decided": ["1"], "champion": None, "moves": 0},
        "alias moved": {"versions": ["1"], "decided": ["1"], "champion": "1", "moves": 0},
        "published": {"versions": ["1"], "decided": ["1"], "champion": "1", "moves": 1},
    }
    for marker, nth, stands in KILL_POINTS:
        process = rlflow_in_background("train", "sft", *common, "trainer.run_name=crashing", env=through_proxy)
        killed = []

        def kill(sender: int | None, process=process, killed=killed) -> None:
            # the command's process group and the one of the controller that sent the request: a child of the
            # controller fork server, in a group of its own, that would die only a moment later, seeing the command die
            killed.append(sender)
            kill_process_groups(process.pid, sender)

        mlflow_proxy.act_at(marker, kill, nth)
        output, _ = process.communicate(timeout=400)
        assert killed and process.returncode == -signal.SIGKILL, f"not killed at {marker!r}:\n{output[-3000:]}"
        assert killed[0] is not None, "the process that sent the request was not found"
        now = state()
        assert {key: now[key] for key in expected[stands]} == expected[stands], (stands, now, output[-2000:])
        assert now["status"] == "RUNNING" and not now["complete"], now

    done = rlflow("train", "sft", *common, "trainer.run_name=crashing", env=through_proxy)
    output = done.stdout + done.stderr
    assert "registered by an earlier attempt of this run" in output
    assert "finishing the decision an earlier attempt recorded" in output
    assert state() == {
        "versions": ["1"],
        "decided": ["1"],
        "champion": "1",
        "moves": 1,
        "status": "FINISHED",
        "complete": True,
    }
    version = client.get_model_version(lineage, "1")
    assert version.tags["rlflow.promoted"].startswith("first version") and "rejected" not in version.tags
    (move,) = champion_history(client, lineage)
    assert move["version"] == "1" and move["previous"] is None and move["how"] == "promoted by its run"
    first = RunRecord.read(str(root))
    assert version.run_id == first.mlflow_run_id

    rlflow("train", "sft", *common, "trainer.run_name=next")  # the lineage goes on from the published run
    following = RunRecord.read(str(tmp_path / "runs" / "next"))
    assert following.model_uri == f"models:/{lineage}/1" and following.parent_run_id == first.mlflow_run_id
    assert read_result(str(tmp_path / "runs" / "next"))["data_cursor"]["position"] == 4  # batches 3 and 4
    assert client.get_model_version(lineage, "2").tags["rejected"]  # no better than v1: v1 stays champion

    # trainer.lineage_data=from_champion: the rows of the rejected run come again, after the champion's run's rows
    rlflow("train", "sft", *common, "trainer.run_name=again", "trainer.lineage_data=from_champion")
    again = RunRecord.read(str(tmp_path / "runs" / "again"))
    assert again.parent_run_id == first.mlflow_run_id and again.data_cursor["position"] == 2
    assert read_result(str(tmp_path / "runs" / "again"))["data_cursor"]["position"] == 4  # batches 3 and 4 again


def test_a_decision_moves_the_alias_once_and_only_from_the_champion_it_was_made_against(services):
    """Applying a recorded decision twice changes nothing; a decision made against v1 does not move the alias once
    a person moved it to v3 meanwhile (it says why); a run that started from a version rolled back since is not
    promoted; moves written at once by several writers all stay in the history (one tag each: no writer rewrites
    another's)."""
    from concurrent.futures import ThreadPoolExecutor

    from flows.lineages.evaluation import GateDecision
    from flows.lineages.promotion import start_rolled_back
    from flows.lineages.versions import (
        apply_decision,
        decide,
        move_champion,
        promote_by_hand,
        recorded_decision,
        rollback,
    )

    client, name = MlflowClient(), f"decisions-{uuid.uuid4().hex[:6]}"
    client.create_registered_model(name)
    experiment = client.create_experiment(name)
    for _ in range(3):
        run_id = client.create_run(experiment).info.run_id
        client.create_model_version(name, source=f"runs:/{run_id}/model", run_id=run_id)

    first = decide(client, name, "1", "champion", GateDecision(True, "first version", [], None), "promoted by its run",
                   None, "v1's comparison")  # fmt: skip
    assert recorded_decision(client, name, "1") == first
    for _ in range(2):
        assert apply_decision(client, name, "1", "champion", first, {}) == {
            "promoted": True,
            "reason": "first version",
        }
    assert [(m["version"], m["previous"]) for m in champion_history(client, name)] == [("1", None)]

    second = decide(client, name, "2", "champion", GateDecision(True, "better than v1", [], None),
                    "promoted by its run", "1", "v2's comparison")  # fmt: skip
    promote_by_hand(client, name, "champion", "3", "the team trusts v3")  # while v2 waited for its approval
    outcome = apply_decision(client, name, "2", "champion", second, {})
    assert not outcome["promoted"] and "moved from v1 to v3" in outcome["reason"]
    assert client.get_model_version_by_alias(name, "champion").version == "3"
    assert client.get_model_version(name, "2").tags["rejected"] == outcome["reason"]
    assert not recorded_decision(client, name, "2")["promote"]  # a later attempt finishes it as rejected

    # a run that started from v3 is not promoted once v3 was rolled back while it trained, whatever its gate says
    assert start_rolled_back(client, name, f"models:/{name}/3") is None
    rollback(client, name, "champion", "worse in review")
    assert "started from v3, which was rolled back while it trained (worse in review)" in start_rolled_back(
        client, name, f"models:/{name}/3"
    )

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: move_champion(client, name, "champion", str(1 + i % 3), "by hand", f"#{i}"), range(16)))
    history = champion_history(client, name)
    assert len(history) == 3 + 16 and {m["reason"] for m in history[3:]} == {f"#{i}" for i in range(16)}


def test_the_next_run_continues_from_the_run_that_finished_last(services):
    """Two runs of a lineage that overlapped (one started first and finished last): the parent of the next run is
    the one that finished last, whose data cursor is the newer one, not the one that started last."""
    from flows.lineages.lineage import lineage_parent

    client, lineage = MlflowClient(), f"overlap-{uuid.uuid4().hex[:6]}"
    experiment = client.create_experiment(lineage)
    long_run = client.create_run(experiment, start_time=1_000, tags={"rlflow.lineage": lineage}).info.run_id
    short_run = client.create_run(experiment, start_time=2_000, tags={"rlflow.lineage": lineage}).info.run_id
    client.set_terminated(short_run, "FINISHED", end_time=3_000)
    client.set_terminated(long_run, "FINISHED", end_time=4_000)
    assert lineage_parent(client, experiment, lineage).info.run_id == long_run
