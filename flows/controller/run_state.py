"""A run's state inside its flow: ``RunState``, what one training run holds (built by
``flows.controller.run_start.start_run``), and ``TrainState``, the controller's part of a checkpoint. The loop that
drives them is ``flows.controller.runtime.Run``; checkpoints, recovery, evaluation, publishing and promotion take a
``RunState``, and this module imports none of them."""

from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import dataclass, field, fields
from datetime import datetime

from prefect import get_run_logger

from flows.config import RLConfig
from flows.controller.groups import release_group
from flows.controller.rows import RunInputs
from flows.controller.startup import StartupClock
from flows.lineages import lineage
from flows.plumbing.tracking import ProgressArtifact, TerminalProgress, Tracker
from rlworkers.data.batching import prompt_batch, sft_batch
from rlworkers.data.datasets import PromptDataLoader
from rlworkers.single_controller.ray import RayWorkerGroup
from rlworkers.workers.reward import RuleReward

CLIPPED_WARNING_RATIO = 0.5  # share of responses cut by rollout.response_length above which a run warns


@dataclass(frozen=True)
class TrainState:
    """The controller's state that a checkpoint holds and that a resume, or the recovery from a worker fault,
    restores (the workers hold the rest: weights, optimizer, random generators): the last step done (0: none), the
    data loader's position, the adaptive KL controller's state, and the step training stopped at when a validation
    reached ``trainer.stop_at_val_score``. ``trainer_state.json`` is this with what names the run it belongs to
    (``RUN_FIELDS``), which a resume checks."""

    step: int
    loader: dict
    kl_ctrl_state: dict | None = None
    stopped_at: int | None = None

    @classmethod
    def from_checkpoint(cls, trainer_state: dict) -> TrainState:
        """The state in a checkpoint's ``trainer_state.json`` (read as a dict; one written before a field existed
        has that field's default)."""
        return cls(**{f.name: trainer_state[f.name] for f in fields(cls) if f.name in trainer_state})


