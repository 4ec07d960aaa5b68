"""Unit tests of rlworkers.algorithms.core_algos against hand-computed values.

Every expected number is worked out in the comment next to it, independently of the code under test
(whitening uses ``statistics.stdev``, not the package's masked helpers). CPU only, runs in about a second:
``pytest tests/test_algorithms.py -q``.
"""

from __future__ import annotations

import math
import statistics
import types
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from rlworkers.algorithms import core_algos as ca
from rlworkers.algorithms.utils import add_to_registry


def close(actual, expected, tol=1e-5):
    """Compare a tensor / float with a nested list / float of expected values."""
    actual_t = torch.as_tensor(actual, dtype=torch.float64)
    expected_t = torch.as_tensor(expected, dtype=torch.float64)
    assert actual_t.shape == expected_t.shape, (actual_t.shape, expected_t.shape)
    assert torch.allclose(actual_t, expected_t, atol=tol, rtol=tol), f"\n{actual_t}\n!=\n{expected_t}"


def whiten(xs):
    """Reference whitening: (x - mean) / sample std, the arithmetic done by hand with `statistics`."""
    mean, std = statistics.mean(xs), statistics.stdev(xs)
    return [(x - mean) / std for x in xs]


T = torch.tensor


# ----------------------------------------------------------------------------------------------------------
# masked helpers and token-level scores
# ----------------------------------------------------------------------------------------------------------


def test_masked_helpers_ignore_padding_even_if_nan():
    values = T([[1.0, 2.0, float("nan")], [3.0, float("inf"), 0.0]])
    mask = T([[1, 1, 0], [1, 0, 0]])
    # valid = 1, 2, 3 -> mean 2; deviations -1, 0, 1 -> sum sq 2; unbiased var = 2 / (3 - 1) = 1
    close(ca.masked_mean(values, mask), 2.0)
    close(ca.masked_mean(values, mask, axis=-1), [1.5, 3.0])
    close(ca.masked_var(values, mask), 1.0)
    close(ca.masked_var(values, mask, unbiased=False), 2.0 / 3.0)
    # whitened valid entries: (x - 2) / sqrt(1 + 1e-8)
    close(ca.masked_whiten(values, mask)[mask.bool()], [-1.0, 0.0, 1.0])
    # an empty mask has mean 0, not NaN
    close(ca.masked_mean(values, torch.zeros_like(mask)), 0.0)


def test_masked_var_single_element_raises():
    with pytest.raises(ValueError, match="single element"):
        ca.masked_var(T([[1.0, 2.0]]), T([[1, 0]]))


def test_compute_token_level_scores_last_valid_token():
    mask = T([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0]])  # last row: multi-turn hole
    out = ca.compute_token_level_scores(T([1.0, 2.0, 3.0, 4.0]), mask)
    close(out, [[0, 0, 0, 1.0], [2.0, 0, 0, 0], [0, 3.0, 0, 0], [0, 0, 4.0, 0]])
    with pytest.raises(ValueError, match="one per row"):
        ca.compute_token_level_scores(T([1.0]), mask)


def test_compute_token_level_scores_empty_row_keeps_score_in_row_sum():
    out = ca.compute_token_level_scores([0.5, 1.0], T([[0, 0], [1, 1]]))
    close(out, [[0.5, 0.0], [0.0, 1.0]])


# ----------------------------------------------------------------------------------------------------------
# advantage estimators
# ----------------------------------------------------------------------------------------------------------


def test_gae_1x3_by_hand():
    rewards = T([[0.0, 0.0, 1.0]])
    values = T([[0.5, 0.6, 0.7]])
    mask = T([[1, 1, 1]])
    gamma, lam = 0.9, 0.8  # gamma * lam = 0.72
    adv, ret = ca.compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    # t=2: delta = 1 + 0.9*0 - 0.7 = 0.3                   A2 = 0.3
    # t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03                A1 = 0.03 + 0.72*0.3 = 0.246
    # t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04                A0 = 0.04 + 0.72*0.246 = 0.21712
    raw = [0.21712, 0.246, 0.3]
    close(ret, [[0.21712 + 0.5, 0.246 + 0.6, 0.3 + 0.7]])  # returns = A + V = [0.71712, 0.846, 1.0]
    close(adv, [whiten(raw)], tol=1e-4)


