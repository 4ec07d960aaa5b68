"""What every training flow does around its loop: check the services, build the worker groups in the flow
process, load data, open (or resume) the MLflow run, resume from the newest valid checkpoint, validate, save
checkpoints and publish them as Prefect artifacts. The flows themselves (``flows/grpo.py`` ...) stay the algorithm.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Iterator

import fsspec
import numpy as np
from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.exceptions import UnfinishedRun

from flows import evaluation, lineage, promotion
from flows.config import RLConfig, flatten, runs_root
from flows.stages import evaluate, save_checkpoint, validate
from flows.tracking import (
    ProgressArtifact,
    Tracker,
    artifact_key,
    failed_stages,
    prefect_flow_run_links,
    publish_checkpoint_artifact,
    publish_mlflow_link,
)
from rlworkers.checkpoint import (
    CheckpointSaveError,
    find_latest_checkpoint,
    read_json,
    resolve_resume,
    write_json,
)
from rlworkers.data.batching import TokenCache, decode_responses, prompt_batch, sft_batch
from rlworkers.data.chat import conversation_as_prompt
from rlworkers.data.datasets import PromptDataLoader, load_prompt_dataset
from rlworkers.data.synthetic import ensure_addition_dataset
from rlworkers.models import lora
from rlworkers.models.loading import base_model_path, load_tokenizer, resolve_model_path
from rlworkers.single_controller import PlacementError
from rlworkers.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from rlworkers.storage import is_remote, storage_env
from rlworkers.workers.actor_rollout_ref import ActorRolloutRefWorker
from rlworkers.workers.config import RewardConfig
from rlworkers.workers.critic import CriticWorker
from rlworkers.workers.reward import RewardWorker, RuleReward

logger = logging.getLogger(__name__)


STATEFUL_ROLES = ("actor", "critic", "reward")  # the roles whose state a checkpoint holds
CLIPPED_WARNING_RATIO = 0.5  # share of responses cut by rollout.response_length above which a run warns


class FaultBudgetExhausted(RuntimeError):
    """More worker faults than ``trainer.max_restarts``; ``faults`` lists each one."""

    def __init__(self, message: str, faults: list[str]):
        self.faults = faults
        super().__init__(message)

    def __reduce__(self):
        return type(self), (str(self), self.faults)


class StepFailed(RuntimeError):
    """A step failed with every worker alive (a bug or bad data, which a restart would repeat)."""


def build_group(
    cls,
    n: int,
    *,
    use_gpu: bool,
    cpus_per_worker: float = 1.0,
    timeout: tuple[float, float] | None = None,
    **init_kwargs,
) -> RayWorkerGroup:
    pool = RayResourcePool([n], use_gpu=use_gpu, max_colocate_count=1, cpus_per_worker=cpus_per_worker)
    worker_cls = RayClassWithInitArgs(cls=cls, **init_kwargs)
    if env := storage_env():  # workers write checkpoints straight to the store
        worker_cls.update_options({"runtime_env": {"env_vars": env}})
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=worker_cls)
    if timeout:
        group.set_call_timeout(*timeout)
    group.init_model()
    return group


def release_group(group: RayWorkerGroup) -> None:
    """End a group's actors and give its placement back."""
    group.shutdown()
    if group.resource_pool is not None:
        group.resource_pool.remove()


def dataset_rows(config: RLConfig, split: str, tokenizer=None) -> list[dict]:
    """Rows of a split: the configured files (validation falls back to the training files, with a warning), or
    the built-in task's split. With ``tokenizer``, every prompt is checked against ``data.max_prompt_length``."""
    files = config.data.train_files if split == "train" else config.data.val_files
    if split != "train" and not files and config.data.train_files:
        logger.warning("data.val_files is not set: validating on data.train_files")
        files = config.data.train_files
    if files:
        return read_rows(config, files, tokenizer)
    task_cfg = config.data.task
    style = "" if task_cfg.prompt_format == "plain" else f"-{task_cfg.prompt_format}"
    folder = f"{task_cfg.name}-{task_cfg.max_digits}d-{task_cfg.seed}{style}"
    paths = ensure_addition_dataset(
        f"{config.trainer.runs_dir.rstrip('/')}/_data/{folder}",
        num_train=task_cfg.num_train,
        num_val=task_cfg.num_val,
        max_digits=task_cfg.max_digits,
        seed=task_cfg.seed,
        prompt_format=task_cfg.prompt_format,
    )
    return read_rows(config, [paths[split]], tokenizer, keys={"prompt_key": "prompt"})


