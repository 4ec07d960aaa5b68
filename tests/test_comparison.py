"""The paired comparison behind a promotion gate (rlworkers.algorithms.comparison), against hand-computed values.
The gate's error rates by simulation on these functions: tests/test_evaluation.py and bench/gate_error_rates.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rlworkers.algorithms.comparison import (
    PairedComparison,
    decide,
    detectable_difference,
    mcnemar_p_value,
    paired_bootstrap,
    pass_at_k,
    sign_test_p_value,
    sign_test_power,
)


def test_mcnemar_by_hand():
    # 10 examples: the candidate alone right on 3, the baseline alone right on 1, both right on 4, both wrong on 2.
    candidate = [1, 1, 1, 0, 1, 1, 1, 1, 0, 0]
    baseline = [0, 0, 0, 1, 1, 1, 1, 1, 0, 0]
    # discordant n=4, k=min(3,1)=1: P(X<=1) = (C(4,0)+C(4,1))/16 = 5/16; two-sided 10/16
    assert mcnemar_p_value(candidate, baseline) == pytest.approx(10 / 16)
    assert mcnemar_p_value(candidate, candidate) == 1.0
    # 12 discordant, all the candidate's: 2 * 1/4096
    assert mcnemar_p_value([1] * 12 + [0] * 5, [0] * 12 + [0] * 5) == pytest.approx(2 / 4096)
    with pytest.raises(ValueError, match="0/1 scores"):
        mcnemar_p_value([0.5, 1], [0, 1])


def test_bootstrap_of_identical_models_is_a_point_and_of_a_constant_shift_too():
    same = paired_bootstrap([1, 0, 1, 1], [1, 0, 1, 1])
    assert (same.difference, same.low, same.high) == (0.0, 0.0, 0.0)
    shifted = paired_bootstrap([0.7, 0.4, 0.9], [0.5, 0.2, 0.7])  # every pair differs by exactly 0.2
    assert shifted.difference == pytest.approx(0.2) and shifted.low == pytest.approx(0.2)
    assert shifted.high == pytest.approx(0.2) and shifted.n == 3


def test_bootstrap_interval_matches_the_normal_approximation_on_a_large_set():
    rng = np.random.default_rng(1)
    # both right 55%, both wrong 35%, the candidate alone 5%, the baseline alone 5%: no true difference
    kind = rng.choice(4, size=2000, p=[0.55, 0.35, 0.05, 0.05])
    candidate, baseline = np.isin(kind, (0, 2)).astype(float), np.isin(kind, (0, 3)).astype(float)
    result = paired_bootstrap(candidate, baseline, resamples=4000)
    diff = candidate - baseline
    half = 1.96 * diff.std() / np.sqrt(len(diff))
    assert result.low == pytest.approx(diff.mean() - half, abs=0.004)
    assert result.high == pytest.approx(diff.mean() + half, abs=0.004)
    assert decide(result) == "not better"  # noise is not promoted


def test_sign_test_by_hand():
    # 3 wins, 1 loss: P(X >= 3) = (C(4,3) + C(4,4)) / 16 = 5/16; P(X >= 1) = 15/16; two-sided 2 * 5/16
    assert sign_test_p_value(3, 1, "greater") == pytest.approx(5 / 16)
    assert sign_test_p_value(3, 1, "less") == pytest.approx(15 / 16)
    assert sign_test_p_value(3, 1) == pytest.approx(10 / 16) == sign_test_p_value(1, 3)
    assert sign_test_p_value(4, 0, "greater") == 1 / 16 and sign_test_p_value(4, 0) == 1 / 8
    assert sign_test_p_value(0, 0) == 1.0 and sign_test_p_value(5, 5) == 1.0
    # fractional scores: wins and losses are the examples that moved up and down, whatever the size of the move
    moved = paired_bootstrap([0.5, 0.25, 1.0, 0.75, 0.5], [0.25, 0.25, 0.875, 1.0, 0.5])
    assert (moved.wins, moved.losses, moved.discordant) == (2, 1, 0.6)
    with pytest.raises(ValueError, match="alternative"):
        sign_test_p_value(1, 1, "bigger")


def test_decide():
    def comparison(low, high, wins, losses):
        return PairedComparison(100, 0.5, 0.5, (low + high) / 2, low, high, 0.95, wins, losses)

    # 12 wins, 2 losses: P(X >= 12 of 14) = (1 + 14 + 91) / 16384 = 0.0065 < 0.025
    assert sign_test_p_value(12, 2, "greater") == pytest.approx(106 / 16384)
    assert decide(comparison(0.01, 0.08, 12, 2)) == "better"
    assert decide(comparison(-0.03, 0.05, 5, 4)) == "not better"
    assert decide(comparison(-0.03, 0.05, 5, 4), margin=0.05, non_inferior_ok=True) == "non-inferior"
    assert decide(comparison(-0.06, 0.05, 5, 4), margin=0.05, non_inferior_ok=True) == "not better"
    assert decide(comparison(-0.09, -0.01, 2, 12)) == "worse"


def test_an_interval_past_zero_is_not_enough_without_the_sign_test():
    """Better and worse both need the exact sign test: 4 examples up (or down) by 0.25, every other one tied, put
    a percentile bootstrap interval wholly above (below) 0, but the one-sided p is 1/16, not below 0.025."""
    baseline = [0.5] * 196 + [0.25, 0.5, 0.25, 0.5]
    up = [0.5] * 196 + [0.5, 0.75, 0.5, 0.75]
    better = paired_bootstrap(up, baseline)
    assert better.low > 0 and (better.wins, better.losses) == (4, 0)
    assert decide(better) == "not better" and sign_test_p_value(4, 0, "greater") == 1 / 16
    worse = paired_bootstrap(baseline, up)
    assert worse.high < 0 and decide(worse) == "not better"
    # the same with 0/1 scores, and with enough examples moving it is significant: 7 of 7 up, p = 1/128
    assert decide(paired_bootstrap([1] * 4 + [0] * 196, [0] * 200)) == "not better"
    assert decide(paired_bootstrap([1] * 7 + [0] * 193, [0] * 200)) == "better"
    assert decide(paired_bootstrap([0] * 200, [1] * 7 + [0] * 193)) == "worse"


def test_scores_that_are_not_finite_or_missing_cannot_be_paired():
    with pytest.raises(ValueError, match="finite"):
        paired_bootstrap([1.0, math.nan], [1.0, 0.0])
    with pytest.raises(ValueError, match="non-empty"):
        paired_bootstrap([], [])


def test_sign_test_power_by_hand():
    """One-sided at 2.5%: of 6 discordant examples all 6 must be wins (P(X >= 6) = 1/64 < 0.025 <= P(X >= 5) =
    7/64), of 7 all 7 (1/128; 8/128 for 6), and fewer than 6 are never significant."""
    # n = 6, every example discordant, difference 0.5: a win with probability 3/4, six of them: 0.75**6
    assert sign_test_power(6, 1.0, 0.5) == pytest.approx(0.75**6)
    # n = 7, half discordant, difference 0.25: a discordant example is a win with (0.5 + 0.25) / 1 = 0.75;
    # P(6 discordant) = 7/128 needs 6 wins, P(7 discordant) = 1/128 needs 7
    assert sign_test_power(7, 0.5, 0.25) == pytest.approx(7 / 128 * 0.75**6 + 1 / 128 * 0.75**7)
    assert sign_test_power(5, 1.0, 1.0) == 0.0  # 5 examples are never significant
    # no true difference: found at most 2.5% of the time (less: the test is discrete)
    assert 0.01 < sign_test_power(200, 0.13, 0.0) <= 0.025


def test_detectable_difference_is_what_the_gates_exact_test_detects():
    """The smallest difference found with 80% power by decide's exact test, one-sided at 2.5%: for 200 examples
    and 13% discordant 0.074 (the normal approximation with a one-sided 5% test said 0.063, found 64% of the
    time). tests/test_evaluation.py checks it against a simulation of the gate."""
    size = detectable_difference(200, 0.13)
    assert size == pytest.approx(0.0738, abs=5e-4)
    assert sign_test_power(200, 0.13, size) >= 0.8 > sign_test_power(200, 0.13, size - 1e-5)
    assert sign_test_power(200, 0.13, 0.063) == pytest.approx(0.64, abs=0.01)
    # four times the examples, about half the difference (the normal approximation's 1/sqrt(n), for large n)
    assert detectable_difference(800, 0.13) / size == pytest.approx(0.5, abs=0.03)
    assert detectable_difference(200, 0.13, power=0.5) < size < detectable_difference(200, 0.13, confidence=0.99)
    assert detectable_difference(20, 0.1) == math.inf  # 2 discordant examples of 20: never significant
    with pytest.raises(ValueError, match="discordant"):
        detectable_difference(100, 0)


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # one of four samples passes: 1/4 for one draw
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert pass_at_k(4, 3, 2) == 1.0 and pass_at_k(4, 0, 4) == 0.0  # two draws always include a passing one
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(2, 1, 3)
