"""What a run measures its model with: validation (``validate``: the validation rows, scored by the training reward,
at step 0, every ``trainer.test_freq`` steps and at the end; metrics and sample tables in MLflow) and evaluation
(``evaluate``: the start and the final model on every eval set, its per-example results written to the run folder
and read back by a later attempt). ``evaluate_model`` evaluates another registered model the same way, for the
promotion gate (flows/lineages/promotion.py). The eval sets, their results and the gate are in
``flows/lineages/evaluation.py``."""

from __future__ import annotations

import numpy as np

from flows import stages
from flows.controller.groups import build_group, plan_key, ray_outlives_the_run, release_group, take_kept_groups
from flows.controller.run_state import RunState
from flows.lineages import evaluation, lineage
from rlworkers.agents.trajectory import trajectory_text
from rlworkers.data.batching import decode_responses
from rlworkers.data.chat import conversation_as_prompt
from rlworkers.workers.actor_rollout_ref import ActorRolloutRefWorker
from rlworkers.workers.config import RewardConfig
from rlworkers.workers.reward import RuleReward


def should_validate(run: RunState, step: int) -> bool:
    """Every ``trainer.test_freq`` steps and at the last one (only there when ``test_freq`` <= 0)."""
    freq = run.config.trainer.test_freq
    return step == run.final_step or (freq > 0 and step % freq == 0)


def reference_answers_fit(rows: list[dict], tokenizer, response_length: int, data) -> bool:
    """Whether every row has a reference answer (its ``data.response_key``, or its conversation's last assistant
    turn) and each fits in ``response_length`` tokens with the end of sequence. Then a response cut by the limit is
    one the model has not learned to end (an untrained model never ends), not an answer the limit cut off."""
    answers = []
    for row in rows:
        messages = row.get(data.messages_key) or []
        assistant = [m["content"] for m in messages if isinstance(m, dict) and m.get("role") == "assistant"]
        answer = row.get(data.response_key) or (assistant[-1] if assistant else None)
        if not isinstance(answer, str):
            return False  # e.g. verl's GSM8K rows: a final number as ground truth, not the answer the model writes
        answers.append(answer)
    if not answers:
        return False
    lengths = [len(ids) + 1 for ids in tokenizer(answers, add_special_tokens=False)["input_ids"]]
    return max(lengths) <= response_length


def validate(run: RunState, step: int) -> dict[str, float]:
    """The model at ``step`` on the validation rows (the first ``data.val_batch_size``), greedy and scored by the
    training reward: ``val/...`` metrics and a table of samples in MLflow. At step 0 and at the last step it also
    records the results of the implicit eval set (no ``eval.sets`` configured: the validation rows themselves)."""
    data = run.config.data
    rows = run.inputs.val_rows[: data.val_batch_size or len(run.inputs.val_rows)]
    prompts = run.prompt_batch([conversation_as_prompt(row, data.prompt_key, data.messages_key) for row in rows])
    out = stages.validate.submit(run.groups["actor"], run.groups["reward"], prompts, step).result()
    scores = out.non_tensor_batch["score"].astype(float)
    metrics = {"val/score/mean": float(np.mean(scores)), "timing_s/validate": out.meta_info["timing_s/validate"]}
    for source in sorted(set(out.non_tensor_batch["data_source"])):
        mask = out.non_tensor_batch["data_source"] == source
        metrics[f"val/{source or 'default'}/score/mean"] = float(np.mean(scores[mask]))
    response_mask = out.batch["response_mask"]
    metrics["val/response_length/clip_ratio"] = float((response_mask.sum(-1) == response_mask.shape[-1]).float().mean())
    for key in sorted(k for k in out.non_tensor_batch if k.startswith(("reward_extra/", "agent/"))):
        metrics[f"val/{key}/mean"] = float(np.nanmean(out.non_tensor_batch[key].astype(float)))
    fit = reference_answers_fit(rows, run.tokenizer, run.config.rollout.response_length, data)
    run.warn_if_clipped(f"validation at step {step}", metrics["val/response_length/clip_ratio"], fit)
    responses = decode_responses(out, run.tokenizer)
    columns = zip(out.non_tensor_batch["raw_prompt"], responses, out.non_tensor_batch["ground_truth"], scores)
    samples = [
        {"step": step, "prompt": p, "response": r, "ground_truth": g, "score": float(s)} for p, r, g, s in columns
    ][: run.config.trainer.log_samples]
    for sample, messages in zip(samples, out.non_tensor_batch.get("trajectory", [])):  # multi-turn: every turn
        sample["trajectory"] = trajectory_text(messages)
    if samples:
        run.tracker.log_table(samples, f"samples/step_{step:06d}.json")
    run.tracker.log_metrics(metrics, step)
    run.record_val_score(step, metrics["val/score/mean"])
    implicit = run.inputs.eval_sets[0] if run.inputs.eval_sets and run.inputs.eval_sets[0].scorer is None else None
    if implicit and step in (0, run.final_step):  # validation is the evaluation
        record_results(run, implicit, evaluation.label_of(step), step, out, responses)
    return metrics


