"""CriticWorker: a value model (the policy's backbone with a one-output token head) for PPO with GAE.

``compute_values`` gives ``values [B, R]``: the value at the position that predicts each response token.
``update_critic`` fits them to ``returns`` with the clipped value loss, over mini-batches and micro-batches.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import numpy as np
import torch

from rlworkers.algorithms.core_algos import compute_value_loss, masked_mean
from rlworkers.models.loading import base_model_path, resolve_model_path, torch_dtype
from rlworkers.protocol import DataProto
from rlworkers.single_controller import Dispatch, Worker, register
from rlworkers.workers import common, fsdp
from rlworkers.workers.config import CriticConfig, ModelConfig


class CriticWorker(Worker):
    def __init__(
        self,
        config: CriticConfig | dict,
        model: ModelConfig | dict,
        device: str = "cpu",
        backend: str | None = None,
        seed: int = 0,
        collective_timeout_s: float = 600.0,
    ):
        super().__init__()
        self.config = config if isinstance(config, CriticConfig) else CriticConfig.model_validate(config)
        fallback = model if isinstance(model, ModelConfig) else ModelConfig.model_validate(model)
        self.model_config = self.config.model or fallback
        self.device, self.backend, self.seed = device, backend, seed
        self.collective_timeout_s = collective_timeout_s

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.init_process_group(self.backend, timeout_s=self.collective_timeout_s)
        common.seed_everything(self.seed)  # the new value head starts identical on every rank
        from transformers import AutoModelForTokenClassification  # see rlworkers/transformers_import.py

        path = base_model_path(resolve_model_path(self.model_config.path))  # a LoRA adapter's critic starts at its base
        self.model = AutoModelForTokenClassification.from_pretrained(
            path, num_labels=1, dtype=torch_dtype(self.model_config.dtype)
        )
        if self.model_config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.config.strategy == "fsdp2":  # sharded over the workers; mixed precision from model.autocast
            autocast = common.resolve_autocast(self.model_config, self.device)
            compute_dtype = torch_dtype(autocast) if autocast else None
            self.module = fsdp.shard_model(self.model, self.config.fsdp_config, self.device, compute_dtype)
        else:
            self.model.to(self.device)
            self.module = common.wrap_data_parallel(self.model, self.device)
        self.optimizer = common.build_optimizer(self.model.parameters(), self.config.optim)
        self.lr_scheduler = common.build_lr_scheduler(self.optimizer, self.config.optim)

    def _values(self, module, batch) -> torch.Tensor:
        keep = batch["responses"].shape[-1] + 1
        # the values at the positions that predict the response tokens (and the one after); a prompt start every row
        # shares is computed once, as in the actor's forwards
        shared = common.prefix_to_compute_once(module, batch, keep)
        with common.autocast(self.model_config, self.device):  # model.autocast: mixed precision, as the actor's
            if shared:
                out = common.logits_sharing_prefix(module, batch, shared, keep).squeeze(-1)
            else:
                out = module(
                    input_ids=batch["input_ids"],
                    attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"],
                    use_cache=False,
                ).logits.squeeze(-1)[:, -keep:]
        return out.float()[:, :-1] * batch["response_mask"]

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        data = common.to_device(data, self.device)
        self.model.eval()  # no dropout (the token head's classifier dropout is 0.1) in the values GAE uses
        with torch.no_grad():
            values = torch.cat(
                [
                    self._values(self.model, micro.batch)
                    for micro in data.split(self.config.ppo_micro_batch_size_per_gpu)
                ]
            )
        return DataProto.from_dict({"values": values}).to("cpu")

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto:
        """Needs ``input_ids, attention_mask, position_ids, responses, response_mask, values, returns``."""
        data = common.to_device(data, self.device)
        cfg = self.config
        mini_size = common.per_rank_batch_size(cfg.ppo_mini_batch_size, self.world_size, "critic.ppo_mini_batch_size")
        generator = torch.Generator().manual_seed(self.seed)
        metrics = defaultdict(list)
        self.module.train()
        for _ in range(cfg.ppo_epochs):
            for mini in common.mini_batches(data, mini_size, True, generator):
                micros = mini.split(cfg.ppo_micro_batch_size_per_gpu)
                for i, micro in enumerate(micros):
                    ddp = isinstance(self.module, torch.nn.parallel.DistributedDataParallel)
                    sync = contextlib.nullcontext() if (not ddp or i == len(micros) - 1) else self.module.no_sync()
                    with sync:
                        batch = micro.batch
                        vpreds = self._values(self.module, batch)
                        vf_loss, vf_clipfrac = compute_value_loss(
                            vpreds,
                            batch["returns"],
                            batch["values"],
                            batch["response_mask"],
                            cliprange_value=cfg.cliprange_value,
                            loss_agg_mode=cfg.loss_agg_mode,
                        )
                        (vf_loss * len(micro) / len(mini)).backward()
                    metrics["critic/vf_loss"].append(vf_loss.item())
                    metrics["critic/vf_clipfrac"].append(vf_clipfrac.item())
                    metrics["critic/vpred_mean"].append(masked_mean(vpreds, batch["response_mask"]).item())
                grad_norm = common.clip_grad_norm(self.model.parameters(), cfg.optim.grad_clip)
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                self.optimizer.zero_grad()
                metrics["critic/grad_norm"].append(float(grad_norm))
        self.lr_scheduler.step()
        metrics["critic/lr"].append(self.lr_scheduler.get_last_lr()[0])
        return DataProto(meta_info={"metrics": {k: float(np.mean(v)) for k, v in metrics.items()}})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """The value model and its optimizer state from rank 0 (DDP: the same on every rank), each rank's scheduler
        state; with fsdp2 every rank's shard of the model and optimizer state (``fsdp.save_sharded``)."""
        sharded = fsdp.is_sharded(self.model)
        if sharded:
            fsdp.save_sharded(f"{path}/{fsdp.SHARDS}", self.model, self.optimizer)
        elif self.rank == 0:
            common.save_model(self.model, None, path)
        state = {"lr_scheduler": self.lr_scheduler.state_dict()}
        if not sharded and self.rank == 0:
            state["optimizer"] = self.optimizer.state_dict()
        common.save_torch(state, f"{path}/critic_state_rank_{self.rank}.pt")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str, load_optimizer: bool = True) -> None:
        sharded = fsdp.is_sharded(self.model)
        if sharded:
            fsdp.load_sharded(f"{path}/{fsdp.SHARDS}", self.model, self.optimizer if load_optimizer else None)
        else:
            self.model.load_state_dict(common.load_weights(path))
        if load_optimizer:
            own = f"{path}/critic_state_rank_{self.rank}.pt"
            saved = common.load_torch(own if common.exists(own) else f"{path}/critic_state_rank_0.pt")
            if not sharded:  # rank 0's (checkpoints of before 2026-11-27 have a copy in every rank's file)
                optimizer = saved.get("optimizer") or common.load_torch(f"{path}/critic_state_rank_0.pt")["optimizer"]
                self.optimizer.load_state_dict(optimizer)
            self.lr_scheduler.load_state_dict(saved["lr_scheduler"])
