"""Loss aggregation and the actor / critic / DPO losses (verl ``core_algos`` names and signatures).

* :func:`agg_loss`: ``[B, T]`` loss matrix -> scalar; modes ``token-mean``, ``seq-mean-token-sum``,
  ``seq-mean-token-mean``, ``seq-mean-token-sum-norm`` (Dr.GRPO-style constant normaliser, arXiv:2503.20783),
  with verl's optional global-batch arguments so the loss does not depend on the data-parallel split.
* Policy losses, registered by name (``actor.policy_loss.loss_mode``):
  ``vanilla`` -> :func:`compute_policy_loss_vanilla`: PPO clip (Schulman et al. 2017, arXiv:1707.06347) with
  asymmetric ranges (``clip_ratio_low``/``clip_ratio_high``, DAPO "clip-higher", arXiv:2503.14476) and
  dual-clip for negative advantages (Ye et al. 2019, arXiv:1912.09729);
  ``gspo`` -> :func:`compute_policy_loss_gspo`: sequence-level importance ratio (GSPO, arXiv:2507.18071).
  Both return ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``.
* :func:`compute_entropy_loss`, :func:`compute_value_loss` (clipped value loss, as in TRL/verl PPO),
  :func:`compute_dpo_loss` (sigmoid DPO, Rafailov et al. 2023, arXiv:2305.18290; label smoothing = cDPO).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from rlworkers.algorithms.utils import add_to_registry, config_get, entropy_from_logits, masked_mean, masked_sum

__all__ = [
    "LOSS_AGG_MODES",
    "agg_loss",
    "PolicyLossConfig",
    "resolve_policy_loss_config",
    "PolicyLossFn",
    "POLICY_LOSS_REGISTRY",
    "register_policy_loss",
    "get_policy_loss_fn",
    "compute_policy_loss_vanilla",
    "compute_policy_loss_gspo",
    "compute_entropy_loss",
    "compute_value_loss",
    "compute_dpo_loss",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# ----------------------------------------------------------------------------------------------------------
# aggregation
# ----------------------------------------------------------------------------------------------------------


def _global_denominator(local: torch.Tensor, given: int | float | torch.Tensor | None, dp_size: int, what: str):
    if given is None:
        if dp_size > 1:
            raise ValueError(f"agg_loss: {what} (over the global batch) is required when dp_size > 1.")
        return local
    return torch.as_tensor(given, dtype=local.dtype, device=local.device)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss matrix into a scalar.

    * ``token-mean``: ``sum(loss * mask) / num_tokens`` (every token weighs the same).
    * ``seq-mean-token-sum``: mean over sequences of each sequence's token sum.
    * ``seq-mean-token-mean``: mean over sequences of each sequence's token mean (every sequence weighs
      the same, whatever its length).
    * ``seq-mean-token-sum-norm``: ``seq-mean-token-sum / loss_scale_factor`` (default ``T``, the padded
      response length), a constant normaliser that removes GRPO's length bias (Dr.GRPO).

    Sequences whose mask is empty are left out of the sequence means (verl). With micro-batches split over
    ``dp_size`` ranks, pass the global ``batch_num_tokens`` / ``global_batch_size``: the result is then
    scaled by ``dp_size`` so the ranks' gradient averaging gives the global-batch loss.

    Args:
        loss_mat: ``[B, T]``.
        loss_mask: ``[B, T]``.
        loss_agg_mode: one of :data:`LOSS_AGG_MODES`.

    Returns:
        scalar tensor (0, still attached to the graph, when nothing is masked in).

    Raises:
        ValueError: unknown mode (lists the valid ones), or ``dp_size > 1`` without the global count.
    """
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        total = masked_sum(loss_mat, mask)
        denom = _global_denominator(mask.sum(), batch_num_tokens, dp_size, "batch_num_tokens")
        return total * 0.0 if denom.item() == 0 else total / denom * dp_size

    tokens_per_seq = mask.sum(dim=-1)
    seq_mask = (tokens_per_seq > 0).to(loss_mat.dtype)
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = masked_sum(loss_mat, mask, axis=-1)
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_losses = masked_sum(loss_mat, mask, axis=-1) / tokens_per_seq.clamp(min=1)
    else:
        raise ValueError(f"Invalid loss_agg_mode {loss_agg_mode!r}; valid options: {list(LOSS_AGG_MODES)}.")
    total = masked_sum(seq_losses, seq_mask)
    denom = _global_denominator(seq_mask.sum(), global_batch_size, dp_size, "global_batch_size")
    if denom.item() == 0:
        return total * 0.0
    loss = total / denom * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_scale_factor if loss_scale_factor is not None else loss_mask.shape[-1])
    return loss


