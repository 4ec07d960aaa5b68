"""``Run``: the loop every training flow drives, once ``flows.controller.run_start.start_run`` has built it: the steps
left (rewound after a worker fault, ``flows/controller/recovery.py``), per-step timing and metrics, validation and
checkpoints when due, the start model validated before and the final model published after, and the workers released at
the end. What a run holds is its ``RunState`` (``flows/controller/run_state.py``); the flows themselves
(``flows/grpo.py`` ...) stay the algorithm.

What the loop calls when it is due lives beside it, as functions of the run's state: validation and evaluation
(``flows/controller/run_evaluation.py``), checkpoints (``flows/controller/run_checkpoints.py``) and the final model's
publishing (``flows/controller/run_publish.py``); start-up, recovery, groups and rows have their own modules too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone

from prefect import get_run_logger

from flows import stages
from flows.controller import run_checkpoints, run_evaluation, startup
from flows.controller.groups import ray_outlives_the_run
from flows.controller.recovery import recover
from flows.controller.run_publish import publish
from flows.controller.run_state import CLIPPED_WARNING_RATIO, RunState
from flows.plumbing.tracking import step_summary


class Run(RunState):
    """A run's state (``RunState``) and the loop that drives it."""

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
        while next_step <= self.final_step:
            block = [next_step]
            while len(block) < size and not self.due_after(block[-1]):
                block.append(block[-1] + 1)
            yield block
            next_step = block[-1] + 1
            if self.redo_from is not None:  # the block failed and recovery restored a checkpoint: redo what it lost
                next_step, self.redo_from = self.redo_from, None

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
        in the workers.

        ``perf/orchestration_overhead_frac`` counts everything between the end of the step before and the end of
        this one (its logging, validation and checkpoint included): 1 - (time in worker calls) / (that wall time),
        logged once the step's validation and checkpoint are done. A generation submitted ahead overlaps the step
        before, so its seconds may exceed the wall time they add: the fraction is then a lower bound (floored at 0)."""
        block: list[dict] = []
        start = time.perf_counter()
        since = self.last_step_end if self.last_step_end is not None else start
        if steps[0] not in self.ahead:  # else its first stage started during the step before: keep that one's start
            self.step_started_at = datetime.now(timezone.utc)
        try:
            yield block
            wall = time.perf_counter() - start
            work = [worker_time(metrics, critical_path) for metrics in block]
            after = 0.0  # seconds of validation and checkpoint calls
            for step, metrics, seconds in zip(steps, block, work, strict=True):
                metrics["timing_s/step"] = wall * seconds / sum(work) if sum(work) > 0 else wall / len(steps)
                after += self.end_step(step, metrics, critical_path)
            self.last_step_end = time.perf_counter()
            overhead = max(0.0, 1.0 - (sum(work) + after) / (self.last_step_end - since))
            for step in steps:
                self.tracker.log_metrics({"perf/orchestration_overhead_frac": overhead}, step, wait=False)
            self.last_metrics["perf/orchestration_overhead_frac"] = overhead
        except Exception as error:
            self.rewind(recover(self, steps[0], error))
            self.redo_from = self.start_step

    def log_step(self, step: int, metrics: dict, critical_path: list[list[str]]) -> None:
        """Log a step's metrics with throughput and its time in the workers (see ``worker_time``)."""
        wall, work = metrics["timing_s/step"], worker_time(metrics, critical_path)
        metrics["perf/worker_time_s"] = work
        if "response_length/mean" in metrics:
            tokens = metrics["response_length/mean"] * self.config.data.train_batch_size * self.config.rollout.n
            metrics["perf/throughput"] = tokens / wall
        clip_ratio = metrics.get("response_length/clip_ratio", 0.0)
        if clip_ratio > CLIPPED_WARNING_RATIO and not self.warned_clipped:  # the task's answers: validation's rows
            data, length = self.config.data, self.config.rollout.response_length
            fit = run_evaluation.reference_answers_fit(self.inputs.val_rows, self.tokenizer, length, data)
            self.warned_clipped = self.warn_if_clipped(f"step {step}", clip_ratio, fit)
        self.tracker.log_metrics(metrics, step, wait=False)  # sent in order by MLflow's thread; close() waits
        self.last_metrics = metrics
        if self.progress:
            self.progress.update(step)
        if self.terminal:
            self.terminal.update(step, metrics)
        get_run_logger().info("step %d/%d  %s", step, self.config.trainer.total_steps, step_summary(metrics))

    def end_step(self, step: int, metrics: dict, critical_path: list[list[str]]) -> float:
        """Log the step, then validate and checkpoint when they are due; the seconds those two spent in their
        worker calls (the validation stage's time, the checkpoint's save)."""
        self.log_step(step, metrics, critical_path)
        seconds = 0.0
        if run_evaluation.should_validate(self, step):
            seconds += run_evaluation.validate(self, step)["timing_s/validate"]
        if run_checkpoints.should_save(self, step):
            seconds += run_checkpoints.save(self, step)
        return seconds

    @contextmanager
    def training(self):
        """Around a flow's body: always release the workers and close the MLflow run, FINISHED when the body
        ended, FAILED on an exception (which then ends the flow run Failed).

        Stage tasks run in the task runner's host actor (flows/plumbing/task_runner.py), which asks Ray for no CPU: they
        only call the worker groups, whose placement groups hold the resources, so a cluster that lost a node still
        has room to run them. Ray does not re-run a stage task that failed: ``recover`` decides what to redo."""
        status = "FAILED"
        try:
            yield
            status = "FINISHED"
        except BaseException as error:
            status = end_status(error)
            raise_the_stop_behind(error)
            raise
        finally:
            self.close(status)

    def validate_start(self) -> None:
        """Before step 1 of a fresh run: validate the start model (``val/score/mean`` at step 0) and evaluate it
        on the eval sets (a resumed run did both before it stopped), recovering from worker faults as a step does;
        then log the start-up's phases."""
        while self.start_step == 1 and not (0 in self.val_scores and run_evaluation.saved_results(self, "start")):
            try:
                if 0 not in self.val_scores:
                    run_evaluation.validate(self, step=0)
                run_evaluation.evaluate(self, 0)
            except Exception as error:
                self.rewind(recover(self, 0, error))
        self.log_startup()

    def publish(self) -> dict:
        """After the last step: evaluate the final model, save it, log and register it, and in a lineage gate it
        (``trainer.promotion=manual``: the run pauses for a person's approval); see ``flows.controller.run_publish``."""
        return publish(self)

    def log_startup(self) -> None:
        """The start-up's phases as ``timing_s/startup/*`` at the step before the first one, and in one line."""
        if self.startup is None:
            return
        if self.start_step == 1:
            self.startup.mark("validate_start")
        self.tracker.log_metrics(self.startup.metrics(), self.start_step - 1, wait=False)
        get_run_logger().info("started in %s", self.startup.summary())
        self.startup = None

    def submit_ahead(self, step: int, submit: Callable[[], object]) -> None:
        """Submit ``step``'s first stage (``submit()``) while the step before it still runs, to start as soon as that
        one's last stage ends (``wait_for``) instead of after the flow has heard of it and logged the step. Not when
        a validation or checkpoint is due in between (they need the workers, the data loader and the RNG as the step
        leaves them), there is no such step, or it was submitted already (``submit_stale_ahead``). ``step`` takes it
        with ``submitted_ahead``."""
        if step <= self.final_step and not self.due_after(step - 1) and step not in self.ahead:
            self.ahead[step] = submit()

    def submit_stale_ahead(self, step: int, gen, generate: Callable[[int, list], object]) -> list:
        """``async_training.staleness`` = k > 0: submit, before ``step``'s update, the generation of each of the next k
        steps not submitted yet (``generate(step, after)``: each after the one before it, the first after ``gen``,
        this step's, so the rollout samples in step order); each then trains k versions after the policy that sampled
        it. None across a validation or a checkpoint due in between (as ``submit_ahead``): the pipeline drains there,
        and refills after. Returns what the update must wait for: on one pool, these generations (they run on the
        actor's workers, before it changes the weights); on a rollout pool of its own, nothing (they run beside it)."""
        submitted = []
        for ahead in range(step + 1, step + self.config.async_training.staleness + 1):
            if ahead > self.final_step or self.due_after(ahead - 1):
                break
            if ahead not in self.ahead:
                self.ahead[ahead] = generate(ahead, [self.ahead.get(ahead - 1, gen)])
                submitted.append(self.ahead[ahead])
        return [] if self.rollout_of_its_own() else submitted

    def sync_rollout_weights(self, step: int, update) -> None:
        """A rollout pool of its own: send it the weights of ``step``'s ``update`` once that ends and the generations
        in flight (which sample with the weights of before) are done; later generations wait for it
        (``rollout_ready``). Nothing to do when the actor's workers generate, or after the last step."""
        if self.rollout_of_its_own() and step < self.final_step:
            in_flight = [future for ahead, future in self.ahead.items() if ahead > step]
            self.weights_synced = stages.sync_rollout_weights.submit(
                self.groups["actor"], self.groups["rollout"], step, wait_for=[update, *in_flight]
            )

    def rollout_ready(self, after: list | None = None) -> list | None:
        """What a generation submitted now waits for: the futures ``after``, and the last weights sent to a rollout
        pool of its own (None: nothing)."""
        return [*(after or []), *([self.weights_synced] if self.weights_synced is not None else [])] or None

    def submitted_ahead(self, step: int):
        """The first stage of ``step`` when ``submit_ahead`` submitted it during the step before, else None."""
        return self.ahead.pop(step, None)

    def due_after(self, step: int) -> bool:
        """Whether validation or a checkpoint runs after ``step`` (see ``end_step``)."""
        return run_evaluation.should_validate(self, step) or run_checkpoints.should_save(self, step)

    def close(self, status: str) -> None:
        if self.terminal:
            self.terminal.stop()
        if self.progress:
            self.progress.close()
        self.release_workers(keep=ray_outlives_the_run())
        self.tracker.finish(status)
        self.lock.close()  # the next run of the lineage may start: this one has published and closed
        startup.run_ended()


