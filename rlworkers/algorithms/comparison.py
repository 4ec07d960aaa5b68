"""Paired comparison of two models on the same examples: the arithmetic of a promotion gate.

Both models are scored on the *same* examples with the *same* settings, one score per example (1/0 for exact match,
or any float: a sampled mean, pass@k), in the same order. Comparing their two means as if they were independent
samples wastes most of the information: on most examples both are right or both wrong. The paired tests here look
at the per-example differences.

- ``paired_bootstrap``: the mean difference (candidate - baseline) and its percentile interval, resampling examples
  with their pair intact (Efron & Tibshirani 1993; Koehn 2004 for MT), with the counts of examples the candidate
  scored higher (wins) and lower (losses) on.
- ``sign_test_p_value``: the exact sign test on those counts: under "equally good", each example the two scored
  differently on is a win with probability 1/2. For 0/1 scores it is McNemar's exact test (``mcnemar_p_value``);
  for fractional scores it keeps a few examples moving by a little from counting as an improvement.
- ``decide``: better (the interval's lower end above 0 *and* significantly more wins than losses), worse (the
  mirror image), non-inferior (the lower end above ``-margin``), or not better; each one-sided at
  ``(1 - confidence) / 2``, the tail a two-sided ``confidence`` interval leaves on each side.
- ``sign_test_power`` and ``detectable_difference``: the chance that ``decide`` finds a true difference, computed
  exactly for its sign test, and the smallest difference found with a given power, so a config can say what its
  eval set can and cannot tell apart.
- ``pass_at_k``: one example's score from several sampled responses, the chance that at least one of ``k`` passes
  (the unbiased estimator of Chen et al. 2021, "Evaluating Large Language Models Trained on Code").

Hand checks of each: tests/test_comparison.py.
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
    wins: int = 0  # examples the candidate scored higher on
    losses: int = 0  # examples it scored lower on

    @property
    def discordant(self) -> float:
        """The share of examples the two scored differently on."""
        return (self.wins + self.losses) / self.n

    @property
    def p_value(self) -> float:
        """The two-sided exact sign test (McNemar's test for 0/1 scores)."""
        return sign_test_p_value(self.wins, self.losses)


def _paired(candidate, baseline) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(candidate, dtype=float), np.asarray(baseline, dtype=float)
    if a.shape != b.shape or a.ndim != 1 or not len(a):
        raise ValueError(
            f"paired scores need two equally long, non-empty lists (one score per example, same order); got "
            f"{a.shape} and {b.shape}"
        )
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        bad = int((~np.isfinite(a)).sum() + (~np.isfinite(b)).sum())
        raise ValueError(f"paired scores must be finite numbers; {bad} are NaN or infinite")
    return a, b


def paired_bootstrap(
    candidate, baseline, *, confidence: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> PairedComparison:
    """Mean difference and its two-sided percentile bootstrap interval at ``confidence``, with the wins and losses
    the sign test reads."""
    a, b = _paired(candidate, baseline)
    diff = a - b
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), size=(resamples, len(diff)))].mean(axis=1)
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    wins, losses = int((diff > 0).sum()), int((diff < 0).sum())
    return PairedComparison(
        len(diff), a.mean(), b.mean(), diff.mean(), float(low), float(high), confidence, wins, losses
    )


def binomial_upper_tail(n: int, k: int) -> float:
    """P(X >= k) for X ~ Binomial(n, 1/2), exactly: the sum of C(n, i) for i >= k, over 2**n."""
    if k <= 0:
        return 1.0
    total, term = 0, math.comb(n, k) if k <= n else 0
    for i in range(k, n + 1):  # C(n, i + 1) = C(n, i) * (n - i) / (i + 1), in integers
        total += term
        term = term * (n - i) // (i + 1)
    return total / 2**n


def sign_test_p_value(wins: int, losses: int, alternative: str = "two-sided") -> float:
    """The exact sign test: under "equally good", each of the ``wins + losses`` examples the two scored differently
    on is a win with probability 1/2 (the examples they tied on say nothing). ``"greater"``: P(at least ``wins``
    wins), the evidence that the candidate is better; ``"less"``: P(at least ``losses`` losses); ``"two-sided"``:
    twice the smaller of the two, at most 1."""
    greater, less = binomial_upper_tail(wins + losses, wins), binomial_upper_tail(wins + losses, losses)
    if alternative == "greater":
        return greater
    if alternative == "less":
        return less
    if alternative != "two-sided":
        raise ValueError(f"alternative is 'two-sided', 'greater' or 'less', not {alternative!r}")
    return min(1.0, 2 * min(greater, less))


def mcnemar_p_value(candidate, baseline) -> float:
    """Exact two-sided McNemar p-value for 0/1 scores: the sign test on the discordant examples (those exactly one
    of the two gets right)."""
    a, b = _paired(candidate, baseline)
    if not np.isin(a, (0, 1)).all() or not np.isin(b, (0, 1)).all():
        raise ValueError("McNemar's test needs 0/1 scores (right or wrong per example); use sign_test_p_value")
    return sign_test_p_value(int((a > b).sum()), int((a < b).sum()))


