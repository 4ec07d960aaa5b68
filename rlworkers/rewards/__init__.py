"""Rule-based rewards (rule.py) and the registry that resolves reward specs to batch reward functions
(registry.py; the user signature is ``reward_fn(prompts, responses, **columns) -> list[float]``)."""

from rlworkers.rewards.registry import (
    DATA_SOURCE_DEFAULTS,
    REWARD_FUNCTIONS,
    RewardFn,
    RewardFunctionError,
    auto_reward,
    compute_scores,
    describe_reward_fn,
    load_reward_fn,
    per_sample,
    register_reward_fn,
    reward_fn_for_data_source,
)
from rlworkers.rewards.rule import exact_answer_reward, extract_gsm8k_answer, format_reward, gsm8k_reward

__all__ = [
    "DATA_SOURCE_DEFAULTS",
    "REWARD_FUNCTIONS",
    "RewardFn",
    "RewardFunctionError",
    "auto_reward",
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
]