# ---------------------------------------------------------------------------------------------- set-up
def stop_signal(error: BaseException) -> BaseException | None:
    """The stop from outside behind ``error``, if any: SIGTERM, which the flow engine raises as Prefect's
    ``TerminationSignal``, SIGINT (``KeyboardInterrupt``) or an exit. Raised in the middle of a call into Ray's
    compiled code it may surface as another error (a ``SystemError`` whose context it is), hence the chain."""
    from prefect.exceptions import TerminationSignal

    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, (KeyboardInterrupt, SystemExit, TerminationSignal)):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def raise_the_stop_behind(error: BaseException) -> None:
    """Raise the stop from outside that ``error`` wraps, if any, so that the flow run ends Crashed (Prefect's handling
    of a stop), not Failed."""
    if (stop := stop_signal(error)) is not None and stop is not error:
        raise stop from error


def end_status(error: BaseException) -> str:
    """The MLflow status of a run that ``error`` ended: KILLED when it was stopped from outside, FAILED otherwise."""
    return "KILLED" if stop_signal(error) is not None else "FAILED"


def worker_time(metrics: dict, critical_path: list[list[str]]) -> float:
    """A step's seconds in its stages' calls along ``critical_path`` (stages listed in order; those in one inner
    list ran concurrently, so their longest counts)."""
    return sum(max(metrics.get(f"timing_s/{stage}", 0.0) for stage in group) for group in critical_path)
