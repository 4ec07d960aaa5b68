"""RewardWorker: scores responses with a rule function (default) or a reward model.

Output: ``token_level_scores [B, R]`` (each row's score on its last response token) and the non-tensor column
``score`` (the per-row number). Rule functions follow ``reward_fn(prompts, responses, **columns) -> list[float]``
and are loaded only from a registered name or an explicitly named file/module (``rewards.registry``).
"""

from __future__ import annotations

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
            self.reward_fn = load_reward_fn(self.config.reward_fn)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        if self.reward_model is not None:
            with torch.no_grad():
                scores = (
                    self.reward_model(input_ids=data.batch["input_ids"], attention_mask=data.batch["attention_mask"])
                    .logits[:, 0]
                    .float()
                    .tolist()
                )
        else:
            columns = {k: list(data.non_tensor_batch[k]) for k in REWARD_COLUMNS if k in data.non_tensor_batch}
            prompts = list(data.non_tensor_batch.get("raw_prompt", [""] * len(data)))
            scores = compute_scores(self.reward_fn, prompts, decode_responses(data, self.tokenizer), **columns)
        token_level = compute_token_level_scores(torch.tensor(scores), data.batch["response_mask"])
        return DataProto.from_dict({"token_level_scores": token_level}, {"score": np.array(scores, dtype=object)})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """The reward is frozen: record what it was (rule spec or model path) so a resume can check it."""
        if self.rank == 0:
            with fsspec.open(f"{path}/reward.json", "w") as f:
                json.dump(self.config.model_dump(mode="json"), f)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Refuse to resume a run whose reward differs from the one it was trained with."""
        with fsspec.open(f"{path}/reward.json") as f:
            saved = json.load(f)
        if saved != self.config.model_dump(mode="json"):
            raise ValueError(
                f"{path}: the run was trained with reward {saved}, this config has "
                f"{self.config.model_dump(mode='json')}; resume with the same reward settings"
            )
