"""Rollout correction (rlworkers/algorithms/rollout_correction.py) against hand-computed values, verl's own cases
(tests/trainer/ppo/test_rollout_corr.py: the mask mode's numbers, every rejection option, chained options, the
metric names), the config's refusals, and the compute_advantage stage that applies it before the advantages."""

from __future__ import annotations

import math

import pytest
import torch

from rlworkers.algorithms.rollout_correction import (
    RS_OPTIONS,
    apply_rollout_correction,
    importance_weights,
    offpolicy_metrics,
    parse_rejection,
    rejection_mask,
)
from rlworkers.protocol import DataProto

LN2, LN3 = math.log(2.0), math.log(3.0)


def test_token_weights_are_the_ratios_truncated_at_the_threshold_and_zero_on_padding():
    log_ratio = torch.tensor([[0.0, LN3, -LN2, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    weights, metrics = importance_weights(log_ratio, mask, "token", threshold=2.0)
    assert weights.tolist()[0] == pytest.approx([1.0, 2.0, 0.5, 0.0])
    assert not weights.requires_grad
    # metrics are of the weights before the truncation: (1 + 3 + 0.5) / 3
    assert metrics["rollout_is_mean"] == pytest.approx(1.5)
    assert metrics["rollout_is_max"] == pytest.approx(3.0) and metrics["rollout_is_min"] == pytest.approx(0.5)
    assert metrics["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)
    assert metrics["rollout_is_ratio_fraction_low"] == 0.0  # 0.5 is the lower bound itself (1 / threshold)


def test_sequence_weights_are_the_product_of_the_token_ratios():
    log_ratio = torch.tensor([[LN2, LN2, 9.0], [0.0, -2 * LN2, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    weights, metrics = importance_weights(log_ratio, mask, "sequence", threshold=5.0)
    assert weights.tolist() == [pytest.approx([4.0, 4.0, 0.0]), pytest.approx([0.25, 0.25, 0.25])]
    assert metrics["rollout_is_max"] == pytest.approx(4.0) and metrics["rollout_is_min"] == pytest.approx(0.25)
    assert metrics["rollout_is_ratio_fraction_high"] == 0.0 and metrics["rollout_is_ratio_fraction_low"] == 0.0
    truncated, metrics = importance_weights(log_ratio, mask, "sequence", threshold=2.0)  # bounds 0.5 and 2
    assert truncated[0, 0].item() == pytest.approx(2.0)
    assert metrics["rollout_is_ratio_fraction_high"] == 0.5 and metrics["rollout_is_ratio_fraction_low"] == 0.5


def test_equal_weights_have_an_effective_sample_size_of_one_and_batch_normalizing_makes_their_mean_one():
    log_ratio = torch.full((2, 3), 0.3)
    mask = torch.ones(2, 3)
    weights, metrics = importance_weights(log_ratio, mask, "token", threshold=2.0, batch_normalize=True)
    assert metrics["rollout_is_eff_sample_size"] == pytest.approx(1.0)
    assert metrics["rollout_is_std"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["rollout_is_batch_norm_factor"] == pytest.approx(math.exp(0.3))
    assert weights.mean().item() == pytest.approx(1.0)


def test_verl_mask_mode_rejects_by_the_mask_and_keeps_the_true_weights():
    """verl's test_mask_mode: sequence 0's ratio exp(-1) ~ 0.37 is out of 0.5_2.0, sequence 1's exp(0.5) ~ 1.65 in."""
    old = torch.full((2, 5), -2.0)
    rollout = torch.stack([torch.full((5,), -1.0), torch.full((5,), -2.5)])
    data = DataProto.from_dict({"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": torch.ones(2, 5)})
    metrics = apply_rollout_correction(
        data, rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0"
    )
    weights = data.batch["rollout_is_weights"]
    assert weights[0, 0].item() == pytest.approx(0.368, abs=0.01) and weights[1, 0].item() == pytest.approx(
        1.649, abs=0.01
    )
    assert data.batch["response_mask"].tolist() == [[0.0] * 5, [1.0] * 5]
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(0.5)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)


def test_a_sequence_option_rejects_the_whole_sequence_by_its_sum_of_k3():
    # k3(log 2) = 2 - 1 - log 2 = 0.307 > 0.3: sequence 0 out; sequence 1 (ratio 1 everywhere) in
    log_ratio = torch.tensor([[LN2, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    kept, metrics = rejection_mask(log_ratio, mask, parse_rejection("seq_sum_k3", 0.3))
    assert kept.tolist() == [[0, 0, 0], [1, 1, 0]] and kept.dtype == mask.dtype
    assert metrics["rollout_rs_seq_sum_k3_mean"] == pytest.approx(3 * (1 - LN2) / 5)  # its 3 tokens of 5 carry it
    assert metrics["rollout_rs_seq_sum_k3_masked_fraction"] == pytest.approx(3 / 5)
    assert metrics["rollout_rs_seq_sum_k3_seq_masked_fraction"] == pytest.approx(0.5)


def test_a_single_k1_threshold_bounds_both_sides_and_chained_options_must_all_pass():
    (bound,) = parse_rejection("token_k1", "2.0")
    assert (bound.lower, bound.upper) == (pytest.approx(-LN2), pytest.approx(LN2))
    log_ratio = torch.tensor([[0.0, -1.0, 0.5, 0.0]])  # k1 = -log_ratio: 0, 1 (> log 2: out), -0.5, 0
    kept, _ = rejection_mask(log_ratio, torch.ones(1, 4), [bound])
    assert kept.tolist() == [[1, 0, 1, 1]]
    # seq_max_k2 of 0.1: 0.5 ** 2 / 2 = 0.125 above it -> the whole sequence goes
    kept, metrics = rejection_mask(log_ratio, torch.ones(1, 4), parse_rejection("token_k1,seq_max_k2", "2.0,0.1"))
    assert kept.tolist() == [[0, 0, 0, 0]] and metrics["rollout_rs_masked_fraction"] == 1.0


@pytest.mark.parametrize(
    ("option", "threshold"),
    [("token_k1", "0.5_1.5"), ("token_k2", 2.0), ("token_k3", 2.0), ("seq_sum_k1", "0.6_1.4"), ("seq_sum_k2", 2.5),
     ("seq_sum_k3", 2.5), ("seq_mean_k1", "0.5_1.5"), ("seq_mean_k2", 2.0), ("seq_mean_k3", 2.0),
     ("seq_max_k2", 2.0), ("seq_max_k3", 2.0)],
)  # fmt: skip
def test_every_verl_rejection_option_masks_and_reports_its_mean(option, threshold):
    assert option in RS_OPTIONS
    generator = torch.Generator().manual_seed(0)
    old = torch.randn(3, 7, generator=generator)
    rollout = old + 0.15 * torch.randn(3, 7, generator=generator)
    data = DataProto.from_dict({"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": torch.ones(3, 7)})
    metrics = apply_rollout_correction(data, rollout_rs=option, rollout_rs_threshold=threshold)
    assert f"rollout_corr/rollout_rs_{option}_mean" in metrics
    assert data.batch["response_mask"].shape == (3, 7)
    assert set(data.batch["response_mask"].unique().tolist()) <= {0.0, 1.0}


def test_off_policy_metrics_by_hand():
    old = torch.full((1, 2), -1.0)
    rollout = torch.full((1, 2), -2.0)  # log_ratio = 1 per token, 2 for the sequence
    metrics = offpolicy_metrics(old, rollout, torch.ones(1, 2))
    assert metrics["kl"] == pytest.approx(-1.0)
    assert metrics["k3_kl"] == pytest.approx(math.e - 2)
    assert metrics["training_ppl"] == pytest.approx(math.e) and metrics["rollout_ppl"] == pytest.approx(math.e**2)
    assert metrics["log_ppl_diff"] == pytest.approx(-1.0) and metrics["ppl_ratio"] == pytest.approx(math.exp(-1))
    assert metrics["chi2_token"] == pytest.approx(math.e**2 - 1)
    assert metrics["chi2_seq"] == pytest.approx(math.e**4 - 1, rel=1e-5)


def test_the_metric_names_are_verls():
    generator = torch.Generator().manual_seed(1)
    old = torch.randn(3, 8, generator=generator)
    data = DataProto.from_dict(
        {"old_log_probs": old, "rollout_log_probs": old + 0.2, "response_mask": torch.ones(3, 8)}
    )
    metrics = apply_rollout_correction(data, rollout_is="token", rollout_is_threshold=2.5)
    names = ["rollout_is_mean", "rollout_is_max", "rollout_is_min", "rollout_is_std", "rollout_is_eff_sample_size",
             "rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low", "training_ppl", "training_log_ppl",
             "kl", "k3_kl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff", "log_ppl_abs_diff", "log_ppl_diff_max",
             "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq"]  # fmt: skip
    assert [name for name in names if f"rollout_corr/{name}" not in metrics] == []
    assert "response_mask" in data.batch.keys() and data.batch["response_mask"].sum() == 24  # no rejection asked


def test_bad_settings_name_the_field_and_the_fix():
    with pytest.raises(ValueError, match="seq_max_k1.*is not one of"):
        parse_rejection("seq_max_k1", 2.0)
    with pytest.raises(ValueError, match="needs rollout_rs_threshold"):
        parse_rejection("token_k2", None)
    with pytest.raises(ValueError, match="2 thresholds for 3"):
        parse_rejection("token_k1,token_k2,seq_max_k3", "0.5_2.0,2.0")
    with pytest.raises(ValueError, match="one upper bound"):
        parse_rejection("token_k3", "0.5_2.0")
    with pytest.raises(ValueError, match="needs 'rollout_log_probs'"):
        apply_rollout_correction(DataProto.from_dict({"old_log_probs": torch.zeros(1, 2)}), rollout_is="token")


def test_the_config_refuses_correction_in_bypass_mode_and_a_bad_option_before_anything_starts():
    from flows.config import ConfigError, load_config

    config = load_config(
        "demo",
        ["algorithm.rollout_correction.bypass_mode=false", "algorithm.rollout_correction.rollout_is=sequence",
         "algorithm.rollout_correction.rollout_rs=token_k1,seq_max_k3",
         "algorithm.rollout_correction.rollout_rs_threshold=0.4_1.8,3.0"],
    )  # fmt: skip
    assert config.algorithm.rollout_correction.rollout_rs_threshold == "0.4_1.8,3.0"
    with pytest.raises(ConfigError, match="bypass_mode=false"):
        load_config(
            "demo", ["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_is=token"]
        )
    with pytest.raises(ConfigError, match="token_k4"):
        load_config(
            "demo",
            ["algorithm.rollout_correction.bypass_mode=false", "algorithm.rollout_correction.rollout_rs=token_k4",
             "algorithm.rollout_correction.rollout_rs_threshold=2.0"],
        )  # fmt: skip


def test_a_flow_without_a_policy_gradient_refuses_rollout_correction():
    from flows.config import load_config

    config = load_config(
        "demo", ["algorithm.rollout_correction.bypass_mode=false", "algorithm.rollout_correction.rollout_is=token"]
    )
    config.check_algorithm("grpo")
    with pytest.raises(ValueError, match="online_dpo flow has none"):
        config.check_algorithm("online_dpo")


def test_the_advantage_stage_masks_rejected_tokens_before_the_advantages_and_reports_the_metrics():
    from flows.config import load_config
    from flows.stages import compute_advantage

    algorithm = load_config(
        "demo",
        ["algorithm.rollout_correction.bypass_mode=false", "algorithm.rollout_correction.rollout_is=token",
         "algorithm.rollout_correction.rollout_rs=token_k1", "algorithm.rollout_correction.rollout_rs_threshold=2.0"],
    ).algorithm.model_dump()  # fmt: skip
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    rollout = torch.tensor([[-1.0, -3.0, -1.0], [-1.0, -1.0, -1.0]])  # row 0's 2nd token: ratio e^2, out of 0.5_2
    gen = DataProto.from_dict(
        {
            "rollout_log_probs": rollout,
            "response_mask": torch.ones(2, 3),
            "responses": torch.ones(2, 3, dtype=torch.long),
            "prompts": torch.ones(2, 2, dtype=torch.long),
            "attention_mask": torch.ones(2, 5),
        },
        non_tensors={"uid": ["a", "a"]},
    )
    parts = [
        DataProto.from_dict({"token_level_scores": torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])}),
        DataProto.from_dict({"old_log_probs": old}),
        DataProto.from_dict({"ref_log_prob": old}),
    ]
    batch = compute_advantage.fn(gen, parts, algorithm, None, step=1)
    assert batch.batch["response_mask"].tolist() == [[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]]
    assert batch.batch["advantages"][0, 1].item() == 0.0 and batch.batch["advantages"][0, 0].item() > 0
    assert batch.batch["rollout_is_weights"][0].tolist() == pytest.approx([1.0, 2.0, 1.0])
    assert batch.meta_info["data_metrics"]["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 6)
