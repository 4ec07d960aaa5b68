"""A lineage's new version: the promotion gate's decision on it (flows/lineages/evaluation.py), and a person's when
``trainer.promotion=manual`` asks for one. What the gate weighs comes from the run that trained it (a ``Candidate``,
built by ``flows/controller/run_publish.py`` after the final model was registered); nothing here drives workers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.input import RunInput
from pydantic import Field

from flows.config import RLConfig
from flows.lineages import evaluation, lineage, versions
from flows.plumbing.tracking import Tracker, artifact_key


@dataclass(frozen=True)
class Candidate:
    """A lineage's new version and what the gate weighs it with: its run's final results on every eval set, the
    start model's (None when one is missing) and that model's URI, how a champion with no results made with this run's
    settings gets some (``reevaluate(version)``: evaluated in this run), and what to let go before a pause for a
    person (``release_workers``)."""

    version: str
    final: dict[str, evaluation.EvalResults]
    start: dict[str, evaluation.EvalResults] | None
    start_uri: str
    reevaluate: Callable[[object], evaluation.EvalResults]
    release_workers: Callable[[], None]


class PromotionApproval(RunInput):
    """The form a paused run shows in the Prefect UI (``trainer.promotion=manual``)."""

    approve: bool = Field(description="promote this version to the lineage's alias")
    comment: str = Field("", description="why (recorded on the model version and in the champion history)")


def promote(config: RLConfig, tracker: Tracker, candidate: Candidate) -> str:
    """Run the promotion gate on the final model's primary eval results (flows/lineages/evaluation.py) against the
    champion as it is now (never a score cached earlier: a resumed run, or one whose champion moved while it
    trained, compares with the current one); ask a person first with ``trainer.promotion=manual``. The decision is
    written on the version before anything acts on it (flows/lineages/versions.py): an attempt that finds one there (its
    earlier attempt died while publishing) finishes that decision instead of deciding again."""
    client, version = tracker.client, candidate.version
    name, trainer = lineage.registered_model_name(config), config.trainer
    record = versions.recorded_decision(client, name, version)
    if record is None:
        record, markdown = decide(config, tracker, name, candidate)
    else:
        get_run_logger().info("%s v%s: finishing the decision an earlier attempt recorded", name, version)
        markdown = client.get_model_version(name, version).description or ""
    outcome = versions.apply_decision(client, name, version, trainer.promotion_alias, record, candidate.final)
    create_markdown_artifact(
        key=f"{artifact_key(trainer.run_name)}-promotion",
        markdown=markdown,
        description=f"promotion gate of {name} v{version}",
    )
    verdict = f"promoted to @{trainer.promotion_alias}" if outcome["promoted"] else "rejected"
    tracker.set_tags(
        {
            "rlflow.promotion": f"v{version} {verdict}: {outcome['reason']}",
            "rlflow.promoted": str(outcome["promoted"]).lower(),
        }
    )
    get_run_logger().info("%s v%s %s: %s", name, version, verdict, outcome["reason"])
    return f"v{version} {verdict}: {outcome['reason']}"


def decide(config: RLConfig, tracker: Tracker, name: str, candidate: Candidate) -> tuple[dict, str]:
    """The gate's decision (and a person's, with ``trainer.promotion=manual``) on the candidate, written on its
    version (``versions.decide``); returns it with its markdown."""
    client, trainer, gate = tracker.client, config.trainer, config.eval
    primary, version = gate.primary_set, candidate.version
    final = candidate.final[primary]
    start = (candidate.start or {}).get(primary)
    compared_with = lineage.champion_version(client, name, trainer.promotion_alias)
    champion, best = versions.gate_baselines(
        client, name, trainer.promotion_alias, final, start, candidate.start_uri, candidate.reevaluate
    )
    decision = evaluation.gate(
        final,
        start=start,
        champion=champion,
        best=best,
        reward_change=reward_change(tracker),
        promote_if=gate.promote_if,
        confidence=gate.confidence,
        margin=gate.margin,
        hacking_threshold=gate.hacking_threshold,
    )
    rolled_back = start_rolled_back(client, name, candidate.start_uri)
    if decision.promote and rolled_back:
        decision = evaluation.GateDecision(False, rolled_back, decision.comparisons, decision.hacking)
    markdown = evaluation.decision_markdown(name, version, decision, primary)
    if decision.hacking:
        get_run_logger().warning("%s v%s: %s", name, version, decision.hacking)
        tracker.set_tags({"rlflow.reward_hacking": decision.hacking})
        client.set_model_version_tag(name, version, "rlflow.reward_hacking", decision.hacking)
    how = "promoted by its run"
    if trainer.promotion == "manual":
        pending = evaluation.decision_markdown(name, version, decision, primary, pending=True)
        decision, how = ask_approval(config, candidate, name, decision, pending)
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


def reward_change(tracker: Tracker) -> float | None:
    """The training reward's change over the run: validation's ``val/score/mean``, final (the last validation: the
    run's last step) - start."""
    history = {m.step: m.value for m in tracker.client.get_metric_history(tracker.run_id, "val/score/mean")}
    return history[max(history)] - history[0] if 0 in history and len(history) > 1 else None


def ask_approval(config: RLConfig, candidate: Candidate, name: str, decision, markdown: str):
    """``trainer.promotion=manual``: release the workers, pause the flow run with an approve / reject form in
    the Prefect UI (the gate's comparison as its description) and follow the person's answer; no answer within
    ``trainer.approval_timeout_s`` rejects."""
    from prefect.exceptions import FlowPauseTimeout
    from prefect.flow_runs import pause_flow_run

    candidate.release_workers()  # nothing needs them any more, and a pause may last hours
    version = candidate.version
    recommendation = "promote" if decision.promote else "reject"
    form = PromotionApproval.with_initial_data(
        description=f"{markdown}\n\nApprove to promote {name} v{version} to "
        f"@{config.trainer.promotion_alias}, or leave it off to reject it.",
        approve=decision.promote,
    )
    timeout = config.trainer.approval_timeout_s
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
