"""Advantage estimators, registered by name (verl ``core_algos`` names and signatures).

Implemented (``AdvantageEstimator`` value -> function):

* ``gae`` -> :func:`compute_gae_advantage_return`: GAE (Schulman et al. 2015, arXiv:1506.02438), whitened.
* ``grpo`` -> :func:`compute_grpo_outcome_advantage`: group-normalised outcome reward (DeepSeekMath,
  arXiv:2402.03300); ``norm_adv_by_std_in_grpo=False`` gives Dr.GRPO (arXiv:2503.20783).
* ``grpo_passk`` -> :func:`compute_grpo_passk_outcome_advantage`: only the group's best sample gets
  ``r_max - r_second`` (Pass@k training, arXiv:2503.19595).
* ``rloo`` -> :func:`compute_rloo_outcome_advantage`: leave-one-out baseline (Ahmadian et al., arXiv:2402.14740).
* ``reinforce_plus_plus`` / ``reinforce_plus_plus_baseline``: REINFORCE++ (Hu, arXiv:2501.03262), discounted
  token returns whitened over the batch / group-mean baseline then whitened.

Every estimator returns ``(advantages, returns)``, both ``[B, T]``, computed without grad. Outcome
estimators accept and ignore extra keyword arguments, so a trainer can call
``get_adv_estimator_fn(name)(token_level_rewards=..., response_mask=..., index=..., config=...)`` uniformly.
``index`` is the per-row group id (verl's ``uid`` column, a numpy array of strings).

Custom estimators: decorate a function with ``@register_adv_est("my_name")``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

import numpy as np
import torch

from rlworkers.algorithms.utils import add_to_registry, config_get, masked_whiten

__all__ = [
    "AdvantageEstimator",
    "ADV_ESTIMATOR_REGISTRY",
    "register_adv_est",
    "get_adv_estimator_fn",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_token_level_scores",
]


class AdvantageEstimator(str, Enum):
    """Names of the built-in estimators (a ``str`` Enum, so ``AdvantageEstimator.GRPO == "grpo"``)."""

    GAE = "gae"
    GRPO = "grpo"
    GRPO_PASSK = "grpo_passk"
    RLOO = "rloo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"


ADV_ESTIMATOR_REGISTRY: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}


def _name(name_or_enum: str | Enum) -> str:
    return name_or_enum.value if isinstance(name_or_enum, Enum) else str(name_or_enum)


def register_adv_est(name_or_enum: str | AdvantageEstimator) -> Callable:
    """Decorator registering an advantage estimator under ``name_or_enum``.

    Raises:
        ValueError: if a different function is already registered under that name.
    """

    def decorator(fn: Callable) -> Callable:
        return add_to_registry(ADV_ESTIMATOR_REGISTRY, _name(name_or_enum), fn, "Advantage estimator")

    return decorator


def get_adv_estimator_fn(name_or_enum: str | AdvantageEstimator) -> Callable:
    """Return the estimator registered under ``name_or_enum``.

    Raises:
        ValueError: for an unknown name; the message lists the registered ones.
    """
    name = _name(name_or_enum)
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(
            f"Unknown advantage estimator {name!r}; valid options: {sorted(ADV_ESTIMATOR_REGISTRY)}. "
            "Register a custom one with @register_adv_est(name)."
        )
    return ADV_ESTIMATOR_REGISTRY[name]


# ----------------------------------------------------------------------------------------------------------
# grouping helpers
# ----------------------------------------------------------------------------------------------------------


def _group_ids(index: np.ndarray | Sequence | torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary hashable group ids (uids) to dense ints ``[B]``, in order of first appearance."""
    items = index.tolist() if hasattr(index, "tolist") else list(index)
    batch_size = scores.shape[0]
    if len(items) != batch_size:
        raise ValueError(f"index has {len(items)} entries but the batch has {batch_size} rows; pass one uid per row.")
    dense: dict[Any, int] = {}
    ids = [dense.setdefault(uid, len(dense)) for uid in items]
    return torch.tensor(ids, dtype=torch.long, device=scores.device), len(dense)


