"""The reward: a rule function scored where the batch already is (``RuleReward``, the default), or a reward model
(or a rule too heavy or too risky for the controller's side) in worker processes (``RewardWorker``).

Both answer the same three calls, so a flow's ``compute_reward`` stage does not care which it holds:
``compute_rm_score(batch)`` -> ``token_level_scores [B, R]`` (each row's score on its last response token), the
non-tensor column ``score`` (the per-row number) and, for each extra key a rule function returned in its dicts
(``{"score": 1.0, "acc": True}``, verl's ``reward_extra_info``), a float column ``reward_extra/<key>`` (NaN for a
row without it); ``save_checkpoint(path)`` records what the reward was; ``load_checkpoint(path)`` refuses to resume
a run trained with another reward.

Rule functions are loaded only from a registered name or an explicitly named file/module
(``rewards.loading.load_reward_fn``), with rlflow's ``reward_fn(prompts, responses, **columns)``, verl's per-sample
``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` or verl's batch
``compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs)`` (the registry's docstring
says what each gets). ``prompts`` is the batch's ``raw_prompt`` (the text the model saw), ``responses`` the decoded
responses, and ``columns`` every other non-tensor column of the batch (``reward_columns``): the dataset's columns
(verl's ``reward_model`` and ``extra_info`` dicts, ``ability``, the user's own), ``ground_truth`` and
``data_source``; not ``uid`` and ``raw_prompt``, nor the columns rewards write (``score``, ``reward_extra/*``).

Where a rule runs (``reward.num_workers``): with 0 (the default for rules), the ``compute_reward`` stage task scores
the batch itself, in the process Ray already delivered the generated batch to, as verl's trainer calls its
``reward_fn`` on the driver: no reward processes to start and hold, no second copy of the batch sent to them.
With ``num_workers >= 1`` (required for a reward model), a ``RewardWorker`` group scores its slices: for reward
functions that are slow (run them in parallel) or that could hang or crash their process (isolate them).

A reward model (``reward.reward_model``, a sequence classifier: ``RewardModel``) reads text in its own vocabulary,
not the policy's ids: each row is decoded with the policy's tokenizer and re-rendered for the reward model, as verl's
reward-model worker does (see ``RewardModel.texts``). It runs on the run's device (``trainer.device``), in its
``dtype``, under its ``autocast``.
"""

from __future__ import annotations

import functools
import json
import logging
import os

import fsspec
import numpy as np
import torch

from rlworkers.algorithms.core_algos import compute_token_level_scores
from rlworkers.data.batching import decode_responses
from rlworkers.data.chat import plain_messages
from rlworkers.models.loading import load_tokenizer, resolve_model_path, torch_dtype
from rlworkers.protocol import DataProto
from rlworkers.rewards.loading import load_reward_fn
from rlworkers.rewards.scoring import compute_reward_values
from rlworkers.single_controller import Dispatch, Worker, register
from rlworkers.workers import common
from rlworkers.workers.config import ModelConfig, RewardConfig

logger = logging.getLogger(__name__)

# not passed as columns (raw_prompt is the ``prompts`` argument; policy_version says which policy sampled a response)
INTERNAL_COLUMNS = ("uid", "raw_prompt", "policy_version")
REWARD_OUTPUT_COLUMNS = ("score",)  # written by rewards, with every column under REWARD_EXTRA_PREFIX
REWARD_EXTRA_PREFIX = "reward_extra/"


def reward_columns(data: DataProto) -> dict[str, list]:
    """The non-tensor columns a rule function gets as ``columns``: all of them but ``INTERNAL_COLUMNS`` and those
    a reward wrote (``score``, ``reward_extra/*``)."""
    return {
        key: list(values)
        for key, values in data.non_tensor_batch.items()
        if key not in INTERNAL_COLUMNS and key not in REWARD_OUTPUT_COLUMNS and not key.startswith(REWARD_EXTRA_PREFIX)
    }


class RuleReward:
    """A rule reward function, called in the calling process. Pickles as its config: the tokenizer and the
    function are loaded once per process, on first use (``_load``)."""

    def __init__(self, config: RewardConfig | dict, tokenizer_path: str):
        self.config = config if isinstance(config, RewardConfig) else RewardConfig.model_validate(config)
        if self.config.reward_model is not None:
            raise ValueError("RuleReward scores with rule functions; a reward model runs in a RewardWorker group")
        self.tokenizer_path = tokenizer_path

    def load(self) -> RuleReward:
        """Load the tokenizer and the reward function now (a bad ``reward.reward_fn`` fails here, by name)."""
        _load(self.tokenizer_path, self.config.reward_fn)
        return self

    def compute_rm_score(self, data: DataProto) -> DataProto:
        tokenizer, reward_fn = _load(self.tokenizer_path, self.config.reward_fn)
        prompts = list(data.non_tensor_batch.get("raw_prompt", [""] * len(data)))
        responses = decode_responses(data, tokenizer)
        scores, extras = compute_reward_values(reward_fn, prompts, responses, **reward_columns(data))
        return scores_to_proto(scores, data, extras)

    def save_checkpoint(self, path: str) -> None:
        save_reward_spec(path, self.config)

    def load_checkpoint(self, path: str) -> None:
        check_reward_spec(path, self.config)


