"""Rows -> DataProto batches: left-padded prompts for rollout, prompt+response for SFT.

Prompt batches carry ``input_ids``, ``attention_mask``, ``position_ids`` (``[B, P]``, left-padded, so generation
continues right after the prompt), every column of the rows as a non-tensor column (verl's ``reward_model`` and
``extra_info`` dicts, ``ability``, the user's own), and ``raw_prompt`` (the prompt text the model saw: chat
messages rendered with the chat template, see ``rlworkers.data.chat``), ``ground_truth`` (``ground_truth_of``),
``data_source`` and ``uid`` (one uid per prompt, so GRPO can group the samples of a prompt).
"""

from __future__ import annotations

import uuid
from array import array
from typing import Sequence

import torch

from rlworkers.data.chat import conversation_tokens, prompt_token_ids
from rlworkers.protocol import DataProto

BATCH_COLUMNS = ("raw_prompt", "ground_truth", "data_source", "uid")  # what prompt_batch writes itself


def compute_position_id_with_mask(mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only (left padding gets position 0). ``[B, T] -> [B, T]``."""
    return torch.clip(torch.cumsum(mask, dim=-1) - 1, min=0)


def left_pad(sequences: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)``, both ``[B, longest]``: every sequence right-aligned after ``pad_id``s (mask 0 there)."""
    lengths = torch.tensor([len(seq) for seq in sequences])
    width = int(lengths.max()) if len(sequences) else 0
    mask = torch.arange(width).expand(len(sequences), width) >= (width - lengths)[:, None]
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    ids[mask] = torch.tensor([token for seq in sequences for token in seq], dtype=torch.long)  # row-major order
    return ids, mask.long()


class TokenCache:
    """A tokenizer that tokenizes each distinct text once: the batch call (``tokenizer(texts, add_special_tokens=...)``)
    gives the wrapped tokenizer's ids, remembered per text; every other attribute is the wrapped tokenizer's.

    A run draws its batches from the same rows every epoch, and tokenizing a batch again was a visible share of a
    short SFT step in the flow process. At most ``max_tokens`` ids are kept (4 bytes each, ~40 MB by
    default); texts beyond that are tokenized every time they come back."""

    def __init__(self, tokenizer, max_tokens: int = 10_000_000):
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.cached_tokens = 0
        self._ids: dict[tuple[bool, str], array] = {}

    def __call__(self, texts: Sequence[str], add_special_tokens: bool = True, **kwargs) -> dict[str, list[list[int]]]:
        if isinstance(texts, str) or kwargs:  # one text, or more than ids asked for: the tokenizer's own answer
            return self.tokenizer(texts, add_special_tokens=add_special_tokens, **kwargs)
        missing = [text for text in dict.fromkeys(texts) if (add_special_tokens, text) not in self._ids]
        fresh = {}
        if missing:
            encoded = self.tokenizer(missing, add_special_tokens=add_special_tokens)["input_ids"]
            fresh = dict(zip(missing, encoded))
            for text, ids in fresh.items():
                if self.cached_tokens + len(ids) <= self.max_tokens:
                    self._ids[add_special_tokens, text] = array("i", ids)
                    self.cached_tokens += len(ids)
        return {
            "input_ids": [
                fresh[text] if text in fresh else self._ids[add_special_tokens, text].tolist() for text in texts
            ]
        }

    def __getattr__(self, name: str):  # pad_token_id, eos_token_id, decode, ...
        if name == "tokenizer":  # not set yet (a copy being built): no endless lookup
            raise AttributeError(name)
        return getattr(self.tokenizer, name)


def ground_truth_of(row: dict, answer_key: str = "answer"):
    """A row's ground truth: its ``answer_key`` column, else its ``ground_truth`` column, else verl's
    ``reward_model["ground_truth"]``; None when it has none (a rule reward then refuses the row by number, rather
    than scoring against an empty answer). Numbers become strings, as the rule rewards compare text."""
    for value in (row.get(answer_key), row.get("ground_truth")):
        if value is not None:
            break
    else:
        reward_model = row.get("reward_model")
        value = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    return str(value) if isinstance(value, (int, float)) else value


def fit_prompt(ids: list[int], max_prompt_length: int | None, truncation: str, row: int) -> list[int]:
    """``ids`` cut to ``max_prompt_length`` tokens by ``truncation`` ("left" keeps the end, "right" the start; verl's
    ``data.truncation``), or a ValueError naming the batch row for "error"."""
    if max_prompt_length is None or len(ids) <= max_prompt_length:
        return ids
    if truncation == "left":
        return ids[-max_prompt_length:]
    if truncation == "right":
        return ids[:max_prompt_length]
    raise ValueError(
        f"prompt of batch row {row} has {len(ids)} tokens, more than data.max_prompt_length={max_prompt_length}; "
        "raise it, set data.truncation=left or right, or filter the dataset"
    )


def prompt_batch(
    rows: Sequence[dict],
    tokenizer,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    max_prompt_length: int | None = None,
    truncation: str = "error",
    chat_template_kwargs: dict | None = None,
) -> DataProto:
    """Tokenise prompts (chat messages through the chat template; left-padded) and carry every column of the rows."""
    texts, encoded = prompt_token_ids([row[prompt_key] for row in rows], tokenizer, chat_template_kwargs)
    encoded = [fit_prompt(ids, max_prompt_length, truncation, i) for i, ids in enumerate(encoded)]
    input_ids, attention_mask = left_pad(encoded, tokenizer.pad_token_id)
    columns = {key for row in rows for key in row if key not in BATCH_COLUMNS}
    non_tensors = {key: [row.get(key) for row in rows] for key in sorted(columns)}
    non_tensors.update(
        raw_prompt=texts,
        ground_truth=[ground_truth_of(row, answer_key) for row in rows],
        data_source=[row.get("data_source") or "" for row in rows],
        uid=[str(uuid.uuid4()) for _ in rows],
    )
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": compute_position_id_with_mask(attention_mask),
        },
        non_tensors,
    )


