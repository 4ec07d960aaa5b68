"""The promotion gate as a user runs it, on real Prefect and MLflow servers: a lineage of GRPO runs on the tiny
model after an SFT warm-up, evaluated on a held-out set by exact match (not by the training reward). The runs run in
this process, one after another as in a notebook, or as `rlflow train` (a subprocess with its own Ray) where a run is
paused, killed or its terminal output read:

- v1 (a run that changes next to nothing: lr 1e-9) is promoted as the first version, not worse than its start model;
- v2 (honest GRPO) is significantly better than champion v1 on the same examples: promoted;
- v3 (lr 1e-6: the same quality) is not promoted on noise;
- v4 trains on a hackable reward (it pays for 3-character answers, which the evaluation does not count): the
  training reward rises, exact match falls, the alarm goes off and the version is rejected;
- v5 asks a person (trainer.promotion=manual): the run pauses with a form in the Prefect UI (screenshot), is
  resumed through Prefect's API with the form's input as the UI sends it, and the approval moves the champion; a
  run nobody approves within trainer.approval_timeout_s is rejected.

A second lineage: a run killed mid-training resumes after the champion moved, and is compared with the champion of
then (re-evaluated in the run, as its results were made on other examples), with a sampled pass@k set beside.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from in_process import train_here
from mlflow.tracking import MlflowClient
from rlflow_cli import rlflow, rlflow_in_background

from flows.lineages.evaluation import EvalResults
from flows.lineages.versions import champion_history, gate_baselines, version_results

# the module's runs (and the first test, its fixtures' runs) take minutes each; pyproject's 600 s per test was
# calibrated on a CPU with native bf16 and ran out on an AVX2-only one: 1200 s still ends a hung test
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

HACKABLE_REWARD = '''
def score(prompts, responses, **columns):
    """Pays for 3-character answers: a format the exact-match evaluation does not count."""
    return [1.0 if len(r.strip()) >= 3 else 0.0 for r in responses]
'''


@pytest.fixture(scope="module")
def job(sft_warmed_tiny, tmp_path_factory):
    """The demo's SFT-warmed tiny model (conftest's ``sft_warmed_tiny``) and a hackable reward file."""
    folder = tmp_path_factory.mktemp("promotion")
    (folder / "hackable.py").write_text(HACKABLE_REWARD)
    return {
        "folder": folder,
        "runs": folder / "runs",
        "model": sft_warmed_tiny,
        "lineage": f"gate-{uuid.uuid4().hex[:6]}",
    }


def lineage_overrides(job, *overrides: str) -> list[str]:
    return [
        f"model.path={job['model']}", f"trainer.runs_dir={job['runs']}", f"trainer.lineage={job['lineage']}",
        "trainer.run_name=null", "trainer.total_steps=6", "trainer.test_freq=0", "trainer.save_freq=0",
        "trainer.log_samples=0", "eval.sets=[{name: heldout, scorer: exact}]", "trainer.n_workers=1", *overrides,
    ]  # fmt: skip


def lineage_run(job, *overrides: str) -> None:
    """A GRPO run of the job's lineage, in this process (``train_here``)."""
    train_here("grpo", "demo", *lineage_overrides(job, *overrides))


def lineage_command(job, *overrides: str, background: bool = False):
    """The same run as `rlflow train` (a subprocess with its own Ray)."""
    args = ["train", "grpo", "--config", "demo", *lineage_overrides(job, *overrides)]
    return rlflow_in_background(*args) if background else rlflow(*args)


def version(job, number: int):
    return MlflowClient().get_model_version(job["lineage"], str(number))


def champion(job) -> str:
    return MlflowClient().get_model_version_by_alias(job["lineage"], "champion").version


@pytest.fixture(scope="module")
def gated(job):
    """v1..v4 of the lineage, as the module's docstring says."""
    lineage_run(job, "actor.optim.lr=1e-9")
    lineage_run(job, "trainer.total_steps=15")
    lineage_run(job, "actor.optim.lr=1e-6")
    lineage_run(job, "trainer.total_steps=10", f"reward.reward_fn={job['folder'] / 'hackable.py'}:score")
    return job


