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
"""

from __future__ import annotations

import functools
import json

import fsspec
import numpy as np
import torch

from rlworkers.algorithms.core_algos import compute_token_level_scores
from rlworkers.data.batching import decode_responses
from rlworkers.models.loading import load_tokenizer, resolve_model_path, torch_dtype
from rlworkers.protocol import DataProto
from rlworkers.rewards.loading import load_reward_fn
from rlworkers.rewards.scoring import compute_reward_values
from rlworkers.single_controller import Dispatch, Worker, register
from rlworkers.workers.config import RewardConfig

INTERNAL_COLUMNS = ("uid", "raw_prompt")  # not passed as columns (raw_prompt is the ``prompts`` argument)
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


@functools.lru_cache(maxsize=8)
def _load(tokenizer_path: str, reward_fn: str):
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


class RewardWorker(Worker):
    def __init__(self, config: RewardConfig | dict, tokenizer_path: str):
        super().__init__()
        self.config = config if isinstance(config, RewardConfig) else RewardConfig.model_validate(config)
        self.tokenizer_path = tokenizer_path
        self.reward_model = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.tokenizer = load_tokenizer(self.tokenizer_path)
        if self.config.reward_model is not None:
            from transformers import AutoModelForSequenceClassification

            path = resolve_model_path(self.config.reward_model.path)
            self.reward_model = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=1, dtype=torch_dtype(self.config.reward_model.dtype)
            ).eval()
            if self.reward_model.config.pad_token_id is None:
                self.reward_model.config.pad_token_id = self.tokenizer.pad_token_id
        else:
            self.rule = RuleReward(self.config, self.tokenizer_path).load()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        if self.reward_model is None:
            return self.rule.compute_rm_score(data)
        with torch.no_grad():
            logits = self.reward_model(input_ids=data.batch["input_ids"], attention_mask=data.batch["attention_mask"])
        return scores_to_proto(logits.logits[:, 0].float().tolist(), data)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        if self.rank == 0:
            save_reward_spec(path, self.config)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        check_reward_spec(path, self.config)
