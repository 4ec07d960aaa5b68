"""The paired comparison behind a promotion gate (rlworkers.algorithms.comparison), against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from rlworkers.algorithms.comparison import (
    PairedComparison,
    decide,
    detectable_difference,
    mcnemar_p_value,
    paired_bootstrap,
    pass_at_k,
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


def test_decide():
    def comparison(low, high):
        return PairedComparison(100, 0.5, 0.5, (low + high) / 2, low, high, 0.95)

    assert decide(comparison(0.01, 0.08)) == "better"
    assert decide(comparison(-0.03, 0.05)) == "not better"
    assert decide(comparison(-0.03, 0.05), margin=0.05, non_inferior_ok=True) == "non-inferior"
    assert decide(comparison(-0.06, 0.05), margin=0.05, non_inferior_ok=True) == "not better"
    assert decide(comparison(-0.09, -0.01)) == "worse"


def test_detectable_difference_by_hand():
    # z_0.95 + z_0.8 = 1.6449 + 0.8416 = 2.4865; 200 examples, 10% discordant: 2.4865 * sqrt(0.1 / 200) = 0.0556
    assert detectable_difference(200, 0.1) == pytest.approx(2.4865 * (0.1 / 200) ** 0.5, rel=1e-3)
    assert detectable_difference(800, 0.1) == pytest.approx(detectable_difference(200, 0.1) / 2)
    with pytest.raises(ValueError, match="discordant"):
        detectable_difference(100, 0)


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # one of four samples passes: 1/4 for one draw
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert pass_at_k(4, 3, 2) == 1.0 and pass_at_k(4, 0, 4) == 0.0  # two draws always include a passing one
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(2, 1, 3)