def sft_batch(
    rows: Sequence[dict],
    tokenizer,
    *,
    prompt_key: str = "prompt",
    response_key: str = "response",
    conversation_key: str = "messages",
    chat_template_kwargs: dict | None = None,
) -> DataProto:
    """SFT sequences, left-padded, with ``loss_mask`` = 1 on the tokens to learn. A row is either a conversation
    (``conversation_key``: chat messages; the loss is on the assistant turns, see ``conversation_tokens``) or a
    prompt (a string, or chat messages rendered with the generation prompt) and its ``response``, followed by the
    tokenizer's eos (the loss is on the response and that eos)."""
    pairs = [row for row in rows if row.get(conversation_key) is None]
    _, prompts = prompt_token_ids([row[prompt_key] for row in pairs], tokenizer, chat_template_kwargs)
    responses = (
        tokenizer([str(row[response_key]) for row in pairs], add_special_tokens=False)["input_ids"] if pairs else []
    )
    paired = iter(zip(prompts, responses))
    sequences, loss_masks = [], []
    for row in rows:
        if row.get(conversation_key) is not None:
            ids, mask = conversation_tokens(row[conversation_key], tokenizer, chat_template_kwargs)
        else:
            prompt, response = next(paired)
            response = [*response, tokenizer.eos_token_id]
            ids, mask = prompt + response, [0] * len(prompt) + [1] * len(response)
        sequences.append(ids)
        loss_masks.append(mask)
    input_ids, attention_mask = left_pad(sequences, tokenizer.pad_token_id)
    loss_mask, _ = left_pad(loss_masks, 0)
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": compute_position_id_with_mask(attention_mask),
            "loss_mask": loss_mask,
        }
    )


def decode_responses(data: DataProto, tokenizer) -> list[str]:
    """The response text of every row (its masked-in tokens up to, not including, EOS), decoded in one batch: for
    many short rows several times faster than one ``decode`` (and one tensor slice) per row."""
    rows = []
    for ids, mask in zip(data.batch["responses"].tolist(), data.batch["response_mask"].tolist()):
        tokens = [token for token, keep in zip(ids, mask) if keep]
        if tokens and tokens[-1] == tokenizer.eos_token_id:
            tokens.pop()
        rows.append(tokens)
    return tokenizer.batch_decode(rows, skip_special_tokens=True)