@dataclass
class RunState:
    """What one training run holds inside its flow: what ``start_run`` built it from (config, folder, tokenizer,
    inputs, tracker, worker groups) and its loop's bookkeeping. ``flows.controller.runtime.Run`` is this with
    the loop; the modules the loop calls (checkpoints, recovery, evaluation, publishing, promotion) take a
    ``RunState``."""

    config: RLConfig
    algorithm: str
    root: str
    tokenizer: object
    loader: PromptDataLoader
    inputs: RunInputs  # its rows, eval sets and prompt rendering, read and checked before it started
    tracker: Tracker
    groups: dict[str, RayWorkerGroup | RuleReward] = field(default_factory=dict)  # by role (see groups.build_groups)
    start_step: int = 1  # the first step left to train (after the state the run rewound to: ``rewind``)
    kl_ctrl_state: dict | None = None  # the adaptive KL controller's, after the last step (``keep_kl_ctrl_state``)
    stopped_at: int | None = None  # the step a validation reached trainer.stop_at_val_score (``record_val_score``)
    progress: ProgressArtifact | None = None
    terminal: TerminalProgress | None = None
    last_metrics: dict = field(default_factory=dict)
    record: lineage.RunRecord | None = None
    val_scores: dict[int, float] = field(default_factory=dict)  # step -> val/score/mean (run_evaluation.validate)
    redo_from: int | None = None  # after a recovery: the step the loop goes back to (see step_blocks)
    initial_state: TrainState | None = None  # where a fault before the first checkpoint rewinds to
    faults: list[str] = field(default_factory=list)
    last_cut: tuple[int, str] | None = None  # (step, stage) of the last fault if a time limit cut it (recovery.py)
    lock: ExitStack = field(default_factory=ExitStack)  # the lineage's slot (run_lock.py)
    last_checkpoint: str | None = None  # the newest checkpoint this run committed or restored
    step_started_at: datetime | None = None  # wall clock at the start of the current step's attempt
    last_step_end: float | None = None  # perf_counter when the step before ended (its validation and checkpoint too)
    ahead: dict[int, object] = field(default_factory=dict)  # step -> its first stage, submitted by the step before
    weights_synced: object | None = None  # a rollout pool of its own: the last update's weights sent to it (future)
    warned_clipped: bool = False  # a training step's responses were mostly cut by rollout.response_length (said once)
    startup: StartupClock | None = (
        None  # the start-up's phases (flows/controller/startup.py), logged once the loop starts
    )

    # ------------------------------------------------------------------------------------------ state
    @property
    def final_step(self) -> int:
        """The run's last step: ``trainer.total_steps``, or the step a validation reached
        ``trainer.stop_at_val_score`` (``stopped_at``)."""
        return self.stopped_at if self.stopped_at is not None else self.config.trainer.total_steps

    def train_state(self, step: int) -> TrainState:
        """The controller's state after ``step`` (a checkpoint's, ``run_checkpoints.save``)."""
        return TrainState(
            step=step, loader=self.loader.state_dict(), kl_ctrl_state=self.kl_ctrl_state, stopped_at=self.stopped_at
        )

    def rewind(self, state: TrainState) -> None:
        """Go back to ``state`` (a checkpoint's, or ``initial_state``): the data, the KL controller and the steps
        left continue from there."""
        self.loader.load_state_dict(state.loader)
        self.kl_ctrl_state = state.kl_ctrl_state
        self.stopped_at = state.stopped_at
        self.start_step = state.step + 1

    def keep_kl_ctrl_state(self, state: dict | None) -> None:
        """The adaptive KL controller's state after a step's advantages (the next step's starts from it)."""
        self.kl_ctrl_state = state

    def keep_initial_state(self) -> None:
        """The state before step 1, where a fault before the first checkpoint rewinds to (``initial_state``)."""
        self.initial_state = self.train_state(0)

    def checkpointed(self, path: str) -> None:
        """``path`` is the newest checkpoint this run committed or restored (the next save keeps it until done)."""
        self.last_checkpoint = path

    def record_val_score(self, step: int, score: float) -> None:
        """``val/score/mean`` of the validation at ``step`` (publishing reports the last one's). A training step's that
        reaches ``trainer.stop_at_val_score`` makes that step the run's last (``final_step``)."""
        self.val_scores[step] = score
        threshold = self.config.trainer.stop_at_val_score
        if threshold is not None and 0 < step < self.final_step and score >= threshold:
            get_run_logger().info(
                "step %d: val/score/mean %.4f reached trainer.stop_at_val_score=%s: training stops here",
                step, score, threshold,
            )  # fmt: skip
            self.stopped_at = step

    def note_fault(self, step: int, description: str, cut: tuple[str, float] | None) -> int:
        """Count a worker fault at ``step`` (``faults``) and the stage its time limit cut, if any (``last_cut``);
        returns how many faults the run has had."""
        self.last_cut = (step, cut[0]) if cut else None
        self.faults.append(description)
        return len(self.faults)

    def drop_submitted_ahead(self) -> None:
        """Forget the stages submitted ahead (``ahead``) and the last weights sent to a rollout pool of its own: after
        a failed step they never run, steps rewind, and the recovery sends the rollout the weights it restored."""
        self.ahead.clear()
        self.weights_synced = None

    def rollout_of_its_own(self) -> bool:
        """Whether the rollout runs on a pool of its own (``rollout.n_workers``) rather than in the actor's workers."""
        return self.groups.get("rollout") not in (None, self.groups.get("actor"))

    def use_workers(self, groups: dict) -> None:
        """The run's worker groups, by role (``flows.controller.groups.build_groups``)."""
        self.groups = groups

    def show_progress(self, progress: ProgressArtifact, terminal: TerminalProgress | None) -> None:
        """Where the run's progress shows: a Prefect artifact, and a progress bar when it runs in a terminal."""
        self.progress, self.terminal = progress, terminal

    # ------------------------------------------------------------------------------------------ batches
    def next_rows(self) -> list[dict]:
        epoch = self.loader.epoch
        rows = self.loader.next_batch()
        if self.loader.epoch != epoch:
            get_run_logger().info("epoch %d of the training data done: starting epoch %d", epoch, self.loader.epoch)
        return rows

    def next_prompts(self, step: int | None = None):
        """The next batch of prompts; for ``step``'s generation on a rollout pool of its own, with the step's seed:
        those workers' random state is in no checkpoint, so their draws come from (``trainer.seed``, step, rank), and
        a resumed or recovered run samples what a straight one did."""
        prompts = self.prompt_batch(self.next_rows())
        if step is not None and self.rollout_of_its_own():
            prompts.meta_info["seed"] = self.config.trainer.seed + step
        return prompts

    def prompt_batch(self, rows: list[dict]):
        data = self.config.data
        return prompt_batch(
            rows,
            self.tokenizer,
            prompt_key=data.prompt_key,
            answer_key=data.answer_key,
            max_prompt_length=data.max_prompt_length,
            truncation=data.truncation,
            chat_template_kwargs=self.inputs.template_kwargs,
        )

    def next_sft_batch(self):
        data = self.config.data
        return sft_batch(
            self.next_rows(),
            self.tokenizer,
            prompt_key=data.prompt_key,
            response_key=data.response_key,
            conversation_key=data.messages_key,
            chat_template_kwargs=self.inputs.template_kwargs,
        )

    def warn_if_clipped(self, where: str, clip_ratio: float, references_fit: bool = False) -> bool:
        """Say what ``clipped_responses_note`` says (once a run for the training steps: True when it said it)."""
        note = clipped_responses_note(where, clip_ratio, self.config.rollout.response_length, references_fit)
        if note is None:
            return False
        get_run_logger().log(*note)
        return True

    # ------------------------------------------------------------------------------------------ workers
    def distinct_groups(self) -> dict[str, RayWorkerGroup]:
        """The worker groups of ``groups``, each once, under its first role (``trainer.colocate_ref``: the reference
        is the actor's group); a ``RuleReward`` has no workers and is not among them."""
        first: dict[int, tuple[str, RayWorkerGroup]] = {}
        for name, group in self.groups.items():
            if isinstance(group, RayWorkerGroup):
                first.setdefault(id(group), (name, group))
        return dict(first.values())

    def release_workers(self, keep: bool = False) -> None:
        """Shut every worker group down and give its placement back (at the end, or before a long pause); with
        ``keep``, keep their processes for the next run of this process (``flows.controller.groups.release_group``)."""
        for group in self.distinct_groups().values():
            release_group(group, keep=keep)
        self.groups = {}


def clipped_responses_note(
    where: str, clip_ratio: float, response_length: int, references_fit: bool
) -> tuple[int, str] | None:
    """(log level, message) when most responses were cut by ``rollout.response_length`` before they ended, else
    None. A WARNING with the fix when the limit may be what cuts the answers: they are likely missing, and the reward
    curve stays flat for a reason no metric chart shows at once. Only INFO when every reference answer of the task
    fits in the limit (``references_fit``): the model has not learned to end its answers yet, which the score already
    shows, and the limit is not the cause (the demo's untrained model, at its first steps)."""
    if clip_ratio <= CLIPPED_WARNING_RATIO:
        return None
    share = f"{100 * clip_ratio:.0f}%"
    if references_fit:
        return logging.INFO, (
            f"{where}: {share} of the responses did not end within rollout.response_length={response_length} (every "
            "reference answer fits in it: the model does not end its answers yet)"
        )
    return logging.WARNING, (
        f"{where}: {share} of the responses hit rollout.response_length={response_length} without ending (EOS); "
        "their answers may be cut off. Fix: raise rollout.response_length, or ask for shorter answers"
    )