def _agg_kwargs(config: Any) -> dict[str, Any]:
    """verl passes ``config.global_batch_info`` (dp_size, batch_num_tokens, global_batch_size) to agg_loss."""
    info = config_get(config, "global_batch_info", None) or {}
    kwargs = {k: config_get(info, k) for k in ("dp_size", "batch_num_tokens", "global_batch_size")}
    kwargs["loss_scale_factor"] = config_get(config, "loss_scale_factor")
    return {k: v for k, v in kwargs.items() if v is not None}


# ----------------------------------------------------------------------------------------------------------
# policy-loss config and registry
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyLossConfig:
    """Clip settings of the PPO-style policy losses (field names as in verl's actor config).

    Attributes:
        clip_ratio: symmetric epsilon, used where ``clip_ratio_low``/``clip_ratio_high`` are ``None``.
        clip_ratio_low: ratio lower bound is ``1 - clip_ratio_low``.
        clip_ratio_high: ratio upper bound is ``1 + clip_ratio_high`` (DAPO uses 0.28).
        clip_ratio_c: dual-clip bound: for ``A < 0`` the per-token loss is at most ``-A * clip_ratio_c``.
    """

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0

    def __post_init__(self) -> None:
        for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"PolicyLossConfig.{name} must be >= 0, got {value}.")
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"PolicyLossConfig.clip_ratio_c must be > 1.0 (dual-clip bound), got {self.clip_ratio_c}.")

    @property
    def low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


def resolve_policy_loss_config(config: Any = None, **overrides: float | None) -> PolicyLossConfig:
    """Build a :class:`PolicyLossConfig` from any config object/mapping with the same field names
    (missing fields take the defaults), then apply the non-``None`` keyword ``overrides``.

    Raises:
        ValueError: an unknown override name, or an invalid value.
    """
    if isinstance(config, PolicyLossConfig) and not any(v is not None for v in overrides.values()):
        return config
    names = ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c")
    fields = {name: config_get(config, name) for name in names}
    for name, value in overrides.items():
        if name not in fields:
            raise ValueError(f"Unknown policy-loss option {name!r}; valid options: {sorted(fields)}.")
        if value is not None:
            fields[name] = value
    return PolicyLossConfig(**{k: v for k, v in fields.items() if v is not None})


class PolicyLossFn(Protocol):
    """Signature of a registered policy loss (verl's, plus optional keyword-only extras)."""

    def __call__(
        self,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = ...,
        config: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]: ...


POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under ``name``.

    Raises:
        ValueError: if a different function is already registered under that name.
    """

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        return add_to_registry(POLICY_LOSS_REGISTRY, name, fn, "Policy loss")

    return decorator


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """Return the policy loss registered under ``name``.

    Raises:
        ValueError: unknown name; the message lists the registered ones.
    """
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(
            f"Unknown policy loss mode {name!r}; valid options: {sorted(POLICY_LOSS_REGISTRY)}. "
            "Register a custom one with @register_policy_loss(name)."
        )
    return POLICY_LOSS_REGISTRY[name]


# ----------------------------------------------------------------------------------------------------------
# policy losses
# ----------------------------------------------------------------------------------------------------------


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    *,
    clip_ratio: float | None = None,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate with asymmetric clip and dual-clip (arXiv:1707.06347, arXiv:1912.09729).

    Per token, with ``ratio = exp(log_prob - old_log_prob)`` (log-ratio clamped to +-20)::

        L = max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))
        L = min(L, -A * clip_ratio_c)          where A < 0   (dual-clip)

    Args:
        old_log_prob: ``[B, T]`` log-probs of the rollout policy.
        log_prob: ``[B, T]`` log-probs of the policy being trained (carries the gradient).
        advantages: ``[B, T]``.
        response_mask: ``[B, T]``.
        loss_agg_mode: see :func:`agg_loss`.
        config: a :class:`PolicyLossConfig` or any object/mapping with its field names (e.g. the actor
            config); may also carry ``global_batch_info`` for :func:`agg_loss`.
        clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c: keyword overrides of ``config``.
        rollout_is_weights: optional ``[B, T]`` importance weights (rollout correction) multiplied in.

    Returns:
        ``pg_loss`` (scalar), ``pg_clipfrac`` (fraction of tokens where the clipped term was active),
        ``ppo_kl`` (mean of ``old_log_prob - log_prob``), ``pg_clipfrac_lower`` (fraction hit by dual-clip).
    """
    cfg = resolve_policy_loss_config(
        config,
        clip_ratio=clip_ratio,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
    )
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cfg.low, 1 + cfg.high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)

    pg_losses3 = -advantages * cfg.clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean((torch.gt(clip_pg_losses1, pg_losses3) & (advantages < 0)).float(), response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_agg_kwargs(config))
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    *,
    clip_ratio: float | None = None,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071), token form "GSPO-token".

    The importance ratio is per sequence, the geometric mean of the token ratios:
    ``s_i = exp(mean_t(log_prob - old_log_prob))`` over the masked tokens. Each token uses
    ``s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]`` (same value as ``s_i``; gradient through its own
    log-prob), clipped to ``[1 - low, 1 + high]`` like PPO (the paper uses tiny ranges, e.g. 3e-4/4e-4).
    With the default ``seq-mean-token-mean`` aggregation this is the paper's sequence-level objective.
    No dual-clip; ``clip_ratio_c`` is accepted for a uniform signature and ignored.

    Args and returns: as :func:`compute_policy_loss_vanilla`; ``pg_clipfrac_lower`` is always 0.
    """
    cfg = resolve_policy_loss_config(
        config,
        clip_ratio=clip_ratio,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
    )
    mask = response_mask.to(log_prob.dtype)
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = masked_sum(negative_approx_kl, mask, axis=-1) / seq_lengths
    log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_importance_ratio = torch.exp(torch.clamp(log_ratio, max=10.0))  # clamp: exp() stays finite

    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - cfg.low, 1 + cfg.high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_agg_kwargs(config))

    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, torch.zeros((), device=pg_loss.device)


# ----------------------------------------------------------------------------------------------------------
# entropy, value and DPO losses
# ----------------------------------------------------------------------------------------------------------


def compute_entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean"
) -> torch.Tensor:
    """Aggregated categorical entropy of the policy (the actor subtracts ``entropy_coeff *`` this).

    Args:
        logits: ``[B, T, V]``.
        response_mask: ``[B, T]``.
    """
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode)


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO as in TRL/verl): ``0.5 * max((v - R)^2, (clip(v, v_old +- c) - R)^2)``.

    Args:
        vpreds: ``[B, T]`` current critic predictions (carry the gradient).
        returns: ``[B, T]`` regression targets (e.g. GAE returns).
        values: ``[B, T]`` critic values at rollout time (the clip centre).
        response_mask: ``[B, T]``.
        cliprange_value: ``c``, e.g. 0.5.
        loss_agg_mode: see :func:`agg_loss`.

    Returns:
        ``vf_loss`` (scalar) and ``vf_clipfrac`` (fraction of tokens where the clipped term was larger).
    """
    vpredclipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.maximum(vf_losses1, vf_losses2), response_mask, loss_agg_mode)
    vf_clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac


def compute_dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor,
    reference_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Sigmoid DPO loss (Rafailov et al. 2023, arXiv:2305.18290), with cDPO label smoothing.

    ``h = (pi_c - pi_r) - (ref_c - ref_r)``;
    ``loss = mean(-(1 - eps) * logsigmoid(beta * h) - eps * logsigmoid(-beta * h))``.

    Args:
        policy_chosen_logps, policy_rejected_logps: ``[B]`` summed log-probs of each response under the policy.
        reference_chosen_logps, reference_rejected_logps: ``[B]`` the same under the frozen reference.
        beta: inverse temperature of the implicit reward.
        label_smoothing: assumed probability that a preference label is flipped (0 = plain DPO).

    Returns:
        scalar loss and metrics: ``dpo/rewards_chosen``, ``dpo/rewards_rejected`` (mean implicit rewards
        ``beta * (pi - ref)``), ``dpo/reward_margin``, ``dpo/reward_accuracy`` (fraction chosen > rejected).

    Raises:
        ValueError: ``label_smoothing`` outside ``[0, 0.5)``.
    """
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"compute_dpo_loss: label_smoothing must be in [0, 0.5), got {label_smoothing}.")
    logits = (policy_chosen_logps - policy_rejected_logps) - (reference_chosen_logps - reference_rejected_logps)
    losses = -(1 - label_smoothing) * F.logsigmoid(beta * logits) - label_smoothing * F.logsigmoid(-beta * logits)
    chosen_rewards = beta * (policy_chosen_logps - reference_chosen_logps).detach()
    rejected_rewards = beta * (policy_rejected_logps - reference_rejected_logps).detach()
    metrics = {
        "dpo/rewards_chosen": chosen_rewards.mean().item(),
        "dpo/rewards_rejected": rejected_rewards.mean().item(),
        "dpo/reward_margin": (chosen_rewards - rejected_rewards).mean().item(),
        "dpo/reward_accuracy": (chosen_rewards > rejected_rewards).float().mean().item(),
    }
    return losses.mean(), metrics
