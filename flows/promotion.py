"""A lineage's new version: the promotion gate's decision on it (flows/evaluation.py), and a person's when
``trainer.promotion=manual`` asks for one. ``run`` is the run's ``RunState`` (flows/run_state.py), after its final model
was registered."""

from __future__ import annotations

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.input import RunInput
from pydantic import Field

from flows import evaluation, lineage, run_evaluation, versions
from flows.run_state import RunState
from flows.tracking import artifact_key


class PromotionApproval(RunInput):
    """The form a paused run shows in the Prefect UI (``trainer.promotion=manual``)."""

    approve: bool = Field(description="promote this version to the lineage's alias")
    comment: str = Field("", description="why (recorded on the model version and in the champion history)")


def promote(run: RunState, version: str, final: dict[str, evaluation.EvalResults]) -> str:
    """Run the promotion gate on the final model's primary eval results (flows/evaluation.py) against the
    champion as it is now (never a score cached earlier: a resumed run, or one whose champion moved while it
    trained, compares with the current one); ask a person first with ``trainer.promotion=manual``. The decision is
    written on the version before anything acts on it (flows/versions.py): an attempt that finds one there (its
    earlier attempt died while publishing) finishes that decision instead of deciding again."""
    client = run.tracker.client
    name, trainer = lineage.registered_model_name(run.config), run.config.trainer
    record = versions.recorded_decision(client, name, version)
    if record is None:
        record, markdown = decide(run, name, version, final)
    else:
        get_run_logger().info("%s v%s: finishing the decision an earlier attempt recorded", name, version)
        markdown = client.get_model_version(name, version).description or ""
    outcome = versions.apply_decision(client, name, version, trainer.promotion_alias, record, final)
    create_markdown_artifact(
        key=f"{artifact_key(trainer.run_name)}-promotion",
        markdown=markdown,
        description=f"promotion gate of {name} v{version}",
    )
    verdict = f"promoted to @{trainer.promotion_alias}" if outcome["promoted"] else "rejected"
    run.tracker.set_tags(
        {
            "rlflow.promotion": f"v{version} {verdict}: {outcome['reason']}",
            "rlflow.promoted": str(outcome["promoted"]).lower(),
        }
    )
    get_run_logger().info("%s v%s %s: %s", name, version, verdict, outcome["reason"])
    return f"v{version} {verdict}: {outcome['reason']}"


def decide(run: RunState, name: str, version: str, final: dict[str, evaluation.EvalResults]) -> tuple[dict, str]:
    """The gate's decision (and a person's, with ``trainer.promotion=manual``) on ``version``, written on it
    (``versions.decide``); returns it with its markdown."""
    client, trainer, gate = run.tracker.client, run.config.trainer, run.config.eval
    primary = gate.primary_set
    candidate = final[primary]
    start = (run_evaluation.saved_results(run, "start") or {}).get(primary)
    compared_with = lineage.champion_version(client, name, trainer.promotion_alias)
    champion, best = versions.gate_baselines(
        client, name, trainer.promotion_alias, candidate, start, run.record.model_uri, reevaluate_with(run, primary)
    )
    decision = evaluation.gate(
        candidate,
        start=start,
        champion=champion,
        best=best,
        reward_change=reward_change(run),
        promote_if=gate.promote_if,
        confidence=gate.confidence,
        margin=gate.margin,
        hacking_threshold=gate.hacking_threshold,
    )
    rolled_back = start_rolled_back(client, name, run.record.model_uri)
    if decision.promote and rolled_back:
        decision = evaluation.GateDecision(False, rolled_back, decision.comparisons, decision.hacking)
    markdown = evaluation.decision_markdown(name, version, decision, primary)
    if decision.hacking:
        get_run_logger().warning("%s v%s: %s", name, version, decision.hacking)
        run.tracker.set_tags({"rlflow.reward_hacking": decision.hacking})
        client.set_model_version_tag(name, version, "rlflow.reward_hacking", decision.hacking)
    how = "promoted by its run"
    if trainer.promotion == "manual":
        pending = evaluation.decision_markdown(name, version, decision, primary, pending=True)
        decision, how = ask_approval(run, name, version, decision, pending)
        markdown = evaluation.decision_markdown(name, version, decision, primary)
    compared = compared_with.version if compared_with is not None else None
    return versions.decide(client, name, version, trainer.promotion_alias, decision, how, compared, markdown), markdown


