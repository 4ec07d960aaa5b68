"""The reward: a rule function scored where the batch already is (``RuleReward``, the default), or a reward model
(or a rule too heavy or too risky for the controller's side) in worker processes (``RewardWorker``).

Both answer the same three calls, so a flow's ``compute_reward`` stage does not care which it holds:
``compute_rm_score(batch)`` -> ``token_level_scores [B, R]`` (each row's score on its last response token) and the
non-tensor column ``score`` (the per-row number); ``save_checkpoint(path)`` records what the reward was;
``load_checkpoint(path)`` refuses to resume a run trained with another reward. Rule functions follow
``reward_fn(prompts, responses, **columns) -> list[float]`` and are loaded only from a registered name or an
explicitly named file/module (``rewards.registry``).

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
from rlworkers.rewards.registry import compute_scores, load_reward_fn
from rlworkers.single_controller import Dispatch, Worker, register
from rlworkers.workers.config import RewardConfig

REWARD_COLUMNS = ("ground_truth", "data_source")


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
        columns = {k: list(data.non_tensor_batch[k]) for k in REWARD_COLUMNS if k in data.non_tensor_batch}
        prompts = list(data.non_tensor_batch.get("raw_prompt", [""] * len(data)))
        scores = compute_scores(reward_fn, prompts, decode_responses(data, tokenizer), **columns)
        return scores_to_proto(scores, data)

    def save_checkpoint(self, path: str) -> None:
        save_reward_spec(path, self.config)

    def load_checkpoint(self, path: str) -> None:
        check_reward_spec(path, self.config)


@functools.lru_cache(maxsize=8)
def _load(tokenizer_path: str, reward_fn: str):
    return load_tokenizer(tokenizer_path), load_reward_fn(reward_fn)


def scores_to_proto(scores: list[float], data: DataProto) -> DataProto:
    token_level = compute_token_level_scores(torch.tensor(scores), data.batch["response_mask"])
    return DataProto.from_dict({"token_level_scores": token_level}, {"score": np.array(scores, dtype=object)})


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