def decide(comparison: PairedComparison, *, margin: float = 0.0, non_inferior_ok: bool = False) -> str:
    """The verdict on a comparison; each claim is one-sided at ``alpha = (1 - confidence) / 2`` (2.5% at 0.95):

    - ``"better"``: the whole interval above 0 and the sign test's one-sided p (more wins than chance) below alpha;
    - ``"non-inferior"`` (with ``non_inferior_ok``): the interval's lower end above ``-margin``;
    - ``"worse"``: the whole interval below 0 and the sign test's one-sided p (more losses than chance) below alpha;
    - ``"not better"`` otherwise.

    The sign test keeps a handful of examples from deciding: 4 of 200 up and none down puts a percentile bootstrap
    interval above 0, but its exact p is 1/16."""
    c = comparison
    alpha = (1 - c.confidence) / 2
    if c.low > 0 and sign_test_p_value(c.wins, c.losses, "greater") < alpha:
        return "better"
    if non_inferior_ok and c.low > -margin:
        return "non-inferior"
    if c.high < 0 and sign_test_p_value(c.wins, c.losses, "less") < alpha:
        return "worse"
    return "not better"


def _binomial_pmf(m: int, p: float, log_factorials: np.ndarray) -> np.ndarray:
    """P(X = k) for k = 0..m, X ~ Binomial(m, p), through logs (``log_factorials[i]`` = log i!)."""
    k = np.arange(m + 1)
    if p <= 0 or p >= 1:
        return (k == (m if p >= 1 else 0)).astype(float)
    log_comb = log_factorials[m] - log_factorials[k] - log_factorials[m - k]
    return np.exp(log_comb + k * math.log(p) + (m - k) * math.log1p(-p))


def _power_curve(n: int, discordant: float, confidence: float):
    """``power(difference)`` of ``sign_test_power`` for fixed ``n``, ``discordant`` and ``confidence``: the parts
    that do not depend on the difference (how many examples are discordant, the sign test's critical number of
    wins for each) computed once."""
    if n < 1 or not 0 < discordant <= 1 or not 0.5 < confidence < 1:
        raise ValueError(
            f"need n >= 1, 0 < discordant <= 1 and 0.5 < confidence < 1, got n={n}, discordant={discordant}, "
            f"confidence={confidence}"
        )
    alpha = (1 - confidence) / 2
    log_factorials = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n + 1)))])
    chance_discordant = _binomial_pmf(n, discordant, log_factorials)  # of m = 0..n discordant examples
    critical = {}  # m -> the fewest wins of m the sign test calls significant (P(X >= k) < alpha under 1/2)
    for m in np.flatnonzero(chance_discordant > 1e-12 * chance_discordant.max()):
        upper_tails = np.cumsum(_binomial_pmf(int(m), 0.5, log_factorials)[::-1])[::-1]  # P(X >= k), k = 0..m
        significant = np.flatnonzero(upper_tails < alpha)
        if len(significant):
            critical[int(m)] = int(significant[0])

    def power(difference: float) -> float:
        if not 0 <= difference <= discordant:
            raise ValueError(f"the difference is between 0 and the discordant share {discordant}, not {difference}")
        win = (discordant + difference) / (2 * discordant)  # the chance that a discordant example is a win
        return float(
            sum(chance_discordant[m] * _binomial_pmf(m, win, log_factorials)[k:].sum() for m, k in critical.items())
        )

    return power


def sign_test_power(n: int, discordant: float, difference: float, *, confidence: float = 0.95) -> float:
    """The chance that ``decide``'s sign test (McNemar's for 0/1 scores) finds the candidate significantly better,
    one-sided at ``(1 - confidence) / 2``, when each of ``n`` examples is independently a win with probability
    ``(discordant + difference) / 2``, a loss with ``(discordant - difference) / 2`` and a tie otherwise (for 0/1
    scores ``difference`` is the true accuracy difference). Exact: the sum over the number ``m`` of discordant
    examples (Binomial(n, discordant)) of the chance that the wins among them (Binomial(m, win share)) reach the
    test's critical count (floating point, terms below 1e-12 of the largest left out). The interval's condition
    (its lower end above 0) is left out: for 0/1 scores the exact test is the stricter of the two."""
    return _power_curve(n, discordant, confidence)(difference)


def detectable_difference(n: int, discordant: float, *, confidence: float = 0.95, power: float = 0.8) -> float:
    """The smallest true difference (wins - losses share; for 0/1 scores the accuracy difference) that ``n``
    paired examples detect with ``power`` under ``decide``'s test (``sign_test_power``), when a share
    ``discordant`` of the examples is scored differently by the two models; ``math.inf`` when even a candidate
    winning every discordant example is found less often than that (too few examples). Found by bisection to
    1e-6 (the power grows with the difference)."""
    if not 0 < power < 1:
        raise ValueError(f"need 0 < power < 1, got {power}")
    curve = _power_curve(n, discordant, confidence)
    low, high = 0.0, discordant
    if curve(high) < power:
        return math.inf
    while high - low > 1e-6:
        middle = (low + high) / 2
        low, high = (low, middle) if curve(middle) >= power else (middle, high)
    return high


def pass_at_k(n: int, passed: int, k: int) -> float:
    """The chance that at least one of ``k`` responses drawn without replacement from ``n`` sampled ones (``passed``
    of them passing) passes: ``1 - C(n - passed, k) / C(n, k)``, the unbiased pass@k estimate from ``n >= k``
    samples."""
    if not 0 <= passed <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= passed <= n and 1 <= k <= n, got n={n}, passed={passed}, k={k}")
    return 1.0 - math.comb(n - passed, k) / math.comb(n, k)