def test_first_version_then_an_honest_improvement_is_promoted(gated):
    v1, v2 = version(gated, 1), version(gated, 2)
    assert v1.tags["rlflow.promoted"].startswith("first version, non-inferior to the start model")
    assert "significantly" not in v2.tags.get("rejected", "")
    assert v2.tags["rlflow.promoted"].startswith("better than champion v1 (this run's start model)")
    assert float(v2.tags["rlflow.eval.heldout.mean"]) > float(v1.tags["rlflow.eval.heldout.mean"])
    assert v2.tags["rlflow.eval.heldout.n"] == "200"  # the whole held-out split
    assert "| champion v1 (this run's start model) | 200 |" in v2.description and "McNemar p" in v2.description


def test_equal_quality_is_not_promoted(gated):
    v3 = version(gated, 3)
    assert v3.tags["rejected"].startswith("not significantly better than champion v2")
    assert "rlflow.promoted" not in v3.tags


def test_a_hacked_reward_sets_off_the_alarm_and_is_rejected(gated):
    v4 = version(gated, 4)
    assert v4.tags["rejected"].startswith("reward hacking? the training reward rose by +")
    assert v4.tags["rlflow.reward_hacking"] == v4.tags["rejected"]
    client = MlflowClient()
    run = client.get_run(v4.run_id)
    assert run.data.tags["rlflow.reward_hacking"] == v4.tags["rejected"]
    assert run.data.metrics["val/score/mean"] > client.get_metric_history(v4.run_id, "val/score/mean")[0].value
    assert float(v4.tags["rlflow.eval.heldout.mean"]) < float(version(gated, 2).tags["rlflow.eval.heldout.mean"])
    assert champion(gated) == "2"
    # per-example results: a table in MLflow, one row per example with the response and its score
    table = client.download_artifacts(v4.run_id, "eval/heldout/final.json")
    assert Path(table).stat().st_size > 0


def test_the_champions_logged_results_pair_with_a_re_evaluation_example_by_example(gated):
    """The champion's own results (read back from MLflow, made when it was trained) equal run v3's evaluation of
    its start model (the champion, v2) example by example: reusing them by fingerprint compares like with like."""
    client = MlflowClient()
    v2, v3 = version(gated, 2), version(gated, 3)
    fingerprint = v3.tags["rlflow.eval.heldout.fingerprint"]
    logged = version_results(client, v2, "heldout", fingerprint)
    run_three = client.get_run(v3.run_id).info.run_name
    start = EvalResults(**json.loads((gated["runs"] / run_three / "eval/start/heldout.json").read_text()))
    assert [r["score"] for r in logged.rows] == [r["score"] for r in start.rows]
    assert [r["response"] for r in logged.rows] == [r["response"] for r in start.rows]
    assert version_results(client, v2, "heldout", "0" * 16) is None  # another set or settings: never paired
    (versus, best) = gate_baselines(client, gated["lineage"], "champion", start, None, started_from="elsewhere")
    assert versus[0] == "champion v2" and versus[1].scores == start.scores and best is None


def wait_paused(lineage: str, timeout_s: float = 300):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=lineage)))
            paused = [r for r in runs if r.state and r.state.is_paused()]
            if paused:
                return paused[0]
            time.sleep(2)
    raise AssertionError(f"no flow run of {lineage} paused within {timeout_s} s")


def test_manual_promotion_pauses_for_a_person_and_follows_the_answer(gated, services):
    """The pause, the API answer and the timeout run everywhere; the form as a person sees it where chromium is
    (always in CI, where a missing chromium fails the run)."""
    import warnings

    from browser import Browser, chromium
    from prefect.client.orchestration import get_client

    process = lineage_command(gated, "trainer.promotion=manual", "trainer.total_steps=2", background=True)
    try:
        flow_run = wait_paused(gated["lineage"])
        assert flow_run.state.state_details.run_input_keyset  # a form, not a bare pause
        if chromium() or os.environ.get("CI") == "true":
            with Browser(height=1300) as browser:  # what the person sees: the form with the gate's comparison
                browser.open(f"{services['prefect_ui']}/runs/flow-run/{flow_run.id}", flow_run.name)
                browser.click("Resume")
                text = browser.wait_for_text("the gate recommends", timeout_s=30)
                assert "Approve" in text and "Comment" in text and "champion v2" in text
                browser.screenshot("prefect-promotion-approval")
        else:
            warnings.warn("chromium is not installed: the approval form was not looked at (apt-get install chromium)")
        with get_client(sync_client=True) as client:  # what the UI's Submit sends
            client.resume_flow_run(flow_run.id, run_input={"approve": True, "comment": "spot-checked 20 answers"})
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, output[-3000:]
    finally:
        process.kill()
    v5 = version(gated, 5)
    assert v5.tags["rlflow.promoted"].startswith("approved by a person: spot-checked 20 answers (the gate")
    assert champion(gated) == "5"
    assert champion_history(MlflowClient(), gated["lineage"])[-1]["how"] == "approved by a person"
    # nobody answers: rejected when trainer.approval_timeout_s runs out, the champion stays
    lineage_run(gated, "trainer.promotion=manual", "trainer.total_steps=2", "trainer.approval_timeout_s=3")
    v6 = version(gated, 6)
    assert v6.tags["rejected"].startswith("no approval within trainer.approval_timeout_s=3 s")
    assert champion(gated) == "5"


