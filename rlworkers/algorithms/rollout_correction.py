"""Rollout correction (verl's ``algorithm.rollout_correction``, ``verl/trainer/ppo/rollout_corr_helper.py``): the
policy that generated a batch (the rollout: another precision, another engine, or older weights) is not the policy
the update's PPO ratio is taken against (the old policy, recomputed by the actor). With the log-ratio
``log(pi_old / pi_rollout)`` per token:

- **importance sampling** (``rollout_is``): the policy loss of each token is multiplied by a truncated weight
  ``min(ratio, rollout_is_threshold)``, per token (``token``: biased, low variance) or per sequence (``sequence``: the
  product of the sequence's token ratios; unbiased, high variance). The weights are constants of the loss (detached).
- **rejection sampling** (``rollout_rs``): tokens or whole sequences whose divergence estimate is out of bounds are
  masked out of the update (``response_mask``). An option is ``<level>_<estimator>``: level ``token``, ``seq_sum``,
  ``seq_mean`` or ``seq_max`` (a sequence's sum, mean or maximum of its tokens' estimates); estimator ``k1`` =
  ``-log_ratio`` (bounded on both sides: a threshold ``lower_upper`` of ratios, e.g. ``0.5_2.0``, or one ``upper``
  whose lower bound is ``1/upper``), ``k2`` = ``log_ratio^2 / 2``, ``k3`` = ``ratio - 1 - log_ratio`` (an upper bound
  only). Several options are comma separated and must all pass; one threshold serves all, or one each.

Metric names are verl's (``rollout_corr/...``). Pure functions of tensors; no Ray, no Prefect.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlworkers.algorithms.utils import masked_mean, masked_sum
from rlworkers.protocol import DataProto

# exp(+-20) bounds every exponentiated log-ratio: weights stay finite in float32
SAFETY_BOUND = 20.0
IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "seq_sum", "seq_mean", "seq_max")
RS_OPTIONS = tuple(
    f"{level}_{estimator}"
    for level in RS_LEVELS
    for estimator in ("k1", "k2", "k3")
    if not (level == "seq_max" and estimator == "k1")
)


@dataclass(frozen=True)
class RejectionBound:
    """One rejection option and its bounds: on the log scale for ``k1`` (both sides), an upper bound otherwise."""

    option: str
    upper: float
    lower: float | None = None

    @property
    def level(self) -> str:
        return self.option.rsplit("_", 1)[0]

    @property
    def estimator(self) -> str:
        return self.option.rsplit("_", 1)[1]


def parse_rejection(rollout_rs: str, threshold: str | float | None) -> list[RejectionBound]:
    """``rollout_rs`` (comma separated options) and ``rollout_rs_threshold`` (one for all, or one per option) as
    bounds; a ``ValueError`` names what is wrong and the fix."""
    options = list(dict.fromkeys(part.strip() for part in rollout_rs.split(",") if part.strip()))
    if not options:
        raise ValueError("rollout_rs is empty. Fix: one or more of " + ", ".join(RS_OPTIONS) + ", comma separated")
    for option in options:
        if option not in RS_OPTIONS:
            raise ValueError(f"rollout_rs option {option!r} is not one of {', '.join(RS_OPTIONS)}")
    if threshold is None:
        raise ValueError(
            f"rollout_rs={rollout_rs!r} needs rollout_rs_threshold. Fix: e.g. rollout_rs_threshold=0.5_2.0 for a k1 "
            "option (ratio bounds), 2.0 for k2/k3 (an upper bound); one for all options or one each, comma separated"
        )
    specs = [str(threshold)] if isinstance(threshold, int | float) else [s.strip() for s in threshold.split(",")]
    specs = [s for s in specs if s]
    if len(specs) == 1:
        specs = specs * len(options)
    if len(specs) != len(options):
        raise ValueError(
            f"rollout_rs_threshold={threshold!r} has {len(specs)} thresholds for {len(options)} rollout_rs options. "
            "Fix: one threshold for all, or one per option in the same order"
        )
    return [_bound(option, spec) for option, spec in zip(options, specs)]


def _bound(option: str, spec: str) -> RejectionBound:
    try:
        values = [float(part) for part in spec.split("_")]
    except ValueError:
        raise ValueError(f"rollout_rs_threshold {spec!r} for {option} is not a number (or lower_upper)") from None
    if any(value <= 0 for value in values):
        raise ValueError(f"rollout_rs_threshold {spec!r} for {option}: thresholds must be positive")
    if option.endswith("k1"):
        if len(values) > 2:
            raise ValueError(f"rollout_rs_threshold {spec!r} for {option}: one number or lower_upper")
        lower, upper = values if len(values) == 2 else (1.0 / values[0], values[0])
        return RejectionBound(option, upper=math.log(upper), lower=math.log(lower))
    if len(values) != 1:
        raise ValueError(f"rollout_rs_threshold {spec!r} for {option}: k2 and k3 take one upper bound, no '_'")
    return RejectionBound(option, upper=values[0])


def importance_weights(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str, threshold: float, batch_normalize: bool = False
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated IS weights ``[B, T]`` (0 on padding, at most ``threshold``, detached) and their metrics (taken
    before the truncation: how many were above it)."""
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is={level!r} is not one of {IS_LEVELS}")
    if threshold <= 0:
        raise ValueError(f"rollout_is_threshold must be positive, got {threshold}")
    if level == "token":
        log_for_metrics = log_ratio
        weights = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        log_for_metrics = masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        weights = torch.exp(log_for_metrics.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    weights = weights * response_mask
    metrics = _importance_metrics(weights, log_for_metrics, response_mask, level, threshold)
    weights = weights.clamp(max=threshold).detach()
    if batch_normalize:
        if level == "token":
            mean = masked_mean(weights, response_mask)
        else:
            per_sequence = masked_mean(weights, response_mask, axis=-1)
            has_tokens = (response_mask.sum(-1) > 0).to(weights.dtype)
            mean = (per_sequence * has_tokens).sum() / has_tokens.sum().clamp_min(1e-8)
        factor = mean.item() if mean > 1e-8 else 1.0
        weights = weights / factor
        metrics["rollout_is_batch_norm_factor"] = factor
    return weights, metrics


def _importance_metrics(weights, log_for_metrics, mask, level: str, threshold: float) -> dict[str, float]:
    lower = 1.0 / threshold
    metrics = {"rollout_is_mean": masked_mean(weights, mask).item()}
    if level == "sequence":
        metrics["rollout_is_max"] = math.exp(min(log_for_metrics.max().item(), SAFETY_BOUND))
        metrics["rollout_is_min"] = math.exp(log_for_metrics.min().item())
        metrics["rollout_is_ratio_fraction_high"] = (log_for_metrics > math.log(threshold)).float().mean().item()
        metrics["rollout_is_ratio_fraction_low"] = (log_for_metrics < math.log(lower)).float().mean().item()
    else:
        metrics["rollout_is_max"] = weights.masked_fill(~mask.bool(), float("-inf")).max().item()
        metrics["rollout_is_min"] = weights.masked_fill(~mask.bool(), float("inf")).min().item()
        metrics["rollout_is_ratio_fraction_high"] = masked_mean((weights > threshold).float(), mask).item()
        metrics["rollout_is_ratio_fraction_low"] = masked_mean((weights < lower).float(), mask).item()
    bounded = weights.clamp(min=lower, max=threshold)
    mean = masked_mean(bounded, mask)
    variance = masked_mean(bounded.square(), mask) - mean.square()
    metrics["rollout_is_std"] = variance.clamp(min=0).sqrt().item() if mask.sum() > 1 else 0.0
    metrics["rollout_is_eff_sample_size"] = 1.0 / masked_mean((bounded / (mean + 1e-8)).square(), mask).item()
    per_sequence = masked_mean(weights, mask, axis=-1)
    metrics.update(
        rollout_is_seq_mean=per_sequence.mean().item(),
        rollout_is_seq_std=per_sequence.std().item() if per_sequence.numel() > 1 else 0.0,
        rollout_is_seq_max=per_sequence.max().item(),
        rollout_is_seq_min=per_sequence.min().item(),
        rollout_is_seq_max_deviation=(per_sequence - 1.0).abs().max().item(),
        rollout_is_seq_fraction_high=(per_sequence > threshold).float().mean().item(),
        rollout_is_seq_fraction_low=(per_sequence < lower).float().mean().item(),
    )
    return metrics


def rejection_mask(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, bounds: list[RejectionBound]
) -> tuple[torch.Tensor, dict[str, float]]:
    """``response_mask`` with the tokens (or whole sequences) out of any option's bounds set to 0, and per option
    its statistic's mean and the fraction of tokens and of sequences it masked."""
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    estimates = {"k1": -safe, "k2": 0.5 * safe**2, "k3": torch.exp(safe) - 1.0 - safe}
    valid = response_mask.bool()
    has_tokens = valid.any(-1)
    keep = torch.ones_like(valid)
    metrics: dict[str, float] = {}
    for bound in bounds:
        estimate = estimates[bound.estimator]
        if bound.level == "token":
            statistic = estimate
        elif bound.level == "seq_sum":
            statistic = masked_sum(estimate, response_mask, axis=-1).unsqueeze(-1)
        elif bound.level == "seq_mean":
            statistic = masked_mean(estimate, response_mask, axis=-1).unsqueeze(-1)
        else:  # seq_max: the largest estimate among the sequence's tokens (0 for an empty one)
            largest = estimate.masked_fill(~valid, float("-inf")).max(-1).values
            statistic = torch.where(has_tokens, largest, torch.zeros_like(largest)).unsqueeze(-1)
        passes = statistic <= bound.upper
        if bound.lower is not None:
            passes &= statistic >= bound.lower
        passes = passes.expand_as(valid)
        keep &= passes
        prefix = f"rollout_rs_{bound.option}"
        metrics[f"{prefix}_mean"] = masked_mean(statistic.expand_as(log_ratio), response_mask).item()
        metrics[f"{prefix}_masked_fraction"] = masked_mean((~passes).float(), response_mask).item()
        metrics[f"{prefix}_seq_masked_fraction"] = _fraction_of_sequences(~passes & valid, has_tokens)
    metrics["rollout_rs_masked_fraction"] = masked_mean((~keep).float(), response_mask).item()
    metrics["rollout_rs_seq_masked_fraction"] = (~keep & valid).any(-1).float().mean().item()  # of all, as verl
    return (response_mask * keep).to(response_mask.dtype), metrics


def _fraction_of_sequences(masked: torch.Tensor, has_tokens: torch.Tensor) -> float:
    """The share of the sequences with tokens that lost at least one."""
    count = has_tokens.sum().item()
    return (masked.any(-1) & has_tokens).sum().item() / count if count else 0.0


def offpolicy_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """How far the rollout's policy is from the old policy: KL(rollout || old) two ways (direct and k3), the two
    perplexities and their log difference, and the chi-squared divergence of the token and sequence ratios."""
    log_ratio = old_log_prob - rollout_log_prob
    old_mean = masked_mean(old_log_prob, response_mask, axis=-1)
    rollout_mean = masked_mean(rollout_log_prob, response_mask, axis=-1)
    log_ppl_diff = rollout_mean - old_mean
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    sequence = masked_sum(log_ratio, response_mask, axis=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": torch.exp(-old_mean).mean().item(),
        "training_log_ppl": (-old_mean).mean().item(),
        "kl": masked_mean(-log_ratio, response_mask).item(),
        "k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1, response_mask).item(),
        "rollout_ppl": torch.exp(-rollout_mean).mean().item(),
        "rollout_log_ppl": (-rollout_mean).mean().item(),
        "log_ppl_diff": log_ppl_diff.mean().item(),
        "log_ppl_abs_diff": log_ppl_diff.abs().mean().item(),
        "log_ppl_diff_max": log_ppl_diff.max().item(),
        "log_ppl_diff_min": log_ppl_diff.min().item(),
        "ppl_ratio": torch.exp(log_ppl_diff).mean().item(),
        "chi2_token": (masked_mean(torch.exp(safe).square(), response_mask) - 1.0).item(),
        "chi2_seq": (torch.exp(2.0 * sequence).mean() - 1.0).item(),
    }


def apply_rollout_correction(
    data: DataProto,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
) -> dict[str, float]:
    """On a batch with ``old_log_probs`` and ``rollout_log_probs``: add ``rollout_is_weights`` (with ``rollout_is``)
    for the policy loss, mask rejected tokens out of ``response_mask`` (with ``rollout_rs``), and return the
    ``rollout_corr/...`` metrics (the off-policy ones always)."""
    batch = data.batch
    for key in ("old_log_probs", "rollout_log_probs"):
        if key not in batch.keys():
            raise ValueError(f"rollout correction needs {key!r} in the batch (the rollout's and the old policy's)")
    old, rollout, mask = batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"]
    if not mask.any():
        raise ValueError("rollout correction: response_mask has no token")
    log_ratio = old - rollout
    metrics: dict[str, float] = {}
    if rollout_is is not None:
        weights, is_metrics = importance_weights(
            log_ratio, mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize
        )
        batch["rollout_is_weights"] = weights
        metrics.update(is_metrics)
    if rollout_rs is not None:
        batch["response_mask"], rs_metrics = rejection_mask(
            log_ratio, mask, parse_rejection(rollout_rs, rollout_rs_threshold)
        )
        metrics.update(rs_metrics)
    metrics.update(offpolicy_metrics(old, rollout, mask))
    return {f"rollout_corr/{key}": value for key, value in metrics.items()}