def test_gae_masked_uneven_lengths_skip_padding():
    rewards = T([[0.0, 0.0, 1.0], [0.0, 1.0, 5.0]])  # row 1's reward 5.0 sits on padding
    values = T([[0.5, 0.6, 0.7], [0.5, 0.6, 0.9]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    adv, ret = ca.compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 0 as in the 1x3 test: raw A = [0.21712, 0.246, 0.3]
    # row 1, t=2 masked: carries stay 0 (no bootstrap from V=0.9, reward 5 ignored)
    #        t=1: delta = 1 + 0.9*0 - 0.6 = 0.4            A1 = 0.4
    #        t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04         A0 = 0.04 + 0.72*0.4 = 0.328
    close(ret[1, :2], [0.328 + 0.5, 0.4 + 0.6])
    raw_valid = [0.21712, 0.246, 0.3, 0.328, 0.4]  # whitening is over the 5 valid tokens only
    w = whiten(raw_valid)
    close(adv, [[w[0], w[1], w[2]], [w[3], w[4], 0.0]], tol=1e-4)


def _grpo_batch():
    # Two groups, interleaved, uneven lengths; scores placed on the last valid token.
    index = np.array(["a", "b", "a", "b", "b"], dtype=object)
    mask = T([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
    scores = T([1.0, 2.0, 0.0, 4.0, 6.0])
    return ca.compute_token_level_scores(scores, mask), mask, index


def test_grpo_with_std_normalisation():
    rewards, mask, index = _grpo_batch()
    adv, ret = ca.compute_grpo_outcome_advantage(rewards, mask, index)
    # group a: [1, 0] mean 0.5, sample std sqrt(((0.5)^2 + (0.5)^2) / 1) = 0.70711 -> +-0.70711
    # group b: [2, 4, 6] mean 4, sample std sqrt((4 + 0 + 4) / 2) = 2        -> -1, 0, 1
    per_row = [0.5 / math.sqrt(0.5), -1.0, -0.5 / math.sqrt(0.5), 0.0, 1.0]
    close(adv, (T(per_row).unsqueeze(-1) * mask).tolist())
    assert torch.equal(adv, ret)


def test_grpo_without_std_normalisation_dr_grpo():
    rewards, mask, index = _grpo_batch()
    adv, _ = ca.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    # only the group mean is removed: a -> [0.5, -0.5], b -> [-2, 0, 2]
    per_row = [0.5, -2.0, -0.5, 0.0, 2.0]
    close(adv, (T(per_row).unsqueeze(-1) * mask).tolist())


def test_grpo_singleton_group_and_index_length_check():
    rewards = T([[0.0, 3.0]])
    adv, _ = ca.compute_grpo_outcome_advantage(rewards, T([[1, 1]]), np.array(["only"]))
    # a group of one uses mean 0, std 1: 3 / (1 + 1e-6)
    close(adv, [[3.0, 3.0]])
    with pytest.raises(ValueError, match="one uid per row"):
        ca.compute_grpo_outcome_advantage(rewards, T([[1, 1]]), np.array(["x", "y"]))


def test_grpo_passk_only_best_gets_advantage():
    rewards = T([[1.0], [0.0], [0.5]])
    mask = T([[1], [1], [1]])
    index = np.array(["g", "g", "g"])
    adv, _ = ca.compute_grpo_passk_outcome_advantage(rewards, mask, index)
    # best = 1.0, second = 0.5 -> 0.5; group sample std of [1, 0, 0.5] = 0.5 -> 0.5 / 0.5 = 1.0
    close(adv, [[1.0], [0.0], [0.0]])
    adv, _ = ca.compute_grpo_passk_outcome_advantage(rewards, mask, index, config={"norm_adv_by_std_in_grpo": False})
    close(adv, [[0.5], [0.0], [0.0]])


def test_rloo_leave_one_out():
    mask = T([[1, 1], [1, 0], [1, 1], [1, 1]])
    rewards = ca.compute_token_level_scores(T([1.0, 0.0, 0.5, 7.0]), mask)
    index = np.array(["g", "g", "g", "solo"])
    adv, _ = ca.compute_rloo_outcome_advantage(rewards, mask, index)
    # group g = [1, 0, 0.5]: A_i = r_i - mean(others)
    #   1   - (0 + 0.5)/2 = 0.75;  0 - (1 + 0.5)/2 = -0.75;  0.5 - (1 + 0)/2 = 0
    # the singleton keeps its raw score 7
    close(adv, [[0.75, 0.75], [-0.75, 0.0], [0.0, 0.0], [7.0, 7.0]])


def test_reinforce_plus_plus_discounted_returns_and_whitening():
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]])  # 9.0 sits on padding of row 1
    mask = T([[1, 1, 1], [1, 1, 0]])
    adv, ret = ca.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config={"gamma": 0.5})
    # row 0: G2 = 1; G1 = 0 + 0.5*1 = 0.5; G0 = 0 + 0.5*0.5 = 0.25
    # row 1: G2 = 9 (then reset to 0 because masked); G1 = 2; G0 = 0 + 0.5*2 = 1
    close(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 9.0]])
    # whiten the 5 valid returns [0.25, 0.5, 1, 1, 2]: mean 0.95, sum sq dev 1.8, var 1.8/4 = 0.45
    # std 0.670820 -> [-1.04350, -0.67082, 0.07454, 0.07454, 1.56525]
    expected = [
        [-0.7 / math.sqrt(0.45), -0.45 / math.sqrt(0.45), 0.05 / math.sqrt(0.45)],
        [0.05 / math.sqrt(0.45), 1.05 / math.sqrt(0.45), 0.0],
    ]
    close(adv, expected, tol=1e-4)


