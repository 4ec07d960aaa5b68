"""A run's checkpoints: where they go (``checkpoint_root``), when one is due (``should_save``: every
``trainer.save_freq`` steps and at the end), what one holds (``save``: the state of the actor, critic and reward
groups, the data loader's position, the KL controller, the MLflow run and the config; each checkpoint published as a
Prefect artifact, its manifest logged to MLflow), and how a run continues from one (``restore``: at a resume, or
after a worker fault). The controller's part of what one holds is a ``TrainState``: the run takes it
(``Run.train_state``) and goes back to it (``Run.rewind``) itself. The ``save_checkpoint`` stage (flows/stages.py)
writes one; ``rlworkers.checkpoint`` commits, checks and prunes them."""

from __future__ import annotations

import time
from dataclasses import asdict

from flows.controller.run_state import RunState, TrainState
from flows.plumbing.tracking import publish_checkpoint_artifact
from flows.stages import save_checkpoint

STATEFUL_ROLES = ("actor", "critic", "reward")  # the roles whose state a checkpoint holds


# trainer_state.json's fields beside TrainState's: what names the run (a resume checks them) and each pool's policy
RUN_FIELDS = ("algorithm", "mlflow_run_id", "world_size", "config", "policy_versions")


def checkpoint_root(root: str) -> str:
    """The folder of the checkpoints of the run whose folder is ``root``."""
    return f"{root}/checkpoints"


def should_save(run: RunState, step: int) -> bool:
    """Every ``trainer.save_freq`` steps and at the last one (only there when ``save_freq`` <= 0)."""
    freq = run.config.trainer.save_freq
    return step == run.final_step or (freq > 0 and step % freq == 0)


def save(run: RunState, step: int) -> float:
    """Checkpoint the run as it is after ``step`` (the MLflow metrics up to it flushed first); the seconds the
    workers' save took (``timing_s/save_checkpoint``, logged at ``step``)."""
    state = {
        **asdict(run.train_state(step)),
        "algorithm": run.algorithm,
        "mlflow_run_id": run.tracker.run_id,
        "world_size": run.config.trainer.n_workers,
        "config": run.config.model_dump(mode="json"),
        "policy_versions": policy_versions(run),
    }
    roles = {name: group for name, group in run.groups.items() if name in STATEFUL_ROLES}
    run.tracker.flush()  # the steps up to this one are in MLflow before a resume can start after them
    started = time.perf_counter()
    path, manifest = save_checkpoint.submit(
        checkpoint_root(run.root), step, roles, state, run.config.trainer.keep_last_checkpoints, run.last_checkpoint
    ).result()
    seconds = time.perf_counter() - started
    run.checkpointed(path)
    publish_checkpoint_artifact(run.config.trainer.run_name, step, path, run.last_metrics)
    run.tracker.log_dict({"path": path, **manifest}, f"checkpoints/step_{step:06d}/manifest.json")
    run.tracker.log_metrics({"timing_s/save_checkpoint": seconds}, step, wait=False)
    return seconds


def restore(run: RunState, path: str, trainer_state: dict) -> TrainState:
    """Load the checkpoint at ``path`` (its ``trainer_state.json`` read as ``trainer_state``) into every stateful
    group; the controller's state it holds, which the run rewinds to (``Run.rewind``) to continue after it."""
    for role in STATEFUL_ROLES:
        if role in run.groups:
            run.groups[role].load_checkpoint(f"{path}/{role}")
    send_rollout_weights(run)
    run.checkpointed(path)
    return TrainState.from_checkpoint(trainer_state)


def policy_versions(run: RunState) -> dict[str, int]:
    """``{"actor": v, "rollout": v}``: the updates the policy's weights have had in each pool (the rollout's: those
    it samples with; the same group's as the actor's unless it has a pool of its own). Said by a checkpoint; a
    restore sends a pool of its own the actor's weights again (``send_rollout_weights``)."""
    versions = {"actor": run.groups["actor"].get_policy_version()[0]}
    if run.rollout_of_its_own():
        if run.weights_synced is not None:
            run.weights_synced.wait()  # the last update's weights on their way to the rollout pool
        versions["rollout"] = run.groups["rollout"].get_policy_version()[0]
    elif "rollout" in run.groups:
        versions["rollout"] = versions["actor"]  # the actor's workers generate
    return versions


def send_rollout_weights(run: RunState) -> None:
    """A rollout pool of its own samples with the actor's weights as they are now (after a restore, or after a
    fault rebuilt the actor from the start model); its own are not in a checkpoint."""
    if run.rollout_of_its_own():
        run.groups["rollout"].set_policy_weights(run.groups["actor"].get_policy_weights()[0])
