"""Rollout with transformers' ``generate`` (the default backend; ``rollout.name: hf``)."""

from __future__ import annotations

import torch

from rlworkers.data.batching import left_pad
from rlworkers.protocol import DataProto
from rlworkers.workers import common
from rlworkers.workers.common import logprobs_from_logits
from rlworkers.workers.config import RolloutConfig
from rlworkers.workers.rollout import SamplingRequest, TurnOutput, rollout_output, sampling_request, stop_token_ids


def response_mask_from_eos(responses: torch.Tensor, eos_token_id: int | list[int]) -> torch.Tensor:
    """1 for every token up to and including the first EOS (any of the ids) of each row, 0 after.
    ``[B, R] -> [B, R]``."""
    is_eos = torch.isin(responses, torch.as_tensor(eos_token_id, device=responses.device))
    after_eos = (torch.cumsum(is_eos.long(), dim=-1) - is_eos.long()) > 0
    return (~after_eos).long()


class HFRollout:
    def __init__(self, model, tokenizer, config: RolloutConfig, synced_gpus: bool = False):
        """``synced_gpus``: every rank keeps running forward passes until all ranks' rows have ended (a sharded
        model that gathers each layer as it goes: actor.fsdp_config.gather_for_generation=false)."""
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.synced_gpus = synced_gpus
        self.stop_token_ids = stop_token_ids(tokenizer, model)

    def sync_weights(self, model) -> None:
        """Nothing to do: HF generate samples from the actor's own module."""

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        request = sampling_request(prompts, self.config)
        prompts = request.prompts
        responses, response_mask, log_probs = self._sample(
            prompts.batch["input_ids"], prompts.batch["attention_mask"], request.response_length, request
        )
        return rollout_output(prompts, responses, response_mask, log_probs)

    def generate_turns(
        self, contexts: list[list[int]], budgets: list[int], request: SamplingRequest
    ) -> list[TurnOutput]:
        """One turn for each multi-turn trajectory (``rollout.agent_loop``): ``contexts`` left-padded into one
        batch, each row's new tokens up to its stop token or its own budget."""
        input_ids, attention_mask = left_pad(contexts, self.tokenizer.pad_token_id)
        device = next(self.model.parameters()).device
        responses, response_mask, log_probs = self._sample(
            input_ids.to(device), attention_mask.to(device), max(budgets), request
        )
        turns = []
        for ids, mask, lps, budget in zip(responses.tolist(), response_mask.tolist(), log_probs.tolist(), budgets):
            n = min(sum(mask), budget)
            turns.append(TurnOutput(ids[:n], lps[:n], stopped=n > 0 and ids[n - 1] in self.stop_token_ids))
        return turns

    @torch.no_grad()
    def _sample(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int, request: SamplingRequest
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``responses`` (pad after the first stop token), ``response_mask`` and ``rollout_log_probs``, ``[B, R]``."""
        do_sample, temperature = request.do_sample, request.temperature
        was_training = self.model.training
        self.model.eval()
        input_ids, attention_mask, cached = self._prefix_computed_once(input_ids, attention_mask)
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            **cached,
            max_new_tokens=response_length,
            do_sample=do_sample,
            temperature=temperature if do_sample else None,
            top_p=self.config.top_p if do_sample else None,
            top_k=self.config.top_k if do_sample else None,
            eos_token_id=self.stop_token_ids,
            pad_token_id=self.tokenizer.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
            synced_gpus=self.synced_gpus,
        )
        self.model.train(was_training)
        responses = out.sequences[:, input_ids.shape[1] :]
        logits = torch.stack(out.logits, dim=1) / temperature
        pad = response_length - responses.shape[1]
        if pad:  # every row stopped early
            responses = torch.nn.functional.pad(responses, (0, pad), value=self.tokenizer.pad_token_id)
            logits = torch.nn.functional.pad(logits, (0, 0, 0, pad))
        response_mask = response_mask_from_eos(responses, self.stop_token_ids)
        responses = responses.masked_fill(response_mask == 0, self.tokenizer.pad_token_id)
        log_probs = logprobs_from_logits(logits, responses) * response_mask
        return responses, response_mask, log_probs

    def _prefix_computed_once(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Where every row's prompt starts with the same tokens (a system prompt, an agent's tool descriptions), their
        keys and values computed once for every row, and the rows laid out as that prefix, then each row's left
        padding and the rest of its prompt: ``generate`` continues from those keys and values. Not in lockstep
        (``synced_gpus``), where every rank must run the same forwards."""
        shared = common.shared_prompt_prefix(input_ids, attention_mask, input_ids.shape[1])
        if self.synced_gpus or shared < common.MIN_SHARED_PREFIX:
            return input_ids, attention_mask, {}
        rows = input_ids.shape[0]
        start = int((attention_mask[0] == 0).sum())  # row 0's left padding (shared: the prompts are left-padded)
        prefix = input_ids[0, start : start + shared].unsqueeze(0)
        kept = {"logits_to_keep": 1} if common.takes_logits_to_keep(self.model) else {}
        cache = self.model(input_ids=prefix, use_cache=True, **kept).past_key_values
        cache.batch_repeat_interleave(rows)
        columns = common.columns_after_prefix(attention_mask, shared)
        input_ids = torch.cat([prefix.expand(rows, -1), input_ids.gather(1, columns)], dim=1)
        attention_mask = torch.cat([attention_mask.new_ones(rows, shared), attention_mask.gather(1, columns)], dim=1)
        return input_ids, attention_mask, {"past_key_values": cache}