def test_reinforce_plus_plus_gamma_defaults_to_one():
    _, ret = ca.compute_reinforce_plus_plus_outcome_advantage(T([[1.0, 0.0, 1.0]]), T([[1, 1, 1]]))
    # gamma = 1: G = [1 + 0 + 1, 0 + 1, 1]
    close(ret, [[2.0, 1.0, 1.0]])


def test_reinforce_plus_plus_baseline():
    mask = T([[1, 1], [1, 1]])
    rewards = ca.compute_token_level_scores(T([1.0, 0.0]), mask)
    adv, _ = ca.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, np.array(["a", "a"]))
    # group mean 0.5 -> centred [0.5, -0.5] on every token: [0.5, 0.5, -0.5, -0.5]
    # mean 0, unbiased var 4 * 0.25 / 3 = 1/3, std 0.57735 -> +-0.866025
    close(adv, [[0.866025, 0.866025], [-0.866025, -0.866025]], tol=1e-4)


def test_adv_estimator_registry():
    assert ca.get_adv_estimator_fn("grpo") is ca.compute_grpo_outcome_advantage
    assert ca.get_adv_estimator_fn(ca.AdvantageEstimator.GAE) is ca.compute_gae_advantage_return
    assert ca.AdvantageEstimator.RLOO == "rloo"
    with pytest.raises(ValueError) as err:
        ca.get_adv_estimator_fn("nope")
    for name in ("gae", "grpo", "rloo", "reinforce_plus_plus"):
        assert name in str(err.value)


def test_registries_refuse_a_second_function_under_a_taken_name():
    def other(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None):
        raise AssertionError("never called")

    with pytest.raises(ValueError, match=r"'vanilla' is already registered \(compute_policy_loss_vanilla\)"):
        ca.register_policy_loss("vanilla")(other)
    assert ca.get_policy_loss_fn("vanilla") is ca.compute_policy_loss_vanilla
    # A module reload re-creates the function object of the same definition: that one is accepted.
    reloaded = types.FunctionType(other.__code__, other.__globals__, other.__name__)
    reloaded.__qualname__ = other.__qualname__
    registry = {"mine": other}
    assert add_to_registry(registry, "mine", reloaded, "Policy loss") is reloaded and registry["mine"] is reloaded