def read_rows(config: RLConfig, files: list[str], tokenizer=None, keys: dict | None = None) -> list[dict]:
    """Rows of data files, each prompt checked against ``data.max_prompt_length`` when ``tokenizer`` is given;
    ``keys``: the built-in task's columns instead of ``data.prompt_key`` / ``data.messages_key``."""
    data = config.data
    limit = {"tokenizer": tokenizer, "max_prompt_length": data.max_prompt_length} if tokenizer else {}
    formats = {"truncation": data.truncation, "chat_template_kwargs": data.apply_chat_template_kwargs}
    keys = keys or {"prompt_key": data.prompt_key, "conversation_key": data.messages_key}
    return load_prompt_dataset(files, **keys, **limit, **formats)


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
    groups: dict[str, RayWorkerGroup | RuleReward] = field(default_factory=dict)  # by role (see _build_groups)
    start_step: int = 1
    kl_ctrl_state: dict | None = None
    progress: ProgressArtifact | None = None
    terminal: "TerminalProgress | None" = None
    last_metrics: dict = field(default_factory=dict)
    record: lineage.RunRecord | None = None
    val_scores: dict[int, float] = field(default_factory=dict)
    next_step: int = 1
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
        self.next_step = self.start_step
        total = self.config.trainer.total_steps
        while self.next_step <= total:
            block = [self.next_step]
            while len(block) < size and not (self.should_validate(block[-1]) or self.should_save(block[-1])):
                block.append(block[-1] + 1)
            self.next_step = block[-1] + 1
            yield block

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
            self.recover(steps[0], error)

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

        Stage tasks ask Ray for no CPU: they only call the worker groups, whose placement groups hold the
        resources, so a cluster that lost a node still has room to run them. Ray does not re-run a stage task
        whose node died (``max_retries=0``): ``recover`` decides what to redo. (On ``WarmRayTaskRunner`` the tasks
        run in its host actor, which asks for no resources and gets this process's service and object-store
        settings from ``host_env``.)"""
        from prefect_ray.context import remote_options

        status = "FAILED"
        try:
            with remote_options(num_cpus=0, max_retries=0):
                while self.start_step == 1 and not (0 in self.val_scores and self.saved_results("start")):
                    try:
                        if 0 not in self.val_scores:
                            self.validate(step=0)
                        self.evaluate(0)
                    except Exception as error:
                        self.recover(0, error)
                yield
                self.publish()
            status = "FINISHED"
        finally:
            self.close(status)

    def runs_ahead(self, step: int) -> bool:
        """Whether the next step's first stage may be submitted while ``step``'s last one runs, to start as soon as
        that one ends (``wait_for``) instead of after the flow has heard of it and logged the step: not when a
        validation or checkpoint is due after ``step`` (they need the workers, the data loader and the RNG as the
        step leaves them) or ``step`` is the last."""
        return step < self.config.trainer.total_steps and not (self.should_validate(step) or self.should_save(step))

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
    def recover(self, step: int, error: Exception) -> None:
        """After a failed step: replace the workers that died or hung, restore every stateful group from the
        newest valid checkpoint (or the start) and rewind ``steps``, at most ``trainer.max_restarts`` times.

        Raises the step's error when every worker is alive (a restart would repeat it) or when the checkpoint
        store failed (a restart could not restore from it either), and ``FaultBudgetExhausted`` past the budget."""
        if isinstance(error, CheckpointSaveError):
            raise error  # the store failed, not a worker (a rank may still be stuck in its write): no restart
        started = time.perf_counter()
        self.ahead.clear()  # submitted after the failed stage: they never run (NotReady), and steps rewind
        lost = {name: ranks for name, group in self.distinct_groups().items() if (ranks := group.unresponsive_ranks())}
        failures = failed_stages(step, since=self.step_started_at) or [f"{type(error).__name__}: {error}"]
        if not lost:
            if isinstance(error, UnfinishedRun):  # a stage before this one failed: say which, and why
                raise StepFailed(f"step {step} failed with every worker alive: " + "; ".join(failures)) from error
            raise error
        where = ", ".join(f"{name} rank(s) {ranks}" for name, ranks in lost.items())
        self.faults.append(f"step {step}: {where} lost; " + "; ".join(failures))
        budget = self.config.trainer.max_restarts
        if len(self.faults) > budget:
            listed = "\n".join(f"  {i}. {fault}" for i, fault in enumerate(self.faults, 1))
            raise FaultBudgetExhausted(
                f"run {self.config.trainer.run_name!r} hit {len(self.faults)} worker "
                f"faults, more than trainer.max_restarts={budget}:\n{listed}",
                self.faults,
            ) from error
        log = get_run_logger()
        log.warning("step %d: %s lost (%s); restart %d of %d", step, where, failures[0], len(self.faults), budget)
        checkpoint = find_latest_checkpoint(self.checkpoint_root, required=["trainer_state.json"])
        rebuild = set(lost) if checkpoint else set(lost) | (set(STATEFUL_ROLES) & set(self.distinct_groups()))
        try:
            for name in sorted(rebuild):
                self._restart_group(name)
            if checkpoint:
                _restore(self, checkpoint[0], read_json(f"{checkpoint[0]}/trainer_state.json"))
            else:
                self.loader.load_state_dict(self.start_state["loader"])
                self.kl_ctrl_state, self.start_step = self.start_state["kl_ctrl_state"], 1
        except Exception as during_recovery:  # another worker lost while recovering: one more fault
            self.recover(step, during_recovery)
            return
        self.next_step = self.start_step
        seconds = time.perf_counter() - started
        self.tracker.log_metrics({"fault/restarts": len(self.faults), "fault/recovery_s": seconds}, step)
        if self.progress:
            self.progress.update(self.start_step - 1, restarts=len(self.faults))
        log.warning(
            "recovered in %.1f s: rebuilt %s, resuming at step %d from %s",
            seconds,
            sorted(rebuild),
            self.start_step,
            checkpoint[0] if checkpoint else "the start model",
        )

    def _restart_group(self, name: str) -> None:
        """New actors for one group, waiting up to ``trainer.capacity_timeout_s`` for room (a lost node)."""
        group = self.groups[name]
        deadline = time.monotonic() + self.config.trainer.capacity_timeout_s
        while True:
            try:
                group.restart()
                break
            except PlacementError as error:
                if time.monotonic() > deadline:
                    raise
                get_run_logger().warning(
                    "waiting for capacity to restart %s (up to trainer.capacity_timeout_s=%.0f s): %s",
                    name,
                    self.config.trainer.capacity_timeout_s,
                    error,
                )
        group.init_model()

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


def start_run(config: RLConfig, algorithm: str, *, roles: tuple[str, ...]) -> Run:
    """Name the run, pin what it starts from (first attempt) or read that back (later attempts), open its MLflow
    run, build the worker groups (``roles`` among actor, ref, reward, critic) and resume its newest checkpoint.

    Raises:
        RunAlreadyComplete: the run already trained all its steps and published them (``trainer.republish``).
        RestartBudgetExhausted: the flow run crashed more than ``trainer.max_crash_restarts`` times.
        ModelReferenceError: ``model.path`` names an MLflow model that does not exist.
    """
    from flows.preflight import require_mlflow_tracking, require_prefect_api

    if algorithm != "sft" and config.trainer.steps_per_task != 1:
        raise ValueError(
            f"trainer.steps_per_task={config.trainer.steps_per_task} applies to SFT only: {algorithm} runs each "
            "stage of a step as a task of its own; set it to 1"
        )
    require_prefect_api()
    require_mlflow_tracking()
    check_runs_dir_writable(config)
    reap_orphaned_ray_agents()
    _flow_task_runner().start_ray(*ray_settings(config.trainer.ray_address, config.trainer.ray_num_cpus))
    config = config.model_copy(
        update={"trainer": config.trainer.model_copy(update={"run_name": lineage.run_name(config, algorithm)})}
    )
    name = config.trainer.run_name
    root = runs_root(config)
    crashes = lineage.check_restart_budget(config.trainer.max_crash_restarts)
    links = prefect_flow_run_links()
    record = lineage.RunRecord.read(root)
    same_flow_run = record is not None and record.prefect_flow_run_id == links.get("prefect.flow_run_id")
    if record and config.trainer.resume == "never" and not same_flow_run:
        raise RuntimeError(
            f"run {name!r} already exists under {root}; use trainer.resume=auto to continue it, or "
            "choose another trainer.run_name"
        )
    # resume=never means "do not continue another run": a later attempt of this flow run still resumes its own.
    resume = resolve_resume(f"{root}/checkpoints", "auto" if same_flow_run else config.trainer.resume)
    state = read_json(f"{resume[0]}/trainer_state.json") if resume else None
    if state:
        check_checkpoint_fits(resume[0], state, config, algorithm, record.model_dir if record else None)
    if (
        state
        and state["step"] >= config.trainer.total_steps
        and lineage.read_result(root)
        and not config.trainer.republish
    ):
        raise lineage.RunAlreadyComplete(
            f"run {name!r} already trained its {config.trainer.total_steps} steps and published its result "
            f"({root}/result.json): nothing to do. Raise trainer.total_steps to train it further, set "
            "trainer.republish=true to publish it again, or start a new run (another trainer.run_name, or a "
            "lineage's next run)."
        )

    if record is None:  # nothing is written before the start model and the data have checked out
        model_uri, model_dir = _start_model(config)
    else:
        model_uri, model_dir = record.model_uri, record.model_dir
    tokenizer = TokenCache(load_tokenizer(model_dir))  # the length check below tokenizes every prompt once
    checked = tokenizer if algorithm != "sft" else None  # SFT rows are prompt + response, cut by the tokenizer
    train_rows, val_rows = dataset_rows(config, "train", checked), dataset_rows(config, "validation", checked)
    eval_sets = evaluation.resolve_sets(config, val_rows, lambda files: read_rows(config, files, checked))
    for eval_set in eval_sets:  # a scorer that does not load fails here, before any worker starts
        if eval_set.scorer is not None:
            RuleReward(RewardConfig(reward_fn=eval_set.scorer), model_dir).load()

    experiment = config.trainer.lineage or config.trainer.project_name
    tags = {
        "algorithm": algorithm,
        **links,
        **({"rlflow.lineage": config.trainer.lineage} if config.trainer.lineage else {}),
    }
    if record is None:
        tracker, record = _new_record(
            config, algorithm, experiment, tags, links.get("prefect.flow_run_id"), model_uri, model_dir
        )
    else:
        tracker = Tracker(experiment, name, run_id=record.mlflow_run_id, tags=tags)
    tracker.log_params(flatten(config))
    publish_mlflow_link(name, tracker.url)

    loader = PromptDataLoader(
        train_rows, batch_size=config.data.train_batch_size, shuffle=config.data.shuffle, seed=config.trainer.seed
    )
    run = Run(
        config=config,
        algorithm=algorithm,
        root=root,
        tokenizer=tokenizer,
        loader=loader,
        val_rows=val_rows,
        tracker=tracker,
        eval_sets=eval_sets,
        record=record,
    )
    if record.data_cursor and not resume:
        get_run_logger().info(
            "lineage %s: %s", config.trainer.lineage, lineage.continue_data_cursor(loader, record.data_cursor)
        )
    run.start_state = {"loader": loader.state_dict(), "kl_ctrl_state": None}
    if "actor" in roles:  # a target module the model lacks, or a start adapter with other settings: fail here
        lora.check_fits(resolve_model_path(record.model_dir), config.actor.lora)
    run.groups = _build_groups(config, roles, record.model_dir)
    if resume:
        _restore(run, resume[0], state)
    run.progress = ProgressArtifact(name, config.trainer.total_steps)
    if sys.stderr.isatty():
        run.terminal = TerminalProgress(f"{algorithm} {name}", config.trainer.total_steps, run.start_step - 1)
    get_run_logger().info(
        "%s run %r from %s: steps %d..%d, MLflow %s%s%s",
        algorithm,
        name,
        record.model_uri,
        run.start_step,
        config.trainer.total_steps,
        tracker.url,
        f" (resumed from {resume[0]})" if resume else "",
        f" (attempt after {crashes} crash(es))" if crashes else "",
    )
    return run


class CheckpointMismatch(RuntimeError):
    """A checkpoint this run would resume was written by another algorithm, model or number of workers."""


def check_checkpoint_fits(
    path: str, state: dict, config: RLConfig, algorithm: str, start_model: str | None = None
) -> None:
    """Refuse, before any worker starts, a checkpoint that this run cannot continue; a LoRA checkpoint also when
    the weights of the base it was trained on are not those of this run's base (``start_model``'s)."""
    saved = state.get("config", {})
    problems = []
    if state.get("algorithm") != algorithm:
        problems.append(f"it is a {state.get('algorithm')} checkpoint and this is the {algorithm} flow")
    if state.get("world_size") not in (None, config.trainer.n_workers):
        problems.append(
            f"it was written by {state['world_size']} actor workers and this run has "
            f"trainer.n_workers={config.trainer.n_workers}"
        )
    saved_model = saved.get("model", {}).get("path")
    if saved_model not in (None, config.model.path):
        problems.append(f"it trains model.path={saved_model!r} and this run names {config.model.path!r}")
    saved_lora = saved.get("actor", {}).get("lora", {}).get("rank", 0)
    if saved_lora != config.actor.lora.rank:
        problems.append(f"it was trained with actor.lora.rank={saved_lora} and this run has {config.actor.lora.rank}")
    elif saved_lora and start_model is not None:
        problems += _lora_base_problems(f"{path}/actor", start_model)
    if problems:
        raise CheckpointMismatch(
            f"cannot resume {path}: {'; '.join(problems)}. Fix: use the settings the run was started with, or start "
            "a new run (another trainer.run_name, or trainer.resume=never)."
        )


def _lora_base_problems(adapter_dir: str, start_model: str) -> list[str]:
    saved = lora.read_base(adapter_dir).get("sha256")
    base = base_model_path(resolve_model_path(start_model))
    if saved and lora.weights_fingerprint(base) != saved:
        return [
            f"its adapter was trained on a base model with other weights than {base} has now (sha256 "
            f"{saved[:12]}... then, {lora.weights_fingerprint(base)[:12]}... now)"
        ]
    return []


def check_runs_dir_writable(config: RLConfig) -> None:
    """Fail before anything starts when ``trainer.runs_dir`` cannot be written (permissions, credentials, a
    missing bucket): checkpoints would fail only at the first save, after minutes of training."""
    runs = config.trainer.runs_dir
    probe = f"{runs.rstrip('/') if is_remote(runs) else os.path.abspath(runs)}/.rlflow-write-test-{uuid.uuid4().hex}"
    try:
        write_json(probe, {"written_by": "rlflow pre-flight check"})
        fs, path = fsspec.core.url_to_fs(probe)
        fs.rm(path)
    except Exception as error:  # PermissionError, botocore's ClientError, NoCredentialsError...
        raise PermissionError(
            f"trainer.runs_dir={runs!r} cannot be written ({type(error).__name__}: {error}). "
            "Checkpoints, the run record and the final model go there. Fix: pick a folder you can "
            "write (or fix its permissions), or for s3:// check the bucket exists and the "
            "credentials (AWS_* variables, AWS_ENDPOINT_URL for an S3-compatible store)."
        ) from error


def _flow_task_runner():
    """The task runner of the flow run this process is in; training flows run on ``ray_task_runner()``."""
    from prefect.context import FlowRunContext

    from flows.task_runner import WarmRayTaskRunner

    runner = FlowRunContext.get().task_runner
    if not isinstance(runner, WarmRayTaskRunner):
        raise TypeError(
            f"training flows run on flows.runtime.ray_task_runner(), not {type(runner).__name__}: drop "
            "the task_runner of `flow.with_options(...)`"
        )
    return runner


def _start_model(config: RLConfig) -> tuple[str, str]:
    """(pinned URI, folder) of the model a new run starts from; a named model (``tiny``, ``smollm2-135m-instruct``)
    becomes its local folder, a URL stays one (every node caches it)."""
    from mlflow.tracking import MlflowClient

    model_uri, model_dir = lineage.start_model(config, MlflowClient(), lineage.cache_root(config))
    if model_dir.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(model_dir)):
        raise FileNotFoundError(
            f"model.path={model_dir!r}: no such folder. Fix: name a folder that holds the model's "
            "config.json, weights and tokenizer, a Hugging Face hub name, `tiny`, `smollm2-135m-instruct`, or an "
            "MLflow reference (models:/<name>@<alias>)"
        )
    return model_uri, model_dir if is_remote(model_dir) else resolve_model_path(model_dir)


def _new_record(
    config: RLConfig,
    algorithm: str,
    experiment: str,
    tags: dict,
    flow_run_id: str | None,
    model_uri: str,
    model_dir: str,
) -> tuple[Tracker, lineage.RunRecord]:
    """A run's first attempt: pin its start model (and, in a lineage, its parent run and data cursor), then create
    its MLflow run and write its record."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    parent = None
    if config.trainer.lineage:
        found = client.get_experiment_by_name(experiment)
        parent = lineage.lineage_parent(client, found.experiment_id, config.trainer.lineage) if found else None
    cursor = (
        json.loads(parent.data.tags["rlflow.data_cursor"])
        if parent and "rlflow.data_cursor" in parent.data.tags
        else None
    )
    lineage_tags = {"rlflow.start_model": model_uri}
    if parent:
        lineage_tags["rlflow.parent_run_id"] = parent.info.run_id
    tracker = Tracker(experiment, config.trainer.run_name, tags={**tags, **lineage_tags})
    record = lineage.RunRecord(
        run_name=config.trainer.run_name,
        algorithm=algorithm,
        lineage=config.trainer.lineage,
        model_uri=model_uri,
        model_dir=model_dir,
        mlflow_run_id=tracker.run_id,
        prefect_flow_run_id=flow_run_id,
        parent_run_id=parent.info.run_id if parent else None,
        data_cursor=cursor,
    )
    record.write(runs_root(config))
    return tracker, record


