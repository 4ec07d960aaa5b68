"""Masked tensor helpers shared by the advantage estimators and losses.

Same names and semantics as verl's ``verl/utils/torch_functional.py`` (``masked_mean``, ``masked_var``,
``masked_whiten``, ``entropy_from_logits``), so ported code keeps working. Values outside the mask are
replaced by zero before summing, so NaN/inf padding cannot leak into a result.

Shapes: ``B`` = batch (sequences), ``T`` = response length, ``V`` = vocabulary size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "entropy_from_logits",
]


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is non-zero (mask acts as a weight).

    Args:
        values: ``[B, T]`` (any shape broadcastable with ``mask``).
        mask: same shape, 0/1 (bool, int or float).
        axis: reduce this dimension only; ``None`` reduces everything to a scalar.
    """
    mask_f = mask.to(values.dtype)
    # torch.where first: 0 * inf would be NaN, a padded position must contribute exactly nothing.
    return torch.where(mask.bool(), values * mask_f, torch.zeros_like(values)).sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is 1; 0 where the mask is empty.

    Args:
        values: ``[B, T]``.
        mask: ``[B, T]``.
        axis: ``None`` for a scalar over the whole batch, ``-1`` for a per-sequence ``[B]`` mean.
    """
    denom = mask.to(values.dtype).sum(dim=axis)
    # clamp keeps an empty mask at 0 instead of NaN, and is exact (no +eps bias) for any real count.
    return masked_sum(values, mask, axis) / denom.clamp(min=1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over the masked positions (scalar), Bessel-corrected when ``unbiased``.

    Raises:
        ValueError: if the mask selects no element, or exactly one element with ``unbiased=True``.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.to(values.dtype).sum()
        if count == 0:
            raise ValueError("masked_var: the mask selects no element; at least one must be 1.")
        if count == 1:
            raise ValueError(
                "masked_var: the mask selects a single element, so the unbiased variance divides by zero; "
                "pass unbiased=False or a batch with at least two valid tokens."
            )
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``(values - mean) / sqrt(var + 1e-8)`` with mean and unbiased variance over the masked positions.

    Args:
        values: ``[B, T]``.
        mask: ``[B, T]``.
        shift_mean: if False the mean is added back (scale-only whitening), as in verl.

    Returns:
        ``[B, T]``; positions outside the mask are transformed too (callers multiply by the mask).
    """
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Categorical entropy ``H = logsumexp(z) - sum(softmax(z) * z)`` over the last dim.

    Args:
        logits: ``[B, T, V]`` (any leading shape).

    Returns:
        ``[B, T]`` entropy in nats.
    """
    pd = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


def config_get(config: Any, name: str, default: Any = None) -> Any:
    """Read ``name`` from a config that may be ``None``, a mapping (dict, DictConfig) or an object
    (dataclass, pydantic model); a missing or ``None`` value gives ``default``."""
    if config is None:
        return default
    if isinstance(config, Mapping) or (hasattr(config, "get") and not hasattr(config, name)):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return default if value is None else value


def add_to_registry(registry: dict[str, Any], name: str, fn: Callable, what: str) -> Callable:
    """Put ``fn`` in ``registry`` under ``name`` and return it (the body of the ``register_*`` decorators).

    Registering the same definition again is allowed: a module reload re-creates its function objects.

    Raises:
        ValueError: a different function is already registered under ``name`` (``what`` names the kind).
    """
    existing = registry.get(name)
    if existing is not None and _definition(existing) != _definition(fn):
        raise ValueError(f"{what} {name!r} is already registered ({existing.__qualname__}).")
    registry[name] = fn
    return fn


def _definition(fn: Callable) -> tuple[str | None, str | None]:
    return getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