def _load(tokenizer_path: str, reward_fn: str):
    """The tokenizer and the reward function, loaded once per process while the reward file stays as it is: a
    process that outlives a run (a kept task host or worker) loads a file edited since again."""
    file = reward_fn.rsplit(":", 1)[0] if isinstance(reward_fn, str) else ""
    version = None
    if file.endswith(".py") and os.path.isfile(file):
        stat = os.stat(file)
        version = (stat.st_mtime_ns, stat.st_size)
    return _load_once(tokenizer_path, reward_fn, version)


@functools.lru_cache(maxsize=8)
def _load_once(tokenizer_path: str, reward_fn: str, file_version: tuple | None):
    return load_tokenizer(tokenizer_path), load_reward_fn(reward_fn)


def scores_to_proto(scores: list[float], data: DataProto, extras: dict[str, list[float]] | None = None) -> DataProto:
    """``token_level_scores`` (each score on its row's last response token), the non-tensor ``score`` and one
    float64 column ``reward_extra/<key>`` per extra key."""
    token_level = compute_token_level_scores(torch.tensor(scores), data.batch["response_mask"])
    non_tensors = {"score": np.array(scores, dtype=object)}
    for key, values in (extras or {}).items():
        non_tensors[f"{REWARD_EXTRA_PREFIX}{key}"] = np.asarray(values, dtype=np.float64)
    return DataProto.from_dict({"token_level_scores": token_level}, non_tensors)


def save_reward_spec(path: str, config: RewardConfig) -> None:
    """The reward is frozen: record what it was (rule spec or model path) so a resume can check it."""
    with fsspec.open(f"{path}/reward.json", "w") as f:
        json.dump(config.model_dump(mode="json", exclude={"num_workers"}), f)


def check_reward_spec(path: str, config: RewardConfig) -> None:
    """Refuse to resume a run whose reward differs from the one it was trained with (where it runs may differ)."""
    with fsspec.open(f"{path}/reward.json") as f:
        saved = json.load(f)
    current = config.model_dump(mode="json", exclude={"num_workers"})
    if saved != current:
        raise ValueError(
            f"{path}: the run was trained with reward {saved}, this config has {current}; "
            "resume with the same reward settings"
        )


