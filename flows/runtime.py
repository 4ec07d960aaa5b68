"""``Run``: what every training flow does around its loop, once ``flows.run_start.start_run`` has built it: the
steps left (rewound by recovery, ``flows/recovery.py``), batches, per-step timing and metrics, validation and
evaluation, checkpoints published as Prefect artifacts, the final model published to MLflow (and a lineage's
promotion), and the workers released at the end. The flows themselves (``flows/grpo.py`` ...) stay the algorithm.

Over 450 lines: one class, ``Run``, whose state (steps, groups, loader, tracker) every method reads; start-up,
recovery, groups and rows live in their own modules.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone

import numpy as np
from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact

from flows import evaluation, lineage, promotion
from flows.config import RLConfig
from flows.groups import build_group, release_group
from flows.recovery import STATEFUL_ROLES, recover
from flows.stages import evaluate, save_checkpoint, validate
from flows.tracking import (
    ProgressArtifact,
    Tracker,
    artifact_key,
    publish_checkpoint_artifact,
)
from rlworkers.data.batching import decode_responses, prompt_batch, sft_batch
from rlworkers.data.chat import conversation_as_prompt
from rlworkers.data.datasets import PromptDataLoader
from rlworkers.single_controller.ray import RayWorkerGroup
from rlworkers.workers.actor_rollout_ref import ActorRolloutRefWorker
from rlworkers.workers.config import RewardConfig
from rlworkers.workers.reward import RuleReward

logger = logging.getLogger(__name__)


CLIPPED_WARNING_RATIO = 0.5  # share of responses cut by rollout.response_length above which a run warns


@dataclass
class Run:
    """The state of one training run inside its flow."""

    config: RLConfig
    algorithm: str
    root: str
    tokenizer: object
    loader: PromptDataLoader
    val_rows: list[dict]
    tracker: Tracker
    eval_sets: list[evaluation.EvalSet] = field(default_factory=list)
    groups: dict[str, RayWorkerGroup | RuleReward] = field(default_factory=dict)  # by role (see groups.build_groups)
    start_step: int = 1
    kl_ctrl_state: dict | None = None
    progress: ProgressArtifact | None = None
    terminal: "TerminalProgress | None" = None
    last_metrics: dict = field(default_factory=dict)
    record: lineage.RunRecord | None = None
    val_scores: dict[int, float] = field(default_factory=dict)
    redo_from: int | None = None  # set by recovery: the step the loop goes back to (see step_blocks)
    start_state: dict = field(default_factory=dict)  # where a fault before the first checkpoint rewinds to
    faults: list[str] = field(default_factory=list)
    last_checkpoint: str | None = None  # the newest checkpoint this run committed or restored
    step_started_at: datetime | None = None  # wall clock at the start of the current step's attempt
    ahead: dict[int, object] = field(default_factory=dict)  # step -> its first stage, submitted by the step before
    warned_clipped: bool = False  # a training step's responses were mostly cut by rollout.response_length (said once)

    @property
    def checkpoint_root(self) -> str:
        return f"{self.root}/checkpoints"

    @property
    def steps(self) -> Iterator[int]:
        """The steps left to train; recovery from a fault rewinds them to the restored checkpoint."""
        for (step,) in self.step_blocks(1):
            yield step

    def step_blocks(self, size: int) -> Iterator[list[int]]:
        """The steps left to train, in blocks of at most ``size`` consecutive steps that run as one task (SFT's
        ``trainer.steps_per_task``); a block ends at a step that validates or saves a checkpoint. Recovery from a
        fault rewinds them to the restored checkpoint."""
        next_step, self.redo_from = self.start_step, None
        while next_step <= self.config.trainer.total_steps:
            block = [next_step]
            while len(block) < size and not (self.should_validate(block[-1]) or self.should_save(block[-1])):
                block.append(block[-1] + 1)
            yield block
            next_step = block[-1] + 1
            if self.redo_from is not None:  # the block failed and recovery restored a checkpoint: redo what it lost
                next_step, self.redo_from = self.redo_from, None

    # ------------------------------------------------------------------------------------------ batches
    def next_rows(self) -> list[dict]:
        epoch = self.loader.epoch
        rows = self.loader.next_batch()
        if self.loader.epoch != epoch:
            get_run_logger().warning(
                "the training data is exhausted after epoch %d: starting epoch %d", epoch, self.loader.epoch
            )
        return rows

    def next_prompts(self):
        return self.prompt_batch(self.next_rows())

    def prompt_batch(self, rows: list[dict]):
        data = self.config.data
        return prompt_batch(
            rows,
            self.tokenizer,
            prompt_key=data.prompt_key,
            answer_key=data.answer_key,
            max_prompt_length=data.max_prompt_length,
            truncation=data.truncation,
            chat_template_kwargs=data.apply_chat_template_kwargs,
        )

    def next_sft_batch(self):
        data = self.config.data
        return sft_batch(
            self.next_rows(),
            self.tokenizer,
            prompt_key=data.prompt_key,
            response_key=data.response_key,
            conversation_key=data.messages_key,
            chat_template_kwargs=data.apply_chat_template_kwargs,
        )

    # ------------------------------------------------------------------------------------------ per step
    @contextmanager
    def step(self, step: int, critical_path: list[list[str]]) -> Iterator[dict]:
        """One training step: the body fills the yielded metrics; then they are logged, and validation and the
        checkpoint run when due. If the step fails because a worker died or hung, the run restores its newest
        checkpoint and ``steps`` rewinds to redo what it lost (see ``recover``)."""
        with self.step_block([step], critical_path) as block:
            block.append({})
            yield block[0]

    @contextmanager
    def step_block(self, steps: list[int], critical_path: list[list[str]]) -> Iterator[list[dict]]:
        """``step`` for a block of steps that run as one task (see ``step_blocks``): the body appends each step's
        metrics in order. A step's ``timing_s/step`` is its share of the block's wall time in proportion to its time
        in the workers, so every step of a block shows the block's orchestration overhead fraction."""
        block: list[dict] = []
        start = time.perf_counter()
        if steps[0] not in self.ahead:  # else its first stage started during the step before: keep that one's start
            self.step_started_at = datetime.now(timezone.utc)
        try:
            yield block
            wall = time.perf_counter() - start
            work = [worker_time(metrics, critical_path) for metrics in block]
            for step, metrics, seconds in zip(steps, block, work, strict=True):
                metrics["timing_s/step"] = wall * seconds / sum(work) if sum(work) > 0 else wall / len(steps)
                self.end_step(step, metrics, critical_path)
        except Exception as error:
            recover(self, steps[0], error)

    def log_step(self, step: int, metrics: dict, critical_path: list[list[str]]) -> None:
        """Log a step's metrics with throughput and the controller's share of the step time (see ``worker_time``)."""
        wall, work = metrics["timing_s/step"], worker_time(metrics, critical_path)
        metrics["perf/orchestration_overhead_frac"] = max(0.0, 1.0 - work / wall)
        metrics["perf/worker_time_s"] = work
        if "response_length/mean" in metrics:
            tokens = metrics["response_length/mean"] * self.config.data.train_batch_size * self.config.rollout.n
            metrics["perf/throughput"] = tokens / wall
        if "response_length/clip_ratio" in metrics and not self.warned_clipped:
            self.warned_clipped = self.warn_if_clipped(f"step {step}", metrics["response_length/clip_ratio"])
        self.tracker.log_metrics(metrics, step, wait=False)  # sent in order by MLflow's thread; close() waits
        self.last_metrics = metrics
        if self.progress:
            self.progress.update(step)
        if self.terminal:
            self.terminal.update(step, metrics)
        get_run_logger().info("step %d/%d  %s", step, self.config.trainer.total_steps, _summary(metrics))

    def warn_if_clipped(self, where: str, clip_ratio: float) -> bool:
        """Say so (WARNING) when most responses were cut by ``rollout.response_length`` before they ended: their
        answers are likely missing, and the reward curve stays flat for a reason no metric chart shows at once."""
        if clip_ratio <= CLIPPED_WARNING_RATIO:
            return False
        get_run_logger().warning(
            "%s: %.0f%% of the responses hit rollout.response_length=%d without ending (EOS); their answers may be "
            "cut off. Fix: raise rollout.response_length, or ask for shorter answers",
            where,
            100 * clip_ratio,
            self.config.rollout.response_length,
        )
        return True

    def end_step(self, step: int, metrics: dict, critical_path: list[list[str]]) -> None:
        """Log the step, then validate and checkpoint when they are due."""
        self.log_step(step, metrics, critical_path)
        if self.should_validate(step):
            self.validate(step)
        if self.should_save(step):
            self.save(step)

    @contextmanager
    def training(self):
        """Around a flow's loop: validate a fresh run first; at the end publish the final model; always release the
        workers and close the MLflow run (FAILED on an exception, which then ends the flow run Failed).

        Stage tasks run in the task runner's host actor (flows/task_runner.py), which asks Ray for no CPU: they
        only call the worker groups, whose placement groups hold the resources, so a cluster that lost a node still
        has room to run them. Ray does not re-run a stage task that failed: ``recover`` decides what to redo."""
        status = "FAILED"
        try:
            while self.start_step == 1 and not (0 in self.val_scores and self.saved_results("start")):
                try:
                    if 0 not in self.val_scores:
                        self.validate(step=0)
                    self.evaluate(0)
                except Exception as error:
                    recover(self, 0, error)
            yield
            self.publish()
            status = "FINISHED"
        finally:
            self.close(status)

    def submit_ahead(self, step: int, submit: Callable[[], object]) -> None:
        """Submit ``step``'s first stage (``submit()``) while the step before it still runs, to start as soon as that
        one's last stage ends (``wait_for``) instead of after the flow has heard of it and logged the step. Not when
        a validation or checkpoint is due in between (they need the workers, the data loader and the RNG as the step
        leaves them) or there is no such step. ``step`` takes it with ``submitted_ahead``."""
        before = step - 1
        due = self.should_validate(before) or self.should_save(before)
        if step <= self.config.trainer.total_steps and not due:
            self.ahead[step] = submit()

    def submitted_ahead(self, step: int):
        """The first stage of ``step`` when ``submit_ahead`` submitted it during the step before, else None."""
        return self.ahead.pop(step, None)

    def should_validate(self, step: int) -> bool:
        freq = self.config.trainer.test_freq
        return step == self.config.trainer.total_steps or (freq > 0 and step % freq == 0)

    def should_save(self, step: int) -> bool:
        freq = self.config.trainer.save_freq
        return step == self.config.trainer.total_steps or (freq > 0 and step % freq == 0)

    # ------------------------------------------------------------------------------------------ validation
    def validate(self, step: int) -> dict[str, float]:
        data = self.config.data
        rows = self.val_rows[: data.val_batch_size or len(self.val_rows)]
        prompts = self.prompt_batch([conversation_as_prompt(row, data.prompt_key, data.messages_key) for row in rows])
        out = validate.submit(self.groups["actor"], self.groups["reward"], prompts, step).result()
        scores = out.non_tensor_batch["score"].astype(float)
        metrics = {"val/score/mean": float(np.mean(scores)), "timing_s/validate": out.meta_info["timing_s/validate"]}
        for source in sorted(set(out.non_tensor_batch["data_source"])):
            mask = out.non_tensor_batch["data_source"] == source
            metrics[f"val/{source or 'default'}/score/mean"] = float(np.mean(scores[mask]))
        response_mask = out.batch["response_mask"]
        metrics["val/response_length/clip_ratio"] = float(
            (response_mask.sum(-1) == response_mask.shape[-1]).float().mean()
        )
        for key in sorted(k for k in out.non_tensor_batch if k.startswith("reward_extra/")):
            metrics[f"val/{key}/mean"] = float(np.nanmean(out.non_tensor_batch[key].astype(float)))
        self.warn_if_clipped(f"validation at step {step}", metrics["val/response_length/clip_ratio"])
        responses = decode_responses(out, self.tokenizer)
        columns = zip(out.non_tensor_batch["raw_prompt"], responses, out.non_tensor_batch["ground_truth"], scores)
        samples = [
            {"step": step, "prompt": p, "response": r, "ground_truth": g, "score": float(s)} for p, r, g, s in columns
        ][: self.config.trainer.log_samples]
        if samples:
            self.tracker.log_table(samples, f"samples/step_{step:06d}.json")
        self.tracker.log_metrics(metrics, step)
        self.val_scores[step] = metrics["val/score/mean"]
        implicit = self.eval_sets[0] if self.eval_sets and self.eval_sets[0].scorer is None else None
        if implicit and step in (0, self.config.trainer.total_steps):  # validation is the evaluation
            self.record_results(implicit, evaluation.label_of(step), step, out, responses)
        return metrics

    # ------------------------------------------------------------------------------------------ evaluation
    def saved_results(self, label: str) -> dict[str, evaluation.EvalResults] | None:
        """The results of ``label`` on every eval set, read back from the run folder; ``None`` if one is missing."""
        step = 0 if label == "start" else self.config.trainer.total_steps
        found = {s.name: evaluation.read_results(self.root, label, s, step) for s in self.eval_sets}
        return found if all(found.values()) else None

    def evaluate(self, step: int) -> dict[str, evaluation.EvalResults]:
        """The model as it is at ``step`` (0: the start model, total_steps: the final one) on every eval set, each
        read back when an earlier attempt already evaluated it (flows/evaluation.py)."""
        label = evaluation.label_of(step)
        results = {}
        for eval_set in self.eval_sets:
            saved = evaluation.read_results(self.root, label, eval_set, step)
            if saved is None and eval_set.scorer is None:
                self.validate(step)  # the implicit set is scored by validation, which records it
                saved = evaluation.read_results(self.root, label, eval_set, step)
            if saved is None:
                out = self.generate_for_eval(self.groups["actor"], eval_set, step)
                saved = self.record_results(eval_set, label, step, out, decode_responses(out, self.tokenizer))
                self.tracker.log_metrics({f"eval/{eval_set.name}/score/mean": saved.mean}, step)
            results[eval_set.name] = saved
        return results

    def generate_for_eval(self, group, eval_set, step: int):
        """``group``'s responses on ``eval_set``'s prompts with its decoding settings, scored by its scorer (the
        implicit set: by the training reward, which must then be a rule)."""
        data = self.config.data
        rows = [conversation_as_prompt(row, data.prompt_key, data.messages_key) for row in eval_set.rows]
        reward = RewardConfig(reward_fn=eval_set.scorer) if eval_set.scorer is not None else self.config.reward
        prompts = self.prompt_batch(rows)
        prompts.meta_info.update(eval_set.sampling)
        return evaluate.submit(group, RuleReward(reward, self.record.model_dir), prompts, step).result()

    def evaluate_model(self, uri: str, eval_set, label: str) -> evaluation.EvalResults:
        """Another registered model (a champion with no results made with this run's settings) on ``eval_set``, as
        this run evaluates its own: the same examples, decoding, scorer and worker count, in a rollout-only group of
        its own. The run's workers are let go first (its final model is saved by then). Read back on a restart."""
        step = self.config.trainer.total_steps
        saved = evaluation.read_results(self.root, label, eval_set, step)
        if saved is not None:
            return saved
        if eval_set.scorer is None and self.config.reward.reward_model is not None:
            raise ValueError(f"{eval_set.name!r} is scored by a reward model: give eval.sets a rule scorer")
        folder = lineage.download_model(uri, self.tracker.client, lineage.cache_root(self.config))
        self.release_workers()
        trainer, worker_config = self.config.trainer, self.config.worker_config()
        model = worker_config.model.model_copy(update={"path": folder})
        actor = worker_config.actor.model_copy(update={"lora": type(worker_config.actor.lora)()})  # loads merged
        group = build_group(
            ActorRolloutRefWorker,
            trainer.n_workers,
            use_gpu=trainer.device == "cuda",
            timeout=(trainer.stage_timeout_s, trainer.stage_timeout_s_per_sample),
            config=worker_config.model_copy(update={"model": model, "actor": actor}),
            role="rollout",
        )
        try:
            out = self.generate_for_eval(group, eval_set, step)
        finally:
            release_group(group)
        return self.record_results(eval_set, label, step, out, decode_responses(out, self.tokenizer), model=uri)

    def record_results(
        self, eval_set, label: str, step: int, out, responses: list[str], model: str | None = None
    ) -> evaluation.EvalResults:
        """Per-example results of one evaluation: into the run folder (resume reads them) and MLflow (a table)."""
        batch = out.non_tensor_batch
        scores = batch["score"].astype(float).tolist()
        prompts, truths = list(batch["raw_prompt"]), list(batch["ground_truth"])
        rows = evaluation.example_rows(prompts, responses, truths, scores, eval_set)
        if model is None:
            model = self.record.model_uri if label == "start" else f"{self.config.trainer.run_name} step {step}"
        results = evaluation.EvalResults(eval_set.name, label, eval_set.fingerprint, model, rows, step)
        evaluation.write_results(self.root, results)
        self.tracker.log_table(rows, f"eval/{eval_set.name}/{label}.json")
        self.tracker.set_tags({f"rlflow.eval.{eval_set.name}.fingerprint": eval_set.fingerprint})
        return results

    # ------------------------------------------------------------------------------------------ checkpoints
    def save(self, step: int) -> str:
        state = {
            "step": step,
            "algorithm": self.algorithm,
            "loader": self.loader.state_dict(),
            "kl_ctrl_state": self.kl_ctrl_state,
            "mlflow_run_id": self.tracker.run_id,
            "world_size": self.config.trainer.n_workers,
            "config": self.config.model_dump(mode="json"),
        }
        roles = {name: group for name, group in self.groups.items() if name in ("actor", "critic", "reward")}
        self.tracker.flush()  # the steps up to this one are in MLflow before a resume can start after them
        path, manifest = save_checkpoint.submit(
            self.checkpoint_root, step, roles, state, self.config.trainer.keep_last_checkpoints, self.last_checkpoint
        ).result()
        self.last_checkpoint = path
        publish_checkpoint_artifact(self.config.trainer.run_name, step, path, self.last_metrics)
        self.tracker.log_dict({"path": path, **manifest}, f"checkpoints/step_{step:06d}/manifest.json")
        return path

    def publish(self) -> dict:
        """Evaluate the final model, save it, log (and register) it, promote it in a lineage, record the data
        cursor, and mark the run complete (``result.json``); a Prefect markdown artifact summarises it."""
        total = self.config.trainer.total_steps
        if total not in self.val_scores:  # an attempt that only finishes publishing
            self.validate(total)
        final = self.evaluate(total)
        cursor = self.loader.state_dict()
        result = {
            "run_name": self.config.trainer.run_name,
            "steps": total,
            "val/score/mean": self.val_scores[total],
            **{f"eval/{name}/score/mean": results.mean for name, results in final.items()},
            "data_epoch": cursor["epoch"],
            "data_cursor": cursor,
        }
        self.tracker.set_tags({"rlflow.data_cursor": json.dumps(cursor)})
        path = f"{self.root}/final_model"
        self.groups["actor"].save_model(path)  # with actor.lora: the adapter on its pinned base
        self.tracker.set_tags({"final_model_path": path})
        if self.config.actor.lora.publish_merged:
            merged = f"{self.root}/final_model_merged"
            self.groups["actor"].save_model(merged, merged=True)
            self.tracker.set_tags({"final_merged_model_path": merged})
            if self.config.trainer.log_model:
                info = self.tracker.log_model(merged, name="merged_model")
                self.tracker.set_tags({"final_merged_model_uri": info.model_uri})
        if self.config.trainer.log_model:
            info = self.tracker.log_model(path, register_as=lineage.registered_model_name(self.config))
            result["model_uri"] = info.model_uri
            self.tracker.set_tags({"final_model_uri": info.model_uri})
            if info.registered_model_version:
                result["model_version"] = str(info.registered_model_version)
                self.tracker.set_tags({"rlflow.model_version": result["model_version"]})
        if self.config.trainer.lineage and "model_version" in result:
            result["decision"] = promotion.promote(self, result["model_version"], final)
        lineage.write_result(self.root, result)
        create_markdown_artifact(
            key=f"{artifact_key(self.config.trainer.run_name)}-result",
            markdown=lineage.summary_markdown(self.record, result),
            description=f"result of {self.config.trainer.run_name}",
        )
        return result

    def distinct_groups(self) -> dict[str, RayWorkerGroup]:
        """The worker groups of ``groups``, each once, under its first role (``trainer.colocate_ref``: the reference
        is the actor's group); a ``RuleReward`` has no workers and is not among them."""
        first: dict[int, tuple[str, RayWorkerGroup]] = {}
        for name, group in self.groups.items():
            if isinstance(group, RayWorkerGroup):
                first.setdefault(id(group), (name, group))
        return dict(first.values())

    # ------------------------------------------------------------------------------------------ faults
    def restore(self, path: str, state: dict) -> None:
        """Load the checkpoint at ``path`` (its ``trainer_state.json`` read as ``state``) into every stateful group,
        the data loader and the KL controller; the run continues at the step after it."""
        for role in STATEFUL_ROLES:
            if role in self.groups:
                self.groups[role].load_checkpoint(f"{path}/{role}")
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl_state = state["kl_ctrl_state"]
        self.start_step = state["step"] + 1
        self.last_checkpoint = path

    def close(self, status: str) -> None:
        if self.terminal:
            self.terminal.stop()
        if self.progress:
            self.progress.close()
        self.release_workers()
        self.tracker.finish(status)

    def release_workers(self) -> None:
        """Shut every worker group down and give its placement back (at the end, or before a long pause)."""
        for group in self.distinct_groups().values():
            release_group(group)
        self.groups = {}


class TerminalProgress:
    """A rich progress bar with the step's key metrics, when the flow runs in a terminal."""

    def __init__(self, description: str, total: int, completed: int):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[summary]}"),
            console=Console(stderr=True),
        )
        self.task = self.bar.add_task(description, total=total, completed=completed, summary="")
        self.bar.start()

    def update(self, step: int, metrics: dict) -> None:
        self.bar.update(self.task, completed=step, summary=_summary(metrics))

    def stop(self) -> None:
        self.bar.stop()


# ---------------------------------------------------------------------------------------------- set-up
def worker_time(metrics: dict, critical_path: list[list[str]]) -> float:
    """A step's seconds in its stages' calls along ``critical_path`` (stages listed in order; those in one inner
    list ran concurrently, so their longest counts)."""
    return sum(max(metrics.get(f"timing_s/{stage}", 0.0) for stage in group) for group in critical_path)


def _summary(metrics: dict) -> str:
    keys = (
        "critic/score/mean",
        "sft/loss",
        "actor/pg_loss",
        "actor/kl_loss",
        "val/score/mean",
        "timing_s/step",
        "perf/orchestration_overhead_frac",
    )
    return "  ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)