def test_config_offers_exactly_the_built_in_estimators():
    from typing import get_args

    from flows.config import AlgorithmConfig

    offered = set(get_args(AlgorithmConfig.model_fields["adv_estimator"].annotation))
    assert offered == {"gae", "grpo", "grpo_passk", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"}
    assert offered == {estimator.value for estimator in ca.AdvantageEstimator}


# verl names ported code imports from core_algos (remax is left out on purpose: no flow has its greedy baseline).
CORE_ALGOS_NAMES = """
    ADV_ESTIMATOR_REGISTRY AdvantageEstimator register_adv_est get_adv_estimator_fn compute_gae_advantage_return
    compute_grpo_outcome_advantage compute_grpo_passk_outcome_advantage compute_rloo_outcome_advantage
    compute_reinforce_plus_plus_outcome_advantage compute_reinforce_plus_plus_baseline_outcome_advantage
    compute_token_level_scores KL_PENALTY_MODES kl_penalty KLController FixedKLController AdaptiveKLController
    get_kl_controller apply_kl_penalty LOSS_AGG_MODES agg_loss PolicyLossConfig resolve_policy_loss_config
    PolicyLossFn POLICY_LOSS_REGISTRY register_policy_loss get_policy_loss_fn compute_policy_loss_vanilla
    compute_policy_loss_gspo compute_entropy_loss compute_value_loss compute_dpo_loss masked_sum masked_mean
    masked_var masked_whiten entropy_from_logits
""".split()


@pytest.mark.parametrize("name", CORE_ALGOS_NAMES)
def test_core_algos_exports_the_verl_names(name):
    namespace = {}
    exec(f"from rlworkers.algorithms.core_algos import {name}", namespace)  # the statement ported code runs
    exec(f"from rlworkers.algorithms import {name} as from_package", namespace)
    assert namespace[name] is namespace["from_package"]


def test_core_algos_all_is_exactly_the_ported_names():
    assert sorted(ca.__all__) == sorted(CORE_ALGOS_NAMES)
    assert len(ca.__all__) == len(set(ca.__all__))


def test_register_adv_est_custom_and_clash():
    @ca.register_adv_est("test_const_adv")
    def const_adv(token_level_rewards, response_mask, **kwargs):
        return response_mask.float(), response_mask.float()

    try:
        assert ca.get_adv_estimator_fn("test_const_adv") is const_adv

        def other(token_level_rewards, response_mask, **kwargs):
            return response_mask, response_mask

        with pytest.raises(ValueError, match="already registered"):
            ca.register_adv_est("test_const_adv")(other)
    finally:
        ca.ADV_ESTIMATOR_REGISTRY.pop("test_const_adv", None)


# ----------------------------------------------------------------------------------------------------------
# KL
# ----------------------------------------------------------------------------------------------------------


def test_kl_estimators_at_known_points():
    logp = T([-1.0, -2.0])
    ref = T([-2.0, -1.0])  # d = logp - ref = [1, -1]
    close(ca.kl_penalty(logp, ref, "kl"), [1.0, -1.0])
    close(ca.kl_penalty(logp, ref, "k1"), [1.0, -1.0])
    close(ca.kl_penalty(logp, ref, "abs"), [1.0, 1.0])
    close(ca.kl_penalty(logp, ref, "mse"), [0.5, 0.5])  # 0.5 * d^2
    close(ca.kl_penalty(logp, ref, "k2"), [0.5, 0.5])
    # k3 = exp(ref - logp) - (ref - logp) - 1:  ref-logp = -1 -> e^-1 + 1 - 1 = 0.367879
    #                                           ref-logp = +1 -> e - 1 - 1 = 0.718282
    close(ca.kl_penalty(logp, ref, "low_var_kl"), [math.exp(-1), math.e - 2])
    close(ca.kl_penalty(logp, ref, "k3"), [math.exp(-1), math.e - 2])


def test_k3_is_clamped_to_ten():
    # ref - logp = 15: exp(15) - 15 - 1 ~ 3.3e6 -> clamped to 10
    close(ca.kl_penalty(T([-16.0]), T([-1.0]), "low_var_kl"), [10.0])


def test_kl_straight_through_plus_suffix():
    logp = T([-1.0], requires_grad=True)
    ref = T([-2.0])
    value = ca.kl_penalty(logp, ref, "k3+")
    close(value.detach(), [math.exp(-1)])  # forward value of k3 at d = 1
    value.sum().backward()
    # gradient of k2 = 0.5 d^2 -> d = 1 (k3's own gradient would be 1 - e^-1 = 0.632)
    close(logp.grad, [1.0])


def test_kl_penalty_bad_modes():
    with pytest.raises(NotImplementedError):
        ca.kl_penalty(T([0.0]), T([0.0]), "full")
    with pytest.raises(ValueError) as err:
        ca.kl_penalty(T([0.0]), T([0.0]), "k9")
    assert "low_var_kl" in str(err.value) and "k1" in str(err.value)


def test_adaptive_kl_controller_update_and_resume():
    ctrl = ca.AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=12.0, n_steps=256)
    # error = clip(12/6 - 1 = 1, -0.2, 0.2) = 0.2; mult = 1 + 0.2 * 256/10000 = 1.00512 -> 0.100512
    close(ctrl.value, 0.100512, tol=1e-9)
    ctrl.update(current_kl=5.4, n_steps=256)
    # error = 5.4/6 - 1 = -0.1 (inside the clip); mult = 1 - 0.1 * 0.0256 = 0.99744
    # 0.100512 * 0.99744 = 0.100512 - 0.100512*0.00256 = 0.100254689
    close(ctrl.value, 0.100254689, tol=1e-9)

    restored = ca.AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value
    with pytest.raises(ValueError, match="fixed"):
        restored.load_state_dict(ca.FixedKLController(0.3).state_dict())


