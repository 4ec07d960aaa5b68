"""Real training on real Ray, through worker groups driven from the test (no flow): a 2-worker data-parallel group
SFT-trains the tiny model on 2-digit addition (the loss falls, the replicas stay identical, the checkpoint resumes on
every rank), and GRPO on two workers raises the reward of the demo's SFT-warmed model (conftest's
``sft_warmed_tiny``). Fixed seeds; CPU results are deterministic (one thread per Ray worker)."""

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
# enough for the loss to fall by half; the model GRPO starts from is the demo's 700-step warm-up (``sft_warmed_tiny``)
DDP_SFT_STEPS = 60


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
def ddp_sft(reward_group, tmp_path_factory):
    """SFT of the tiny model on 2 data-parallel workers; returns (checkpoint path, losses, weight checksums)."""
    path, _ = reward_group
    tokenizer = load_tokenizer(path)
    group, pool = actor_group(sft_config(path), "actor_rollout")
    rng = random.Random(0)
    losses = []
    for _ in range(DDP_SFT_STEPS):
        metrics = group.sft_step(sft_batch(rng.sample(ROWS["train"], 64), tokenizer)).meta_info["metrics"]
        losses.append(float(np.mean(metrics["sft/loss"])))
    checksums = group.get_weights_checksum()
    checkpoint = str(tmp_path_factory.mktemp("sft") / "step_final")
    group.save_checkpoint(checkpoint)
    group.shutdown()
    pool.remove()
    return checkpoint, losses, checksums


def test_data_parallel_sft_lowers_the_loss_and_keeps_replicas_identical(ddp_sft):
    _, losses, checksums = ddp_sft
    assert checksums[0] == checksums[1]  # DDP all-reduce kept both replicas bit-identical
    assert np.mean(losses[-10:]) < 0.6 * np.mean(losses[:5]), losses


def test_a_ddp_checkpoint_holds_adamw_state_once_and_every_rank_resumes_from_it(ddp_sft, reward_group):
    """AdamW's state is the same on every DDP rank: rank 0 alone writes it (not one copy a worker), and both ranks
    of a new group load it, so their next step keeps the replicas identical (a rank without it would step apart)."""
    import torch

    checkpoint, *_ = ddp_sft
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


def test_grpo_raises_reward_of_sft_model(sft_warmed_tiny, reward_group):
    path, reward = reward_group
    tokenizer = load_tokenizer(path)
    config = {
        "model": {"path": str(sft_warmed_tiny)},
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
        sft_scores = greedy_scores(group, reward, tokenizer, ROWS["validation"])
        assert sft_scores.mean() > 0.2  # the SFT warm-up taught greedy exact-match on held-out sums
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