class RewardModel:
    """A sequence-classification reward model with its own tokenizer, on ``device``: one score per row.

    A reward model was trained on text in its own vocabulary and, for a chat model, in its own chat template; the
    policy's ids mean other tokens to it (or none). So ``texts`` decodes each row's prompt and response with the
    policy's tokenizer and renders them again for the reward model, and ``score`` tokenizes that with the reward
    model's tokenizer. The score is the model's own: transformers' sequence classifiers read the last token that is
    not ``pad_token_id``, as they did in training (the model's pad id when its config has one, else its tokenizer's).
    """

    micro_batch_size = 32  # rows per forward pass: bounds the activations' memory on a GPU

    def __init__(self, config: ModelConfig, device: str = "cpu"):
        from transformers import AutoModelForSequenceClassification  # see rlworkers/transformers_import.py

        self.config, self.device = config, device
        path = resolve_model_path(config.path)
        self.tokenizer = load_tokenizer(path, trust_remote_code=config.trust_remote_code, padding_side="right")
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=torch_dtype(config.dtype), trust_remote_code=config.trust_remote_code
        ).eval()
        self.model.to(device)
        text_config = self.model.config.get_text_config()
        if text_config.pad_token_id is None:
            text_config.pad_token_id = self.tokenizer.pad_token_id
        self.pad_token_id = text_config.pad_token_id  # what the model pools by: the padding must be this id
        self.max_length = _context_length(self.model.config, self.tokenizer)
        self.has_chat_template = bool(getattr(self.tokenizer, "chat_template", None))
        if config.gradient_checkpointing:
            logger.warning("reward.reward_model.gradient_checkpointing does nothing: a reward model computes no grads")
        self._warned = set()

    def texts(self, data: DataProto, policy_tokenizer, prompt_key: str) -> tuple[list[str], list[bool]]:
        """Each row as the reward model reads it, and whether its chat template wrote it.

        The response is the policy's decoded response (up to its eos). A row whose prompt (column ``prompt_key``)
        was chat messages becomes ``[*messages, {"role": "assistant", "content": response}]`` in the reward
        model's chat template (verl's ``_switch_chat_template``); any other row, or any row for a reward model
        without a chat template, is the prompt text the policy saw (``raw_prompt``) followed by the response."""
        responses = decode_responses(data, policy_tokenizer)
        prompts = data.non_tensor_batch.get("raw_prompt")
        if prompts is None:  # a batch built by hand: the prompt is what its ids say
            prompts = policy_tokenizer.batch_decode(data.batch["prompts"], skip_special_tokens=True)
        messages = data.non_tensor_batch.get(prompt_key, [None] * len(data))
        texts, chat = [], []
        for prompt, message, response in zip(prompts, messages, responses):
            if isinstance(message, (list, tuple, np.ndarray)):
                if self.has_chat_template:
                    conversation = [*plain_messages(list(message)), {"role": "assistant", "content": response}]
                    texts.append(self.tokenizer.apply_chat_template(conversation, tokenize=False))
                    chat.append(True)
                    continue
                self._warn_once(
                    "no-template",
                    "reward model %s has no chat template: chat prompts reach it as the policy rendered them",
                    self.config.path,
                )
            texts.append(str(prompt) + response)
            chat.append(False)
        return texts, chat

    def score(self, texts: list[str], chat: list[bool]) -> list[float]:
        """The reward model's score of each text. Rendered chat is tokenized without the tokenizer's special
        tokens (the template wrote its own), plain text with them (a BOS, say), as prompts are
        (``rlworkers.data.chat.prompt_token_ids``); a text longer than the model's context keeps its start."""
        ids = [None] * len(texts)
        for is_chat in (False, True):
            where = [i for i, flag in enumerate(chat) if flag == is_chat]
            if where:
                encoded = self.tokenizer([texts[i] for i in where], add_special_tokens=not is_chat)["input_ids"]
                for i, one in zip(where, encoded):
                    ids[i] = list(one)
        if self.max_length is not None and (cut := sum(len(one) > self.max_length for one in ids)):
            self._warn_once(
                "truncated",
                "%d of %d rows are longer than the reward model's %d tokens: scored on their first %d",
                cut,
                len(ids),
                self.max_length,
                self.max_length,
            )
            ids = [one[: self.max_length] for one in ids]
        scores = []
        with torch.no_grad(), common.autocast(self.config, self.device):
            for start in range(0, len(ids), self.micro_batch_size):
                input_ids, attention_mask = _right_pad(ids[start : start + self.micro_batch_size], self.pad_token_id)
                logits = self.model(
                    input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device), use_cache=False
                ).logits
                scores.extend(logits[:, 0].float().tolist())
        return scores

    def _warn_once(self, key: str, message: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)


def _context_length(model_config, tokenizer) -> int | None:
    """The longest input the reward model takes: its position embeddings' length, else its tokenizer's
    ``model_max_length`` (transformers sets a huge number when it is unknown), else no limit."""
    limits = [getattr(model_config.get_text_config(), "max_position_embeddings", None)]
    limits.append(tokenizer.model_max_length if tokenizer.model_max_length < 1_000_000 else None)
    limits = [limit for limit in limits if limit]
    return min(limits) if limits else None


def _right_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` ``[B, longest]``, each sequence from the left and ``pad_id`` after it: the reward model pools
    the last token that is not ``pad_id``, and positions count from each row's first token."""
    width = max(len(one) for one in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, one in enumerate(sequences):
        ids[row, : len(one)] = torch.tensor(one, dtype=torch.long)
        mask[row, : len(one)] = 1
    return ids, mask


class RewardWorker(Worker):
    """Scores a batch: a rule (``RuleReward``, run in this process) or a reward model (``RewardModel``) on
    ``device``. ``tokenizer_path`` is the policy's tokenizer, which decodes the batch's ids; ``prompt_key`` is the
    data's prompt column (``data.prompt_key``), where a reward model finds a row's chat messages."""

    def __init__(
        self, config: RewardConfig | dict, tokenizer_path: str, device: str = "cpu", prompt_key: str = "prompt"
    ):
        super().__init__()
        self.config = config if isinstance(config, RewardConfig) else RewardConfig.model_validate(config)
        self.tokenizer_path = tokenizer_path
        self.device, self.prompt_key = device, prompt_key
        self.reward_model = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.tokenizer = load_tokenizer(self.tokenizer_path)
        if self.config.reward_model is not None:
            self.reward_model = RewardModel(self.config.reward_model, self.device)
        else:
            self.rule = RuleReward(self.config, self.tokenizer_path).load()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """Each row's score, on its last response token of the policy's sequence (``scores_to_proto``)."""
        if self.reward_model is None:
            return self.rule.compute_rm_score(data)
        texts, chat = self.reward_model.texts(data, self.tokenizer, self.prompt_key)
        return scores_to_proto(self.reward_model.score(texts, chat), data)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        if self.rank == 0:
            save_reward_spec(path, self.config)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        check_reward_spec(path, self.config)
