"""Real training on real Ray: a 2-worker data-parallel group SFT-warms the tiny model on 2-digit addition, then
GRPO raises its reward. Fixed seeds; CPU results are deterministic (one thread per Ray worker)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from rlworkers.algorithms.batch_ops import compute_advantage, compute_data_metrics
from rlworkers.data.batching import prompt_batch, sft_batch
from rlworkers.data.synthetic import addition_rows
from rlworkers.models.loading import load_tokenizer
from rlworkers.models.tiny import ensure_tiny_model
from rlworkers.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from rlworkers.workers.actor_rollout_ref import ActorRolloutRefWorker
from rlworkers.workers.reward import RewardWorker

pytestmark = pytest.mark.slow  # starts services, trains or installs: `make test-quick` leaves it out

ROWS = addition_rows(num_train=2000, num_val=200, max_digits=2, seed=0)
SFT_STEPS = 700


def actor_group(config: dict, role: str):
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    group = RayWorkerGroup(
        resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=ActorRolloutRefWorker, config=config, role=role)
    )
    group.init_model()
    return group, pool


def greedy_scores(group, reward, tokenizer, rows) -> np.ndarray:
    """Each row's exact-match score (0/1) of the greedy answer."""
    batch = prompt_batch(rows, tokenizer)
    batch.meta_info.update(do_sample=False, n=1)
    return reward.compute_rm_score(group.generate_sequences(batch)).non_tensor_batch["score"].astype(float)


@pytest.fixture(scope="module")
def reward_group(ray_cluster, tmp_path_factory):
    path = str(ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))
    pool = RayResourcePool([1], use_gpu=False, max_colocate_count=1)
    group = RayWorkerGroup(
        resource_pool=pool,
        ray_cls_with_init=RayClassWithInitArgs(cls=RewardWorker, config={"reward_fn": "exact"}, tokenizer_path=path),
    )
    group.init_model()
    yield path, group
    group.shutdown()
    pool.remove()


def sft_config(model_path: str) -> dict:
    """The SFT warm-up's workers: 64 rows an optimizer step, forward/backward passes of 32 rows on each worker."""
    return {
        "model": {"path": model_path},
        "rollout": {"response_length": 4},
        "actor": {"ppo_mini_batch_size": 64, "ppo_micro_batch_size_per_gpu": 32, "optim": {"lr": 1e-3}},
    }


@pytest.fixture(scope="module")
def sft_checkpoint(reward_group, tmp_path_factory):
    """SFT warm-up of the tiny model on 2 data-parallel workers; returns (checkpoint path, losses, accuracy)."""
    path, reward = reward_group
    tokenizer = load_tokenizer(path)
    config = sft_config(path)
    group, pool = actor_group(config, "actor_rollout")
    rng = random.Random(0)
    losses = []
    for _ in range(SFT_STEPS):
        metrics = group.sft_step(sft_batch(rng.sample(ROWS["train"], 64), tokenizer)).meta_info["metrics"]
        losses.append(float(np.mean(metrics["sft/loss"])))
    checksums = group.get_weights_checksum()
    scores = greedy_scores(group, reward, tokenizer, ROWS["validation"])
    checkpoint = str(tmp_path_factory.mktemp("sft") / "step_final")
    group.save_checkpoint(checkpoint)
    group.shutdown()
    pool.remove()
    return checkpoint, losses, checksums, scores


def test_data_parallel_sft_learns_and_keeps_replicas_identical(sft_checkpoint):
    _, losses, checksums, scores = sft_checkpoint
    assert checksums[0] == checksums[1]  # DDP all-reduce kept both replicas bit-identical
    assert np.mean(losses[-20:]) < 0.3 * np.mean(losses[:5])
    assert scores.mean() > 0.2  # greedy exact-match on held-out sums


def test_a_ddp_checkpoint_holds_adamw_state_once_and_every_rank_resumes_from_it(sft_checkpoint, reward_group):
    """AdamW's state is the same on every DDP rank: rank 0 alone writes it (not one copy a worker), and both ranks
    of a new group load it, so their next step keeps the replicas identical (a rank without it would step apart)."""
    import torch

    checkpoint, *_ = sft_checkpoint
    path, _ = reward_group
    states = {rank: torch.load(f"{checkpoint}/actor_state_rank_{rank}.pt", weights_only=True) for rank in (0, 1)}
    assert states[0]["optimizer"]["state"] and "optimizer" not in states[1] and "rng" in states[1]
    config = sft_config(checkpoint)
    group, pool = actor_group(config, "actor_rollout")
    try:
        group.load_checkpoint(checkpoint)
        group.sft_step(sft_batch(random.Random(2).sample(ROWS["train"], 64), load_tokenizer(path)))
        first, second = group.get_weights_checksum()
        assert first == second
    finally:
        group.shutdown()
        pool.remove()


def test_grpo_raises_reward_of_sft_model(sft_checkpoint, reward_group):
    checkpoint, _, _, sft_scores = sft_checkpoint
    path, reward = reward_group
    tokenizer = load_tokenizer(path)
    config = {
        "model": {"path": checkpoint},
        "rollout": {"response_length": 4, "n": 8},
        "actor": {
            "ppo_mini_batch_size": 128,
            "ppo_micro_batch_size_per_gpu": 64,
            "optim": {"lr": 1e-4},
            "use_kl_loss": True,
            "kl_loss_coef": 0.001,
        },
    }
    group, pool = actor_group(config, "actor_rollout_ref")
    try:
        before = group.get_weights_checksum()
        rng = random.Random(1)
        scores = []
        for _ in range(25):
            batch = group.generate_sequences(prompt_batch(rng.sample(ROWS["train"], 32), tokenizer))
            batch.union(reward.compute_rm_score(batch))
            batch.union(group.compute_log_prob(batch))
            batch.union(group.compute_ref_log_prob(batch))
            batch, _ = compute_advantage(batch, "grpo")
            metrics = group.update_actor(batch).meta_info["metrics"]
            assert np.isfinite(metrics["actor/pg_loss"]).all()
            scores.append(compute_data_metrics(batch)["critic/score/mean"])
        after = group.get_weights_checksum()
        assert after[0] == after[1] and after[0] != before[0]
        assert np.mean(scores[-5:]) > np.mean(scores[:5]) + 0.08, scores
        # held out, row by row: GRPO fixed more sums than it broke (the size of the gain varies between CPUs)
        grpo_scores = greedy_scores(group, reward, tokenizer, ROWS["validation"])
        fixed, broken = (
            int(((grpo_scores == 1) & (sft_scores == 0)).sum()),
            int(((grpo_scores == 0) & (sft_scores == 1)).sum()),
        )
        assert fixed > broken, (fixed, broken)
    finally:
        group.shutdown()
        pool.remove()