def saved_results(run: RunState, label: str) -> dict[str, evaluation.EvalResults] | None:
    """The results of ``label`` on every eval set, read back from the run folder; ``None`` if one is missing."""
    step = 0 if label == "start" else run.final_step
    found = {s.name: evaluation.read_results(run.root, label, s, step) for s in run.inputs.eval_sets}
    return found if all(found.values()) else None


def evaluate(run: RunState, step: int) -> dict[str, evaluation.EvalResults]:
    """The model as it is at ``step`` (0: the start model, the run's ``final_step``: the final one) on every eval
    set, each read back when an earlier attempt already evaluated it (flows/lineages/evaluation.py)."""
    label = evaluation.label_of(step)
    results = {}
    for eval_set in run.inputs.eval_sets:
        saved = evaluation.read_results(run.root, label, eval_set, step)
        if saved is None and eval_set.scorer is None:
            validate(run, step)  # the implicit set is scored by validation, which records it
            saved = evaluation.read_results(run.root, label, eval_set, step)
        if saved is None:
            out = generate_for_eval(run, run.groups["actor"], eval_set, step)
            saved = record_results(run, eval_set, label, step, out, decode_responses(out, run.tokenizer))
            run.tracker.log_metrics({f"eval/{eval_set.name}/score/mean": saved.mean}, step)
        results[eval_set.name] = saved
    return results


def generate_for_eval(run: RunState, group, eval_set, step: int):
    """``group``'s responses on ``eval_set``'s prompts with its decoding settings, scored by its scorer (the
    implicit set: by the training reward, which must then be a rule)."""
    data = run.config.data
    rows = [conversation_as_prompt(row, data.prompt_key, data.messages_key) for row in eval_set.rows]
    reward = RewardConfig(reward_fn=eval_set.scorer) if eval_set.scorer is not None else run.config.reward
    prompts = run.prompt_batch(rows)
    prompts.meta_info.update(eval_set.sampling)
    return stages.evaluate.submit(group, RuleReward(reward, run.record.model_dir), prompts, step).result()


def evaluate_model(run: RunState, uri: str, eval_set, label: str) -> evaluation.EvalResults:
    """Another registered model (a champion with no results made with this run's settings) on ``eval_set``, as
    this run evaluates its own: the same examples, decoding, scorer and worker count, in a rollout-only group of
    its own. The run's workers are let go first (its final model is saved by then). Read back on a restart."""
    step = run.final_step
    saved = evaluation.read_results(run.root, label, eval_set, step)
    if saved is not None:
        return saved
    if eval_set.scorer is None and run.config.reward.reward_model is not None:
        raise ValueError(f"{eval_set.name!r} is scored by a reward model: give eval.sets a rule scorer")
    folder = lineage.download_model(uri, run.tracker.client, lineage.cache_root(run.config))
    keep = ray_outlives_the_run()
    run.release_workers(keep=keep)
    trainer, worker_config = run.config.trainer, run.config.worker_config()
    model = worker_config.model.model_copy(update={"path": folder})
    actor = worker_config.actor.model_copy(update={"lora": type(worker_config.actor.lora)()})  # loads merged
    options = {
        "use_gpu": trainer.device == "cuda",
        "reusable": run.config.rollout.name != "vllm",
        "config": worker_config.model_copy(update={"model": model, "actor": actor}),
        "role": "rollout",
    }
    nodes = run.config.processes_on_nodes("actor")
    (kept,) = take_kept_groups([plan_key(ActorRolloutRefWorker, nodes, options)])
    timeout = (trainer.stage_timeout_s, trainer.stage_timeout_s_per_sample)
    group = build_group(ActorRolloutRefWorker, nodes, timeout=timeout, kept=kept, **options)
    try:
        out = generate_for_eval(run, group, eval_set, step)
    finally:
        release_group(group, keep=keep)
    return record_results(run, eval_set, label, step, out, decode_responses(out, run.tokenizer), model=uri)


def record_results(
    run: RunState, eval_set, label: str, step: int, out, responses: list[str], model: str | None = None
) -> evaluation.EvalResults:
    """Per-example results of one evaluation: into the run folder (resume reads them) and MLflow (a table)."""
    batch = out.non_tensor_batch
    scores = batch["score"].astype(float).tolist()
    prompts, truths = list(batch["raw_prompt"]), list(batch["ground_truth"])
    rows = evaluation.example_rows(prompts, responses, truths, scores, eval_set)
    if model is None:
        model = run.record.model_uri if label == "start" else f"{run.config.trainer.run_name} step {step}"
    results = evaluation.EvalResults(eval_set.name, label, eval_set.fingerprint, model, rows, step)
    evaluation.write_results(run.root, results)
    run.tracker.log_table(rows, f"eval/{eval_set.name}/{label}.json")
    run.tracker.set_tags({f"rlflow.eval.{eval_set.name}.fingerprint": eval_set.fingerprint})
    return results
