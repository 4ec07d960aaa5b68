"""Rollout backends: ``hf`` (transformers ``generate``) and ``vllm``. Both return the same DataProto contract:

``prompts [B, P]``, ``responses [B, R]`` (right-padded with pad), ``input_ids [B, P+R]``, ``attention_mask``,
``position_ids``, ``response_mask [B, R]`` (1 up to and including the first EOS) and ``rollout_log_probs [B, R]``
(log-probs of the sampled tokens under the temperature-scaled distribution). Non-tensor columns are carried
over; with ``n`` samples per prompt every row appears ``n`` times, interleaved (a a b b).
"""