def test_fixed_kl_controller_and_factory():
    fixed = ca.get_kl_controller({"type": "fixed", "kl_coef": 0.05})
    assert isinstance(fixed, ca.FixedKLController)
    fixed.update(current_kl=100.0, n_steps=1000)
    assert fixed.value == 0.05

    @dataclass
    class KLCtrl:
        type: str = "adaptive"
        kl_coef: float = 0.2
        horizon: int = 100
        target_kl: float = 1.0

    adaptive = ca.get_kl_controller(KLCtrl())
    assert isinstance(adaptive, ca.AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.2, 1.0, 100)
    assert isinstance(adaptive, ca.KLController)
    with pytest.raises(ValueError, match="adaptive"):
        ca.get_kl_controller({"type": "pid"})
    with pytest.raises(ValueError, match="horizon"):
        ca.get_kl_controller(KLCtrl(horizon=0))


def test_apply_kl_penalty_rewards_metrics_and_update():
    scores = T([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    ref = torch.zeros(2, 3)
    old = T([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]])  # k1 = old - ref; 9.0 is padding
    # target 0.1625 = half of the batch KL below, so the error clips at +0.2
    ctrl = ca.AdaptiveKLController(init_kl_coef=0.5, target_kl=0.1625, horizon=10)
    rewards, metrics = ca.apply_kl_penalty(scores, old, ref, mask, ctrl, kl_penalty="kl")
    # rewards = scores - 0.5 * k1 * mask
    close(rewards, [[-0.05, -0.1, 0.85], [-0.2, 0.75, 0.0]])
    # per-sequence mean KL: row 0 (0.1+0.2+0.3)/3 = 0.2, row 1 (0.4+0.5)/2 = 0.45 -> batch 0.325
    close(metrics["actor/reward_kl_penalty"], 0.325)
    close(metrics["actor/reward_kl_penalty_coeff"], 0.5)  # beta used for this batch, before the update
    # update(0.325, n_steps=2): error clip(0.325/0.1625 - 1 = 1) = 0.2; mult 1 + 0.2 * 2/10 = 1.04
    close(ctrl.value, 0.52)


# ----------------------------------------------------------------------------------------------------------
# loss aggregation
# ----------------------------------------------------------------------------------------------------------

LOSS = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = T([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 2.5),  # (1 + 2 + 3 + 4) / 4 tokens
        ("seq-mean-token-sum", 5.0),  # ((1+2+3) + 4) / 2 sequences
        ("seq-mean-token-mean", 3.0),  # ((1+2+3)/3 + 4/1) / 2 = (2 + 4) / 2
        ("seq-mean-token-sum-norm", 5.0 / 3.0),  # seq-mean-token-sum / T, T = 3
    ],
)
def test_agg_loss_modes(mode, expected):
    close(ca.agg_loss(LOSS, MASK, mode), expected)