def test_a_resumed_run_is_compared_with_the_champion_of_now_re_evaluated_when_its_results_do_not_pair(gated):
    """v1 is the champion when run R starts; R is killed after its step-2 checkpoint; v2 (evaluated on 60 held-out
    sums, not R's 100) becomes the champion; R resumes from its checkpoint and is gated against v2, which it
    evaluates itself on R's examples (v2 has no results R can pair with), never against R's start model (v1)."""
    moved = {**gated, "lineage": f"moved-{uuid.uuid4().hex[:6]}"}
    other_lineage = champion_history(MlflowClient(), gated["lineage"])
    sets = (
        "eval.sets=[{name: heldout, scorer: exact, max_examples: 100}, "
        "{name: sampled, scorer: exact, max_examples: 40, decoding: sampled, samples: 4, temperature: 1.0, "
        "metric: pass@2}]"
    )
    lineage_run(moved, "actor.optim.lr=1e-9", sets)  # v1, the champion
    resumed = ("trainer.run_name=resumed", "trainer.total_steps=8", "trainer.save_freq=2", sets)
    process = lineage_command(moved, *resumed, background=True)
    try:
        manifest = moved["runs"] / "resumed" / "checkpoints" / "step_2" / "manifest.json"
        deadline = time.monotonic() + 300
        while not manifest.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert manifest.exists(), process.communicate()[0][-3000:] if process.poll() is not None else "no step 2"
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the run and its Ray, as the kernel's OOM killer would
        process.wait()
    assert not (moved["runs"] / "resumed" / "result.json").exists()
    lineage_run(moved, "trainer.total_steps=15", "eval.sets=[{name: heldout, scorer: exact, max_examples: 60}]")
    rlflow("promote", moved["lineage"], "--version", "2", "--reason", "the team trusts v2")
    done = lineage_command(moved, *resumed)  # resumes from its step-2 checkpoint
    output = done.stdout + done.stderr
    assert "steps 3..8" in output and "champion v2 has no heldout results with these settings" in output

    client = MlflowClient()
    v2, v3 = version(moved, 2), version(moved, 3)
    decision = v3.tags.get("rlflow.promoted") or v3.tags["rejected"]
    assert "champion v2 (" in decision and "this run's start model" not in decision, decision
    assert "| champion v2 | 100 |" in v3.description
    # v2's results on R's examples, made in R and reused from now on by every run with these settings
    assert v2.tags["rlflow.eval.heldout.run"] == v3.run_id and v2.tags["rlflow.eval.heldout.n"] == "100"
    again = version_results(client, v2, "heldout", v3.tags["rlflow.eval.heldout.fingerprint"])
    assert len(again.rows) == 100 and again.model == "models:/%s/2" % moved["lineage"]
    # the sampled set: four responses per example, scored by pass@2 (0, 1/2, 5/6 or 1 from 0..4 passing)
    table = json.loads(Path(client.download_artifacts(v3.run_id, "eval/sampled/final.json")).read_text())
    rows = [dict(zip(table["columns"], values)) for values in table["data"]]
    assert len(rows) == 40 and all(len(row["responses"]) == len(row["scores"]) == 4 for row in rows)
    allowed = {0.0, 0.5, round(5 / 6, 6), 1.0}
    assert {round(row["score"], 6) for row in rows} <= allowed
    assert any(0 < row["score"] < 1 for row in rows), "no example with some samples right and some wrong"
    assert champion_history(client, gated["lineage"]) == other_lineage  # lineages never move each other's alias