def _build_groups(config: RLConfig, roles: tuple[str, ...], model_path: str) -> dict[str, RayWorkerGroup | RuleReward]:
    """The worker groups of ``roles``, built at once: their processes start and load the model in parallel. The
    reference may share the actor's group (``trainer.colocate_ref``); a rule reward is a ``RuleReward`` that the
    compute_reward stage calls itself (``reward.num_workers=0``, the default for rules)."""
    from concurrent.futures import ThreadPoolExecutor

    trainer = config.trainer
    use_gpu, timeout = trainer.device == "cuda", (trainer.stage_timeout_s, trainer.stage_timeout_s_per_sample)
    model = config.model.model_copy(update={"path": model_path})  # resolved once: "tiny" -> its folder
    worker_config = config.worker_config().model_copy(update={"model": model})
    colocate_ref = trainer.colocate_ref and "actor" in roles
    plans = {
        "actor": (
            ActorRolloutRefWorker,
            trainer.n_workers,
            {
                "use_gpu": use_gpu,
                "config": worker_config,
                "role": "actor_rollout_ref" if colocate_ref else "actor_rollout",
            },
        ),
        "ref": (ActorRolloutRefWorker, 1, {"use_gpu": use_gpu, "config": worker_config, "role": "ref"}),
        "critic": (
            CriticWorker,
            trainer.n_workers,
            {
                "use_gpu": use_gpu,
                "config": config.critic,
                "model": model,
                "device": trainer.device,
                "seed": trainer.seed,
                "collective_timeout_s": trainer.collective_timeout_s,
            },
        ),
        "reward": (
            RewardWorker,
            config.reward.worker_count,
            {"use_gpu": False, "cpus_per_worker": 0.5, "config": config.reward, "tokenizer_path": model_path},
        ),
    }
    # a rule reward scores in the compute_reward stage (reward.num_workers=0): loaded here, before any worker starts
    in_stage = "reward" in roles and not config.reward.worker_count
    rule_reward = RuleReward(config.reward, model_path).load() if in_stage else None
    no_group_of_its_own = {"ref": colocate_ref, "reward": rule_reward is not None}
    wanted = [role for role in plans if role in roles and not no_group_of_its_own.get(role)]
    with ThreadPoolExecutor(len(wanted)) as pool:
        futures = {
            role: pool.submit(build_group, plans[role][0], plans[role][1], timeout=timeout, **plans[role][2])
            for role in wanted
        }
    groups, errors = {}, []
    for role, future in futures.items():
        try:
            groups[role] = future.result()
        except Exception as error:
            errors.append(error)
    if errors:  # release what did start before failing with the first error
        for group in groups.values():
            group.shutdown()
            group.resource_pool.remove()
        raise errors[0]
    if colocate_ref and "ref" in roles:
        groups["ref"] = groups["actor"]  # one group in two roles (Run.distinct_groups lists it once)
    if rule_reward is not None:
        groups["reward"] = rule_reward
    return groups