def start_rolled_back(client, name: str, start_uri: str) -> str | None:
    """Why a run may not be promoted although the gate says so: the version it started from was rolled back while
    it trained (its training builds on a model the team took back); None otherwise."""
    prefix = f"models:/{name}/"
    if not start_uri.startswith(prefix):
        return None
    tags = client.get_model_version(name, start_uri[len(prefix) :]).tags or {}
    if "rlflow.rolled_back" not in tags:
        return None
    return (
        f"not promoted: this run started from v{start_uri[len(prefix) :]}, which was rolled back while it trained "
        f"({tags['rlflow.rolled_back']})"
    )


def reevaluate_with(run: RunState, set_name: str):
    """How the gate gets results for a champion that has none made with this run's eval settings (its eval set
    changed, or it was promoted by hand from elsewhere): evaluate it now, in this run, and point its eval tags at
    the new results, so the next run of the lineage reuses them."""
    eval_set = next(s for s in run.eval_sets if s.name == set_name)

    def reevaluate(version) -> evaluation.EvalResults:
        get_run_logger().info(
            "champion v%s has no %s results with these settings: evaluating it in this run", version.version, set_name
        )
        uri = f"models:/{version.name}/{version.version}"
        results = run_evaluation.evaluate_model(run, uri, eval_set, label=f"champion_v{version.version}")
        versions.tag_results(run.tracker.client, version.name, version.version, results, run.tracker.run_id)
        return results

    return reevaluate


def reward_change(run: RunState) -> float | None:
    """The training reward's change over the run: validation's ``val/score/mean``, final - start."""
    history = {m.step: m.value for m in run.tracker.client.get_metric_history(run.tracker.run_id, "val/score/mean")}
    total = run.config.trainer.total_steps
    return history[total] - history[0] if 0 in history and total in history else None


def ask_approval(run: RunState, name: str, version: str, decision, markdown: str):
    """``trainer.promotion=manual``: release the workers, pause the flow run with an approve / reject form in
    the Prefect UI (the gate's comparison as its description) and follow the person's answer; no answer within
    ``trainer.approval_timeout_s`` rejects."""
    from prefect.exceptions import FlowPauseTimeout
    from prefect.flow_runs import pause_flow_run

    run.release_workers()  # nothing needs them any more, and a pause may last hours
    recommendation = "promote" if decision.promote else "reject"
    form = PromotionApproval.with_initial_data(
        description=f"{markdown}\n\nApprove to promote {name} v{version} to "
        f"@{run.config.trainer.promotion_alias}, or leave it off to reject it.",
        approve=decision.promote,
    )
    timeout = run.config.trainer.approval_timeout_s
    try:
        answer = pause_flow_run(wait_for_input=form, timeout=int(timeout), poll_interval=2, key=f"promote-v{version}")
    except FlowPauseTimeout:  # the run is still Paused on the server: back to Running, to end it Completed
        from prefect.client.orchestration import get_client
        from prefect.context import FlowRunContext
        from prefect.states import Running

        with get_client(sync_client=True) as client:
            client.set_flow_run_state(FlowRunContext.get().flow_run.id, Running(), force=True)
        reason = f"no approval within trainer.approval_timeout_s={timeout:g} s (the gate recommended: {recommendation})"
        return evaluation.GateDecision(False, reason, decision.comparisons, decision.hacking), "not approved"
    comment = f": {answer.comment}" if answer.comment else ""
    if answer.approve:
        reason = f"approved by a person{comment} (the gate recommended: {recommendation}; {decision.reason})"
        return evaluation.GateDecision(True, reason, decision.comparisons, decision.hacking), "approved by a person"
    reason = f"rejected by a person{comment} (the gate recommended: {recommendation}; {decision.reason})"
    return evaluation.GateDecision(False, reason, decision.comparisons, decision.hacking), "rejected by a person"