def _group_stats(scores: torch.Tensor, ids: torch.Tensor, n_groups: int):
    """Per-row group size, group mean and unbiased group std (``[B]`` each), like ``torch.std`` per group."""
    counts = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, ids, torch.ones_like(scores))
    sums = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, ids, scores)
    mean = sums / counts
    sq = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, ids, (scores - mean[ids]) ** 2)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    return counts[ids], mean[ids], std[ids]


# ----------------------------------------------------------------------------------------------------------
# estimators
# ----------------------------------------------------------------------------------------------------------


@register_adv_est(AdvantageEstimator.GAE)
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (arXiv:1506.02438), as in verl/TRL PPO.

    ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lam * A_{t+1}``, computed backwards.
    Masked positions (padding, or tool-output tokens in multi-turn masks) are skipped: they neither
    contribute a TD error nor break the bootstrap chain between the valid tokens around them.

    Args:
        token_level_rewards: ``[B, T]``.
        values: ``[B, T]`` critic values of the response tokens.
        response_mask: ``[B, T]``, 1 on tokens the policy generated.
        gamma: discount.
        lam: GAE lambda.

    Returns:
        advantages ``[B, T]`` whitened over the masked tokens (0 outside the mask), and
        returns ``[B, T]`` = raw advantages + values (the critic's regression target).
    """
    mask = response_mask.to(values.dtype)
    next_values = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    reversed_adv = []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * next_values - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        # hold the carries on masked positions so the chain jumps over them
        next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
        last_gae = gae_t * mask[:, t] + (1 - mask[:, t]) * last_gae
        reversed_adv.append(last_gae)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    returns = advantages + values
    advantages = masked_whiten(advantages, response_mask) * mask
    return advantages, returns


@register_adv_est(AdvantageEstimator.GRPO)
@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (DeepSeekMath, arXiv:2402.03300): ``(r_i - mean_g) / (std_g + eps)``.

    ``r_i`` is the row's summed reward; ``mean_g``/``std_g`` (unbiased std) are over the rows sharing its
    ``index``. With ``norm_adv_by_std_in_grpo=False`` only the mean is subtracted (Dr.GRPO,
    arXiv:2503.20783). A group of one has mean 0 and std 1, as in verl.

    Args:
        token_level_rewards: ``[B, T]``.
        response_mask: ``[B, T]``.
        index: ``[B]`` group id per row (numpy array of uids).
        epsilon: added to the std.
        norm_adv_by_std_in_grpo: divide by the group std (GRPO) or not (Dr.GRPO).
        config: unused; accepted for a uniform estimator signature.

    Returns:
        ``(advantages, advantages)``, each ``[B, T]``: the row's scalar broadcast over its masked tokens.
    """
    scores = token_level_rewards.sum(dim=-1)
    ids, n_groups = _group_ids(index, scores)
    counts, mean, std = _group_stats(scores, ids, n_groups)
    single = counts == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    adv = (scores - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else scores - mean
    adv = adv.unsqueeze(-1) * response_mask.to(adv.dtype)
    return adv, adv


@register_adv_est(AdvantageEstimator.GRPO_PASSK)
@torch.no_grad()
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k advantage (arXiv:2503.19595): in each group only the best row gets ``r_max - r_second``
    (divided by the group's unbiased std when normalising); every other row gets 0.

    ``config.norm_adv_by_std_in_grpo``, when present, overrides the keyword (verl reads it from config).

    Args:
        token_level_rewards: ``[B, T]``.
        response_mask: ``[B, T]``.
        index: ``[B]`` group ids; every group needs at least two rows.

    Returns:
        ``(advantages, advantages)``, each ``[B, T]``.

    Raises:
        ValueError: if a group has fewer than two rows.
    """
    norm = bool(config_get(config, "norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo))
    scores = token_level_rewards.sum(dim=-1)
    ids, n_groups = _group_ids(index, scores)
    adv = torch.zeros_like(scores)
    for g in range(n_groups):
        rows = torch.nonzero(ids == g, as_tuple=True)[0]
        if rows.numel() < 2:
            raise ValueError(f"grpo_passk needs at least 2 samples per group; group #{g} has {rows.numel()}.")
        group = scores[rows]
        top, top_idx = torch.topk(group, 2)
        value = top[0] - top[1]
        if norm:
            value = value / (torch.std(group) + epsilon)
        adv[rows[top_idx[0]]] = value
    adv = adv.unsqueeze(-1) * response_mask.to(adv.dtype)
    return adv, adv


@register_adv_est(AdvantageEstimator.RLOO)
@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (arXiv:2402.14740): ``A_i = r_i - mean_{j != i} r_j = (r_i - mean_g) * n / (n - 1)``.

    A group of one keeps its raw score (no other sample to form a baseline), as in verl.

    Args:
        token_level_rewards: ``[B, T]``.
        response_mask: ``[B, T]``.
        index: ``[B]`` group ids.

    Returns:
        ``(advantages, advantages)``, each ``[B, T]``.
    """
    scores = token_level_rewards.sum(dim=-1)
    ids, n_groups = _group_ids(index, scores)
    counts, mean, _ = _group_stats(scores, ids, n_groups)
    loo = (scores - mean) * counts / (counts - 1).clamp(min=1)
    adv = torch.where(counts > 1, loo, scores)
    adv = adv.unsqueeze(-1) * response_mask.to(adv.dtype)
    return adv, adv


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS)
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (arXiv:2501.03262): discounted reward-to-go per token, whitened over the batch.

    ``G_t = r_t + gamma * G_{t+1}``; the running return is reset to 0 on masked positions so nothing
    flows back across padding. ``gamma`` comes from ``config.gamma`` (default 1.0).

    Args:
        token_level_rewards: ``[B, T]`` (usually KL-penalised rewards with the score on the last token).
        response_mask: ``[B, T]``.
        config: anything with an optional ``gamma`` field/key.

    Returns:
        advantages ``[B, T]`` (whitened returns, 0 outside the mask) and returns ``[B, T]``.
    """
    gamma = float(config_get(config, "gamma", 1.0))
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    advantages = masked_whiten(returns, response_mask) * mask
    return advantages, returns


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE)
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (arXiv:2501.03262): subtract the group mean score, broadcast the result over
    the response tokens, then whiten over all masked tokens of the batch.

    Args:
        token_level_rewards: ``[B, T]``.
        response_mask: ``[B, T]``.
        index: ``[B]`` group ids (a group of one uses baseline 0).

    Returns:
        ``(advantages, advantages)``, each ``[B, T]`` (0 outside the mask).
    """
    scores = token_level_rewards.sum(dim=-1)
    ids, n_groups = _group_ids(index, scores)
    counts, mean, _ = _group_stats(scores, ids, n_groups)
    centred = scores - torch.where(counts > 1, mean, torch.zeros_like(mean))
    mask = response_mask.to(scores.dtype)
    adv = centred.unsqueeze(-1) * mask
    adv = masked_whiten(adv, response_mask) * mask
    return adv, adv


def compute_token_level_scores(scores: torch.Tensor | Sequence[float], response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's scalar score on its last valid response token (verl's naive reward manager).

    The "last valid token" is the highest position with mask 1, which also handles multi-turn masks
    with holes. A row with an empty mask gets its score at position 0, so row sums (score metrics, GRPO
    group statistics) still see it; its loss mask is empty, so it never trains.

    Args:
        scores: ``[B]`` outcome score per sequence.
        response_mask: ``[B, T]``.

    Returns:
        ``[B, T]`` float tensor, zero except one entry per row.
    """
    mask = response_mask.bool()
    dtype = scores.dtype if isinstance(scores, torch.Tensor) and scores.is_floating_point() else torch.float32
    scores_t = torch.as_tensor(scores, dtype=dtype, device=response_mask.device)
    if scores_t.dim() != 1 or scores_t.shape[0] != mask.shape[0]:
        raise ValueError(f"scores must have shape [{mask.shape[0]}] (one per row); got {tuple(scores_t.shape)}.")
    positions = torch.arange(1, mask.shape[-1] + 1, device=mask.device).expand_as(mask)
    last = (positions * mask).argmax(dim=-1)  # 0 when the row is empty
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    out[torch.arange(mask.shape[0], device=mask.device), last] = scores_t
    return out
