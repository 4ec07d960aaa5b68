"""Algorithm steps on a whole DataProto (run by the controller between worker calls): advantages, online-DPO
preference pairs and the per-step data metrics with verl's names. Pure functions of their inputs; no Ray, no
Prefect."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rlworkers.algorithms.advantages import AdvantageEstimator, compute_gae_advantage_return, get_adv_estimator_fn
from rlworkers.algorithms.kl import apply_kl_penalty
from rlworkers.algorithms.utils import masked_mean
from rlworkers.protocol import DataProto


def compute_advantage(
    data: DataProto,
    adv_estimator: str,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    kl_ctrl: Any = None,
    kl_penalty: str = "kl",
    config: Any = None,
) -> tuple[DataProto, dict[str, float]]:
    """Add ``token_level_rewards``, ``advantages`` and ``returns`` ``[B, R]`` to ``data`` (in place).

    ``token_level_scores`` come from the reward; with ``kl_ctrl`` (KL-in-reward) the reward is
    ``scores - beta * KL(old || ref)``. ``gae`` needs ``values``; the outcome estimators group rows by ``uid``.
    """
    batch = data.batch
    mask = batch["response_mask"]
    metrics: dict[str, float] = {}
    if kl_ctrl is not None:
        rewards, metrics = apply_kl_penalty(
            batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_prob"], mask, kl_ctrl, kl_penalty
        )
    else:
        rewards = batch["token_level_scores"]
    batch["token_level_rewards"] = rewards
    if adv_estimator == AdvantageEstimator.GAE:
        advantages, returns = compute_gae_advantage_return(rewards, batch["values"], mask, gamma, lam)
    else:
        estimator = get_adv_estimator_fn(adv_estimator)
        advantages, returns = estimator(
            token_level_rewards=rewards,
            response_mask=mask,
            index=data.non_tensor_batch["uid"],
            gamma=gamma,
            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
            config=config if config is not None else {"gamma": gamma},
        )
    batch["advantages"], batch["returns"] = advantages, returns
    return data, metrics


def apply_bypass_mode(data: DataProto) -> DataProto:
    """verl's bypass mode: the rollout's log-probs stand for the old policy's (``old_log_probs = rollout_log_probs``),
    so PPO's ratio is taken against the policy that sampled (in place; returns ``data``)."""
    if "rollout_log_probs" not in data.batch.keys():
        raise ValueError(
            "algorithm.rollout_correction.bypass_mode=true needs the rollout's log-probs (rollout_log_probs) in the "
            "batch; set bypass_mode=false to recompute them with the actor"
        )
    data.batch["old_log_probs"] = data.batch["rollout_log_probs"]
    return data


def compute_data_metrics(data: DataProto) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values and lengths of one step's batch (verl's metric names), and
    ``agent/<name>/mean`` for a multi-turn rollout's per-trajectory numbers (turns, tool calls and errors by kind,
    tool seconds, the share cut by the token budget: ``rlworkers.workers.rollout.agent_loop``), and
    ``reward_extra/<key>/mean`` for each non-tensor column ``reward_extra/<key>`` a reward function's extra values
    became (NaN rows, those without the key, left out; a column with no value gives no metric)."""
    batch = data.batch
    mask = batch["response_mask"].bool()
    metrics: dict[str, float] = {}

    def add(name: str, values: torch.Tensor) -> None:
        values = values.float()
        if values.numel():
            metrics[f"{name}/mean"] = values.mean().item()
            metrics[f"{name}/max"] = values.max().item()
            metrics[f"{name}/min"] = values.min().item()

    add("critic/score", batch["token_level_scores"].sum(-1))
    if "token_level_rewards" in batch.keys():
        add("critic/rewards", batch["token_level_rewards"].sum(-1))
    for key, name in (("advantages", "critic/advantages"), ("returns", "critic/returns"), ("values", "critic/values")):
        if key in batch.keys():
            add(name, batch[key][mask])
    response_length = mask.sum(-1)
    add("response_length", response_length)
    metrics["response_length/clip_ratio"] = (response_length == mask.shape[-1]).float().mean().item()
    add("prompt_length", batch["attention_mask"][:, : batch["prompts"].shape[-1]].sum(-1))
    if "entropys" in batch.keys():
        metrics["actor/entropy_rollout"] = masked_mean(batch["entropys"], mask.float()).item()
    for key in sorted(k for k in data.non_tensor_batch if k.startswith("agent/")):  # multi-turn rollouts' numbers
        metrics[f"{key}/mean"] = float(np.mean(np.asarray(data.non_tensor_batch[key], dtype=np.float64)))
    for key in sorted(k for k in data.non_tensor_batch if k.startswith("reward_extra/")):
        values = np.asarray(data.non_tensor_batch[key], dtype=np.float64)
        if not np.isnan(values).all():
            metrics[f"{key}/mean"] = float(np.nanmean(values))
    return metrics


def make_preference_pairs(data: DataProto, world_size: int) -> DataProto:
    """Online DPO's pairs: for each prompt (``uid``, in order of first appearance) whose responses' ``score`` differ,
    its best response then its worst (the first of equals), as rows (chosen, rejected, chosen, rejected, ...). Only
    whole pairs that split evenly over ``world_size`` ranks are kept (the rest are dropped, last first)."""
    uids, scores = data.non_tensor_batch["uid"], data.non_tensor_batch["score"].astype(float)
    order: list[int] = []
    for uid in dict.fromkeys(uids):
        rows = np.flatnonzero(uids == uid)
        best, worst = rows[np.argmax(scores[rows])], rows[np.argmin(scores[rows])]
        if scores[best] > scores[worst]:
            order += [best, worst]
    usable = len(order) // 2 // world_size * world_size * 2
    return data.select_idxs(np.array(order[:usable], dtype=np.int64))