def _restore(run: Run, path: str, state: dict) -> None:
    for role in STATEFUL_ROLES:
        if role in run.groups:
            run.groups[role].load_checkpoint(f"{path}/{role}")
    run.loader.load_state_dict(state["loader"])
    run.kl_ctrl_state = state["kl_ctrl_state"]
    run.start_step = state["step"] + 1
    run.last_checkpoint = path


def reap_orphaned_ray_agents() -> list[int]:
    """Kill ``ray::`` processes (Ray's per-node agents and workers) whose raylet is gone.

    Every such process is started by a raylet and stays its child. When a flow process that started a local Ray
    dies by SIGKILL, its raylet and GCS exit with it, but Ray's two agents (``ray::DashboardAgent``,
    ``ray::RuntimeEnvAgent``) can outlive them indefinitely. Every attempt starts by ending those orphans (this
    user's only), so the new attempt of a crashed run leaves nothing of the dead one behind."""
    import psutil

    reaped = []
    for process in psutil.process_iter(["name", "uids"]):
        try:
            if not (process.info["name"] or "").startswith("ray::") or process.info["uids"].real != os.getuid():
                continue
            parent = process.parent()
            if parent is None or "raylet" not in parent.name():
                process.kill()
                reaped.append(process.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    if reaped:
        logger.warning("ended %d Ray agent process(es) left by a dead local Ray: %s", len(reaped), reaped)
    return reaped


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


def _service_env() -> dict[str, str]:
    """Environment every Ray worker (on every node) gets: where the services are, where the tiny model lives,
    how to reach the object store."""
    return {
        **{
            k: os.environ[k]
            for k in (
                "PREFECT_API_URL",
                "MLFLOW_TRACKING_URI",
                "RLFLOW_TINY_MODEL_DIR",
                "RLFLOW_SMOLLM2_MODEL_DIR",
                # credentials of servers with authentication (in the workers' environment, never in a param)
                "PREFECT_API_AUTH_STRING",
                "PREFECT_API_KEY",
                "MLFLOW_TRACKING_USERNAME",
                "MLFLOW_TRACKING_PASSWORD",
                "MLFLOW_TRACKING_TOKEN",
            )
            if k in os.environ
        },
        **storage_env(),
    }


def ray_task_runner():
    """The flows' task runner (``WarmRayTaskRunner``: prefect-ray's, with tasks in a long-lived actor), built here
    only. It starts Ray when the flow's ``start_run`` calls ``start_ray`` with the run's config (``ray_settings``).
    Every Ray worker, on every node, gets the service URLs in its environment."""
    from flows.task_runner import WarmRayTaskRunner

    # the worker classes too: a stage task's WorkerGroup argument is rebuilt in the host from its worker class, and the
    # first one (validation before step 1) would otherwise wait for torch and transformers to import there; and this
    # module (with MLflow): the flow run context every task gets holds the flow, whose module imports it
    workers = ("rlworkers.workers.actor_rollout_ref", "rlworkers.workers.critic", "rlworkers.workers.reward")
    return WarmRayTaskRunner(host_env=_service_env, preload=("flows.stages", *workers, __name__))


def ray_settings(address: str | None, num_cpus: int | None) -> tuple[str | None, dict]:
    """``(address, ray.init keyword arguments)`` for ``trainer.ray_address`` / ``trainer.ray_num_cpus``: Ray at
    ``address`` (else ``$RAY_ADDRESS``) when one is given, otherwise a local Ray with ``num_cpus`` (else
    ``$RLFLOW_RAY_NUM_CPUS``, else max(8, cores)) logical CPUs as slots for the worker processes. ``num_cpus`` does
    not apply to an existing cluster (it has its own resources)."""
    address = address or os.environ.get("RAY_ADDRESS") or None
    init_kwargs = {"include_dashboard": False, "log_to_driver": False, "runtime_env": {"env_vars": _service_env()}}
    if address is None:
        init_kwargs["num_cpus"] = num_cpus or int(os.environ.get("RLFLOW_RAY_NUM_CPUS", max(8, os.cpu_count() or 1)))
        # Ray starts idle worker processes for the driver's job at once, but every actor rlflow starts has a
        # runtime env of its own (per-rank variables) and never uses them: on a small machine they only slow the
        # worker groups' start-up (about 1 s of the demo's 15 s here).
        init_kwargs["_system_config"] = {"prestart_worker_first_driver": False}
    else:
        init_kwargs.pop("include_dashboard")  # a setting of the cluster's head, not of a client
    return address, init_kwargs
