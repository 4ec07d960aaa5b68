"""Rule-based rewards (rule.py), the reward signatures and the registry (registry.py: rlflow's batch signature
``reward_fn(prompts, responses, **columns) -> list[float]`` and verl's ``compute_score(data_source, solution_str,
ground_truth, extra_info=None)`` and batch ``compute_score``), loading reward functions from a spec (loading.py) and
validated scoring (scoring.py)."""

from rlworkers.rewards.loading import load_reward_fn
from rlworkers.rewards.registry import (
    DATA_SOURCE_DEFAULTS,
    REWARD_FUNCTIONS,
    MissingGroundTruthError,
    RewardFn,
    VerlRewardFn,
    as_batch_reward_fn,
    auto_reward,
    describe_reward_fn,
    needs_ground_truth,
    per_sample,
    register_reward_fn,
    reward_fn_for_data_source,
    reward_fn_style,
    row_ground_truth,
)
from rlworkers.rewards.rule import exact_answer_reward, extract_gsm8k_answer, format_reward, gsm8k_reward
from rlworkers.rewards.scoring import RewardFunctionError, compute_reward_values, compute_scores

__all__ = [
    "DATA_SOURCE_DEFAULTS",
    "REWARD_FUNCTIONS",
    "MissingGroundTruthError",
    "RewardFn",
    "RewardFunctionError",
    "VerlRewardFn",
    "as_batch_reward_fn",
    "auto_reward",
    "compute_reward_values",
    "compute_scores",
    "describe_reward_fn",
    "needs_ground_truth",
    "exact_answer_reward",
    "extract_gsm8k_answer",
    "format_reward",
    "gsm8k_reward",
    "load_reward_fn",
    "per_sample",
    "register_reward_fn",
    "reward_fn_for_data_source",
    "reward_fn_style",
    "row_ground_truth",
]