def test_agg_loss_fully_masked_row_and_options():
    loss = torch.cat([LOSS, T([[100.0, 100.0, 100.0]])])
    mask = torch.cat([MASK, T([[0, 0, 0]])])
    # the empty third sequence is left out of the sequence means: still (6 + 4) / 2
    close(ca.agg_loss(loss, mask, "seq-mean-token-sum"), 5.0)
    close(ca.agg_loss(loss, mask, "seq-mean-token-mean"), 3.0)
    # constant normaliser: 5 / 10 instead of 5 / 3
    close(ca.agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=10), 0.5)
    # global-batch arguments: this micro-batch's token sum 10, over 8 global tokens on 2 ranks: 10/8*2
    close(ca.agg_loss(LOSS, MASK, "token-mean", dp_size=2, batch_num_tokens=8), 2.5)
    with pytest.raises(ValueError, match="batch_num_tokens"):
        ca.agg_loss(LOSS, MASK, "token-mean", dp_size=2)
    # nothing masked in: 0, not NaN
    close(ca.agg_loss(LOSS, torch.zeros_like(MASK), "token-mean"), 0.0)


def test_agg_loss_unknown_mode_lists_options():
    with pytest.raises(ValueError) as err:
        ca.agg_loss(LOSS, MASK, "mean")
    assert "seq-mean-token-sum-norm" in str(err.value) and "token-mean" in str(err.value)


# ----------------------------------------------------------------------------------------------------------
# policy losses
# ----------------------------------------------------------------------------------------------------------


def _ppo_batch():
    old = torch.zeros(1, 4)
    # ratios [1.5, 0.5, 4.0, 0.7]; the 4th token is padding
    log_prob = torch.log(T([[1.5, 0.5, 4.0, 0.7]])).requires_grad_(True)
    adv = T([[1.0, 1.0, -1.0, -1.0]])
    mask = T([[1, 1, 1, 0]])
    return old, log_prob, adv, mask


def test_ppo_clip_and_dual_clip_by_hand():
    old, log_prob, adv, mask = _ppo_batch()
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = ca.compute_policy_loss_vanilla(
        old, log_prob, adv, mask, config=ca.PolicyLossConfig()
    )
    # t0: ratio 1.5, A=+1: max(-1.5, -clip(1.5)=-1.2) = -1.2   (clipped: -1.2 > -1.5)
    # t1: ratio 0.5, A=+1: max(-0.5, -0.8) = -0.5                (not clipped)
    # t2: ratio 4.0, A=-1: max(4.0, 1.2) = 4.0; dual clip min(4.0, -A*3 = 3) = 3   (dual-clipped)
    # token-mean over 3 valid tokens: (-1.2 - 0.5 + 3) / 3 = 0.433333
    close(pg_loss, 1.3 / 3)
    close(clipfrac, 1 / 3)
    close(clipfrac_lower, 1 / 3)
    # ppo_kl = mean(old - new) = -(ln 1.5 + ln 0.5 + ln 4) / 3 = -ln(3) / 3
    close(ppo_kl, -math.log(3) / 3)
    pg_loss.backward()
    # clipped and dual-clipped tokens have no gradient; t1: d/dlogp (-A * ratio) / 3 = -0.5 / 3
    close(log_prob.grad, [[0.0, -0.5 / 3, 0.0, 0.0]])


