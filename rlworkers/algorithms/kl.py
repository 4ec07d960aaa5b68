"""KL estimators, KL controllers and the KL-in-reward penalty (verl ``core_algos`` / ``ray_trainer``).

* :func:`kl_penalty`: per-token estimators of KL(pi || pi_ref) from sampled log-probs, after
  J. Schulman, "Approximating KL divergence" (2020, http://joschu.net/blog/kl-approx.html):
  ``kl``/``k1`` = logp - ref; ``abs``; ``mse``/``k2`` = 0.5 (logp - ref)^2;
  ``low_var_kl``/``k3`` = exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10].
  A ``+`` suffix (``k1+``, ``k3+``, ...) keeps the forward value but takes the gradient of k2
  (straight-through), whose gradient is the unbiased one. ``full`` (exact KL over the vocabulary)
  is not implemented.
* :class:`FixedKLController` and :class:`AdaptiveKLController` (Ziegler et al. 2019, arXiv:1909.08593),
  both with ``state_dict``/``load_state_dict`` so a resumed run continues with the adapted coefficient.
* :func:`apply_kl_penalty`: ``token_level_rewards = token_level_scores - beta * KL`` on the response tokens.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from rlworkers.algorithms.utils import config_get, masked_mean

__all__ = [
    "KL_PENALTY_MODES",
    "kl_penalty",
    "KLController",
    "FixedKLController",
    "AdaptiveKLController",
    "get_kl_controller",
    "apply_kl_penalty",
]

KL_PENALTY_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")
# what a config may name: every mode but ``full``, and the straight-through (``+``) variants
KL_ESTIMATORS = tuple(m for m in KL_PENALTY_MODES if m != "full") + ("kl+", "k1+", "abs+", "low_var_kl+", "k3+")


def _kl_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, mode: str) -> torch.Tensor:
    if mode in ("kl", "k1"):
        return logprob - ref_logprob
    if mode == "abs":
        return (logprob - ref_logprob).abs()
    if mode in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if mode in ("low_var_kl", "k3"):
        log_ratio = torch.clamp(ref_logprob - logprob, min=-20, max=20)  # keeps exp() finite
        kld = torch.exp(log_ratio) - log_ratio - 1
        return torch.clamp(kld, min=-10, max=10)
    if mode == "full":
        raise NotImplementedError("kl_penalty='full' needs full-vocabulary log-probs; use 'k1' or 'low_var_kl'.")
    raise ValueError(f"Unknown kl_penalty {mode!r}; valid options: {list(KL_ESTIMATORS)}.")


def _kl_estimate(logprob: torch.Tensor, ref_logprob: torch.Tensor, mode: str) -> torch.Tensor:
    straight_through = mode.endswith("+")
    base = mode[:-1] if straight_through else mode
    forward = _kl_forward(logprob, ref_logprob, base)
    if not straight_through or base in ("mse", "k2"):
        return forward
    # k1/k3 have the right expected value but not the right expected gradient; k2 has the right gradient.
    backward = 0.5 * (logprob - ref_logprob).square()
    return backward - backward.detach() + forward.detach()


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference policy.

    Args:
        logprob: ``[B, T]`` log-probs of the sampled tokens under the policy.
        ref_logprob: ``[B, T]`` log-probs of the same tokens under the reference policy.
        kl_penalty: estimator name, see the module docstring (``kl``/``k1``, ``abs``, ``mse``/``k2``,
            ``low_var_kl``/``k3``, optionally with a ``+`` suffix).

    Returns:
        ``[B, T]`` KL estimate (not masked).

    Raises:
        ValueError: unknown estimator name (the message lists the valid ones).
        NotImplementedError: ``full``.
    """
    return _kl_estimate(logprob, ref_logprob, kl_penalty)


@runtime_checkable
class KLController(Protocol):
    """What the trainer needs from a KL coefficient controller."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class FixedKLController:
    """Constant KL coefficient. ``update`` is a no-op.

    ``load_state_dict`` deliberately ignores the saved value: a fixed coefficient comes from config, so
    changing ``kl_coef`` before resuming takes effect.
    """

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (the coefficient is fixed)."""

    def state_dict(self) -> dict[str, Any]:
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state(state, "fixed")


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv:1909.08593, section 2.2).

    ``value *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon``: the coefficient grows
    when the measured KL exceeds the target and shrinks when it is below, at most 20% per horizon.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if horizon <= 0:
            raise ValueError(f"AdaptiveKLController: horizon must be > 0, got {horizon}.")
        if target_kl <= 0:
            raise ValueError(f"AdaptiveKLController: target_kl must be > 0, got {target_kl}.")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adapt ``value`` after ``n_steps`` samples whose mean KL was ``current_kl``."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"type": "adaptive", "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the adapted coefficient; target and horizon stay as configured."""
        _check_state(state, "adaptive")
        self.value = float(state["value"])


def _check_state(state: dict[str, Any], expected_type: str) -> None:
    if "value" not in state:
        raise ValueError(f"KL controller state has no 'value' key: {state!r}.")
    saved = state.get("type", expected_type)
    if saved != expected_type:
        raise ValueError(
            f"Cannot load a {saved!r} KL controller state into a {expected_type!r} controller; "
            f"set kl_ctrl.type={saved!r} to resume this checkpoint."
        )


def get_kl_controller(kl_ctrl: Any) -> FixedKLController | AdaptiveKLController:
    """Build a controller from a ``kl_ctrl`` config (object or mapping) with verl's fields and defaults:
    ``type`` (``fixed`` | ``adaptive``, default ``fixed``), ``kl_coef`` (0.001), ``target_kl`` (0.1),
    ``horizon`` (10000).

    Raises:
        ValueError: unknown ``type`` (lists the valid ones) or a non-positive ``horizon``/``target_kl``.
    """
    ctrl_type = config_get(kl_ctrl, "type", "fixed")
    kl_coef = float(config_get(kl_ctrl, "kl_coef", 0.001))
    if ctrl_type == "fixed":
        return FixedKLController(kl_coef=kl_coef)
    if ctrl_type == "adaptive":
        return AdaptiveKLController(
            init_kl_coef=kl_coef,
            target_kl=float(config_get(kl_ctrl, "target_kl", 0.1)),
            horizon=int(config_get(kl_ctrl, "horizon", 10000)),
        )
    raise ValueError(f"Unknown kl_ctrl.type {ctrl_type!r}; valid options: ['adaptive', 'fixed'].")


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: KLController,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-in-reward (InstructGPT-style): ``rewards = scores - beta * KL(old || ref)`` on response tokens,
    then ``kl_ctrl.update(batch mean KL, n_steps=B)``.

    Args:
        token_level_scores: ``[B, T]`` rewards from the reward function/model.
        old_log_prob: ``[B, T]`` log-probs of the rollout policy.
        ref_log_prob: ``[B, T]`` log-probs of the reference policy.
        response_mask: ``[B, T]``.
        kl_ctrl: a :class:`KLController`; its ``value`` is beta.
        kl_penalty: KL estimator name (see :func:`kl_penalty`).

    Returns:
        ``token_level_rewards`` ``[B, T]`` and metrics ``{"actor/reward_kl_penalty": mean over sequences of
        the per-sequence mean KL, "actor/reward_kl_penalty_coeff": beta used for this batch}``.
    """
    mask = response_mask.to(old_log_prob.dtype)
    kld = _kl_estimate(old_log_prob, ref_log_prob, kl_penalty) * mask
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = masked_mean(kld, mask, axis=-1).mean().item()
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": float(beta)}
    return token_level_rewards, metrics
