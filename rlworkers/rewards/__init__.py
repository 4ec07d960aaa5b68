"""Rule-based rewards (rule.py) and the registry that resolves reward specs to batch reward functions
(registry.py: rlflow's batch signature ``reward_fn(prompts, responses, **columns) -> list[float]`` and verl's
``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` and batch ``compute_score``)."""

from rlworkers.rewards.registry import (
    DATA_SOURCE_DEFAULTS,
    REWARD_FUNCTIONS,
    MissingGroundTruthError,
    RewardFn,
    RewardFunctionError,
    VerlRewardFn,
    as_batch_reward_fn,
    auto_reward,
    compute_reward_values,
    compute_scores,
    describe_reward_fn,
    load_reward_fn,
    per_sample,
    register_reward_fn,
    reward_fn_for_data_source,
    reward_fn_style,
    row_ground_truth,
)
from rlworkers.rewards.rule import exact_answer_reward, extract_gsm8k_answer, format_reward, gsm8k_reward

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