def test_ppo_asymmetric_clip_and_overrides():
    old, log_prob, adv, mask = _ppo_batch()
    # clip-higher 0.28: t0 becomes max(-1.5, -1.28) = -1.28 -> (-1.28 - 0.5 + 3) / 3 = 0.406667
    pg_loss, *_ = ca.compute_policy_loss_vanilla(old, log_prob, adv, mask, clip_ratio_high=0.28)
    close(pg_loss, 1.22 / 3)
    # same via a config mapping (actor-config-like), with the dual-clip bound lowered to 2:
    # t2: min(4.0, 2.0) = 2 -> (-1.28 - 0.5 + 2) / 3 = 0.073333
    pg_loss, *_ = ca.compute_policy_loss_vanilla(
        old, log_prob, adv, mask, config={"clip_ratio_high": 0.28, "clip_ratio_c": 2.0}
    )
    close(pg_loss, 0.22 / 3)
    # lower clip: ratio 0.5 with A=-1 and clip_ratio_low 0.2: max(0.5, clip(0.5)=0.8) = 0.8
    pg_loss, clipfrac, _, _ = ca.compute_policy_loss_vanilla(
        torch.zeros(1, 1), torch.log(T([[0.5]])), T([[-1.0]]), T([[1]]), clip_ratio_low=0.2
    )
    close(pg_loss, 0.8)
    close(clipfrac, 1.0)


def test_policy_loss_config_validation():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ca.PolicyLossConfig(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="valid options"):
        ca.resolve_policy_loss_config(None, clip_ratio_mid=0.1)
    cfg = ca.resolve_policy_loss_config({"clip_ratio": 0.1, "clip_ratio_high": 0.3})
    assert (cfg.low, cfg.high, cfg.clip_ratio_c) == (0.1, 0.3, 3.0)


def test_gspo_sequence_level_ratio():
    old = torch.zeros(2, 2)
    # row 0 log-ratios 0.1, 0.3 -> seq mean 0.2; row 1: 0.2 and padding 5.0 (ignored) -> 0.2
    log_prob = T([[0.1, 0.3], [0.2, 5.0]], requires_grad=True)
    adv = T([[1.0, 1.0], [-1.0, -1.0]])
    mask = T([[1, 1], [1, 0]])
    pg_loss, clipfrac, ppo_kl, lower = ca.compute_policy_loss_gspo(old, log_prob, adv, mask, clip_ratio=0.2)
    s = math.exp(0.2)  # 1.221403, the same sequence ratio for every token of both rows
    # row 0, A=+1: max(-s, -1.2) = -1.2 (clipped); row 1, A=-1: max(s, 1.2) = s (not clipped)
    # seq-mean-token-mean: (-1.2 + s) / 2 = 0.0107014
    close(pg_loss, (-1.2 + s) / 2)
    close(clipfrac, 2 / 3)  # the two tokens of row 0 out of 3 valid tokens
    close(ppo_kl, -(0.1 + 0.3 + 0.2) / 3)
    close(lower, 0.0)
    pg_loss.backward()
    # only row 1's valid token has a gradient: d/dlogp [(1/2) * (-A) * s] = s / 2
    close(log_prob.grad, [[0.0, 0.0], [s / 2, 0.0]])


def test_policy_loss_registry():
    assert ca.get_policy_loss_fn("vanilla") is ca.compute_policy_loss_vanilla
    assert ca.get_policy_loss_fn("gspo") is ca.compute_policy_loss_gspo
    with pytest.raises(ValueError) as err:
        ca.get_policy_loss_fn("ppo2")
    assert "vanilla" in str(err.value) and "gspo" in str(err.value)


# ----------------------------------------------------------------------------------------------------------
# entropy, value loss, DPO
# ----------------------------------------------------------------------------------------------------------


def test_entropy_from_logits_and_entropy_loss():
    logits = torch.stack([torch.zeros(4), torch.log(T([0.25, 0.75, 1e-30, 1e-30]))]).unsqueeze(0)  # [1, 2, 4]
    # uniform over 4 -> ln 4 = 1.386294; [0.25, 0.75] -> 0.25 ln 4 + 0.75 ln(4/3) = 0.562335
    h2 = 0.25 * math.log(4) + 0.75 * math.log(4 / 3)
    close(ca.entropy_from_logits(logits), [[math.log(4), h2]])
    close(ca.compute_entropy_loss(logits, T([[1, 0]])), math.log(4))


