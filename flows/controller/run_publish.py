"""The end of a run that trained all its steps (``publish``): its final model validated and evaluated, saved to the
run folder, logged (and registered) in MLflow, promoted in a lineage (flows/lineages/promotion.py), the data cursor
recorded for the lineage's next run, and the run marked complete (``result.json``, which a later attempt reads as
"nothing to do") with a Prefect markdown artifact that summarises it.

Publishing may die anywhere (a kill, a lost machine); the run's next attempt publishes again, and each step
recognises what an earlier attempt did: the model version this MLflow run registered is found, not registered
again; a decision recorded on it is finished, not made again (flows/lineages/versions.py); the MLflow run is FINISHED
before ``result.json`` is written, so a run marked complete is always one the lineage's next run can continue."""

from __future__ import annotations

import json
import time

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact

from flows.controller import run_evaluation
from flows.controller.run_state import RunState
from flows.lineages import evaluation, lineage, promotion, versions
from flows.plumbing.tracking import artifact_key


def publish(run: RunState) -> dict:
    """Evaluate the final model, save it, log (and register) it, promote it in a lineage, record the data
    cursor, and mark the run complete (``result.json``); a Prefect markdown artifact summarises it."""
    started = time.perf_counter()
    total = run.final_step
    if total not in run.val_scores:  # an attempt that only finishes publishing
        run_evaluation.validate(run, total)
    final = run_evaluation.evaluate(run, total)
    cursor = run.loader.state_dict()
    result = {
        "run_name": run.config.trainer.run_name,
        "steps": total,
        "val/score/mean": run.val_scores[total],
        **{f"eval/{name}/score/mean": results.mean for name, results in final.items()},
        "data_epoch": cursor["epoch"],
        "data_cursor": cursor,
    }
    run.tracker.set_tags({"rlflow.data_cursor": json.dumps(cursor)})
    path = f"{run.root}/final_model"
    run.groups["actor"].save_model(path)  # with actor.lora: the adapter on its pinned base
    write_model_card(run, path)
    run.tracker.set_tags({"final_model_path": path})
    if run.config.actor.lora.publish_merged:
        merged = f"{run.root}/final_model_merged"
        run.groups["actor"].save_model(merged, merged=True)
        write_model_card(run, merged)
        run.tracker.set_tags({"final_merged_model_path": merged})
        if run.config.trainer.log_model:
            info = run.tracker.log_model(merged, name="merged_model")
            run.tracker.set_tags({"final_merged_model_uri": info.model_uri})
    if run.config.trainer.log_model:
        result.update(log_final_model(run, path))
    if run.config.trainer.lineage and "model_version" in result:
        result["decision"] = promotion.promote(run.config, run.tracker, candidate(run, result["model_version"], final))
    create_markdown_artifact(
        key=f"{artifact_key(run.config.trainer.run_name)}-result",
        markdown=lineage.summary_markdown(run.record, result),
        description=f"result of {run.config.trainer.run_name}",
    )
    run.tracker.log_metrics({"timing_s/publish": time.perf_counter() - started}, total)
    run.tracker.finish("FINISHED")  # before result.json: a run marked complete is one the lineage can continue
    lineage.write_result(run.root, result)
    return result


def candidate(run: RunState, version: str, final: dict[str, evaluation.EvalResults]) -> promotion.Candidate:
    """The run's registered ``version`` as the promotion gate weighs it (flows/lineages/promotion.py): its final and
    start results, where it started, and how the gate gets results for a champion that has none made with this
    run's eval settings (its eval set changed, or it was promoted by hand from elsewhere): evaluate it now, in this
    run, and point its eval tags at the new results, so the next run of the lineage reuses them."""
    primary = run.config.eval.primary_set
    eval_set = next(s for s in run.inputs.eval_sets if s.name == primary)

    def reevaluate(champion) -> evaluation.EvalResults:
        get_run_logger().info(
            "champion v%s has no %s results with these settings: evaluating it in this run", champion.version, primary
        )
        uri = f"models:/{champion.name}/{champion.version}"
        results = run_evaluation.evaluate_model(run, uri, eval_set, label=f"champion_v{champion.version}")
        versions.tag_results(run.tracker.client, champion.name, champion.version, results, run.tracker.run_id)
        return results

    start = run_evaluation.saved_results(run, "start")
    return promotion.Candidate(version, final, start, run.record.model_uri, reevaluate, run.release_workers)


def write_model_card(run: RunState, folder: str) -> None:
    """The saved model's card (``README.md``): the license and base model of the run's start model, and how it was
    trained. MLflow logs it with the model."""
    from rlworkers.models.cards import write_model_card as write_card
    from rlworkers.models.loading import model_card_data

    config = run.config
    data = {"tags": ["rlflow", run.algorithm], **model_card_data(config.model.path)}
    description = f"{run.algorithm} with rlflow for {run.final_step} steps, from `{config.model.path}`."
    write_card(folder, data, config.trainer.run_name, description)


def log_final_model(run: RunState, path: str) -> dict:
    """Log (and register) the final model, once: when an earlier attempt of this run already registered a version
    (it died before finishing to publish, maybe before it heard back from MLflow), that version is the run's."""
    name = lineage.registered_model_name(run.config)
    client, run_id = run.tracker.client, run.tracker.run_id
    registered = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'") if name else []
    if registered and not run.config.trainer.republish:
        version = min(registered, key=lambda v: int(v.version))
        get_run_logger().info("%s v%s: registered by an earlier attempt of this run", name, version.version)
        found = {"model_uri": version.source, "model_version": str(version.version)}
    else:
        info = run.tracker.log_model(path, register_as=name)
        found = {"model_uri": info.model_uri}
        if info.registered_model_version:
            found["model_version"] = str(info.registered_model_version)
    run.tracker.set_tags(
        {"final_model_uri": found["model_uri"]}
        | ({"rlflow.model_version": found["model_version"]} if "model_version" in found else {})
    )
    return found
