"""Paired comparison of two models on the same examples: the arithmetic of a promotion gate.

Both models are scored on the *same* examples with the *same* settings, one score per example (1/0 for exact match,
or any float), in the same order. Comparing their two means as if they were independent samples wastes most of the
information: on most examples both are right or both wrong. The paired tests here look at the per-example
differences.

- ``paired_bootstrap``: the mean difference (candidate - baseline) and its percentile interval, resampling examples
  with their pair intact (Efron & Tibshirani 1993; Koehn 2004 for MT).
- ``mcnemar_p_value``: for 0/1 scores, the exact two-sided McNemar test on the discordant pairs (the examples exactly
  one of the two gets right).
- ``decide``: better (the interval's lower end above 0), non-inferior (above ``-margin``), or not; with a hand
  check in tests/test_comparison.py.
- ``detectable_difference``: the smallest true difference a set of ``n`` examples detects with the given power, so a
  config can say what its eval set can and cannot tell apart.
- ``pass_at_k``: one example's score from several sampled responses, the chance that at least one of ``k`` passes
  (the unbiased estimator of Chen et al. 2021, "Evaluating Large Language Models Trained on Code").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PairedComparison:
    n: int
    candidate_mean: float
    baseline_mean: float
    difference: float  # candidate - baseline
    low: float  # the interval of the difference, at ``confidence``
    high: float
    confidence: float


def _paired(candidate, baseline) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(candidate, dtype=float), np.asarray(baseline, dtype=float)
    if a.shape != b.shape or a.ndim != 1 or not len(a):
        raise ValueError(
            f"paired scores need two equally long, non-empty lists (one score per example, same order); got "
            f"{a.shape} and {b.shape}"
        )
    return a, b


def paired_bootstrap(
    candidate, baseline, *, confidence: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> PairedComparison:
    """Mean difference and its two-sided percentile bootstrap interval at ``confidence``."""
    a, b = _paired(candidate, baseline)
    diff = a - b
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), size=(resamples, len(diff)))].mean(axis=1)
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return PairedComparison(len(diff), a.mean(), b.mean(), diff.mean(), float(low), float(high), confidence)


def mcnemar_p_value(candidate, baseline) -> float:
    """Exact two-sided McNemar p-value for 0/1 scores: under "equally good", each discordant example is the
    candidate's with probability 1/2."""
    a, b = _paired(candidate, baseline)
    if not np.isin(a, (0, 1)).all() or not np.isin(b, (0, 1)).all():
        raise ValueError("McNemar's test needs 0/1 scores (right or wrong per example); use paired_bootstrap")
    wins, losses = int(((a == 1) & (b == 0)).sum()), int(((a == 0) & (b == 1)).sum())
    n, k = wins + losses, min(wins, losses)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def decide(comparison: PairedComparison, *, margin: float = 0.0, non_inferior_ok: bool = False) -> str:
    """``"better"`` when the whole interval is above 0; ``"non-inferior"`` when it is above ``-margin`` and
    ``non_inferior_ok``; else ``"worse"`` when the whole interval is below 0, ``"not better"`` otherwise."""
    if comparison.low > 0:
        return "better"
    if non_inferior_ok and comparison.low > -margin:
        return "non-inferior"
    return "worse" if comparison.high < 0 else "not better"


def detectable_difference(n: int, discordant: float, *, confidence: float = 0.95, power: float = 0.8) -> float:
    """The smallest true accuracy difference that ``n`` paired 0/1 examples detect (one-sided test at
    ``confidence``, with ``power``), when a share ``discordant`` of the examples is right for exactly one model:
    ``(z_conf + z_power) * sqrt(discordant / n)`` (the normal approximation of McNemar's test, difference small
    next to ``discordant``)."""
    from statistics import NormalDist

    if n < 1 or not 0 < discordant <= 1:
        raise ValueError(f"need n >= 1 and 0 < discordant <= 1, got n={n}, discordant={discordant}")
    z = NormalDist().inv_cdf(confidence) + NormalDist().inv_cdf(power)
    return z * math.sqrt(discordant / n)


def pass_at_k(n: int, passed: int, k: int) -> float:
    """The chance that at least one of ``k`` responses drawn without replacement from ``n`` sampled ones (``passed``
    of them passing) passes: ``1 - C(n - passed, k) / C(n, k)``, the unbiased pass@k estimate from ``n >= k``
    samples."""
    if not 0 <= passed <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= passed <= n and 1 <= k <= n, got n={n}, passed={passed}, k={k}")
    return 1.0 - math.comb(n - passed, k) / math.comb(n, k)