def test_value_loss_clipping():
    vpreds = T([[1.0, 2.0, 0.0]])
    values = T([[0.5, 0.5, 0.0]])
    returns = T([[1.5, 0.0, 9.0]])  # third token is padding
    mask = T([[1, 1, 0]])
    vf_loss, vf_clipfrac = ca.compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.2)
    # t0: clip(1.0, 0.3, 0.7) = 0.7: max((1-1.5)^2 = 0.25, (0.7-1.5)^2 = 0.64) = 0.64  (clipped)
    # t1: clip(2.0, 0.3, 0.7) = 0.7: max((2-0)^2 = 4, 0.7^2 = 0.49) = 4                (not clipped)
    # 0.5 * (0.64 + 4) / 2 = 1.16
    close(vf_loss, 1.16)
    close(vf_clipfrac, 0.5)


def test_dpo_equal_logps_is_log2():
    z = torch.zeros(3)
    loss, metrics = ca.compute_dpo_loss(z, z, z, z, beta=0.1)
    close(loss, math.log(2))  # -log sigmoid(0) = log 2
    assert metrics["dpo/reward_accuracy"] == 0.0


def test_dpo_known_point_and_label_smoothing():
    pc, pr, rc, rr = T([-1.0]), T([-3.0]), T([-2.0]), T([-2.0])
    loss, metrics = ca.compute_dpo_loss(pc, pr, rc, rr, beta=0.5)
    # h = (-1 - -3) - (-2 - -2) = 2; beta*h = 1; -log sigmoid(1) = log(1 + e^-1) = 0.3132617
    close(loss, math.log1p(math.exp(-1)))
    close(metrics["dpo/rewards_chosen"], 0.5)  # 0.5 * (-1 - -2)
    close(metrics["dpo/rewards_rejected"], -0.5)  # 0.5 * (-3 - -2)
    close(metrics["dpo/reward_margin"], 1.0)
    close(metrics["dpo/reward_accuracy"], 1.0)
    loss, _ = ca.compute_dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=0.1)
    # 0.9 * log(1 + e^-1) + 0.1 * log(1 + e^1) = 0.281936 + 0.131326 = 0.413262
    close(loss, 0.9 * math.log1p(math.exp(-1)) + 0.1 * math.log1p(math.e))
    with pytest.raises(ValueError, match="label_smoothing"):
        ca.compute_dpo_loss(pc, pr, rc, rr, label_smoothing=0.5)


def test_preference_pairs_by_hand():
    from rlworkers.algorithms.batch_ops import make_preference_pairs
    from rlworkers.protocol import DataProto

    # prompt a: scores 0.2, 0.9, 0.1 -> chosen row 1, rejected row 2; prompt b: all 0.5 -> no pair;
    # prompt c: 1.0 then 0.0 -> rows 4, 5; prompt d: 0.3, 0.7 -> rows 7, 6
    uids = np.array(["a", "a", "a", "b", "c", "c", "d", "d", "b"], dtype=object)
    scores = np.array([0.2, 0.9, 0.1, 0.5, 1.0, 0.0, 0.3, 0.7, 0.5], dtype=object)
    data = DataProto.from_dict({"row": torch.arange(9)}, {"uid": uids, "score": scores})
    assert make_preference_pairs(data, world_size=1).batch["row"].tolist() == [1, 2, 4, 5, 7, 6]
    # two ranks: 3 pairs do not split evenly, the last one is dropped
    assert make_preference_pairs(data, world_size=2).batch["row"].tolist() == [1, 2, 4, 5]
    assert len(make_preference_pairs(data, world_size=4)) == 0


def test_bypass_mode_takes_the_rollout_log_probs_as_the_old_policys():
    from rlworkers.algorithms.batch_ops import apply_bypass_mode
    from rlworkers.protocol import DataProto

    rollout = torch.tensor([[-0.5, -1.25, 0.0], [-2.0, 0.0, 0.0]])
    data = DataProto.from_dict({"rollout_log_probs": rollout, "response_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])})
    assert apply_bypass_mode(data) is data
    assert data.batch["old_log_probs"].tolist() == [[-0.5, -1.25, 0.0], [-2.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="bypass_mode=false"):
        apply_bypass_mode(DataProto.from_dict({"response_mask": torch.ones(2, 3)}))
