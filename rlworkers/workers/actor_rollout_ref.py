"""ActorRolloutRefWorker: the policy model in its three roles, any combination in one process.

* ``actor``: trains the policy (``update_actor``: PPO epochs over mini-batches, micro-batch gradient accumulation,
  grad clipping, LR schedule; ``sft_step`` for the supervised warm-up) and recomputes log-probs
  (``compute_log_prob``).
* ``rollout``: samples responses (``generate_sequences``) from the actor's weights — the same module, so every
  update is visible to the next rollout without a copy.
* ``ref``: a frozen copy of the initial policy (``compute_ref_log_prob``) for KL.

Data parallel over the group (gloo on CPU, nccl on CUDA): each worker gets an equal slice of the batch (the single
controller pads). ``actor.strategy: ddp`` (default): torch DDP, every worker holds the whole model, gradients are
all-reduced, replicas stay identical. ``fsdp2``: the policy and the reference are sharded over the workers
(``rlworkers.workers.fsdp``); HF generation runs on the policy's gathered parameters, vLLM takes them tensor by tensor,
checkpoints are each rank's shard (``torch.distributed.checkpoint``).

    role="actor_rollout_ref" | "actor_rollout" | "actor" | "rollout" | "ref"
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict

import numpy as np
import torch

from rlworkers.algorithms import core_algos
from rlworkers.models import lora
from rlworkers.models.loading import (
    base_model_path,
    load_model,
    load_tokenizer,
    named_model,
    resolve_model_path,
    torch_dtype,
)
from rlworkers.protocol import DataProto
from rlworkers.single_controller import Dispatch, Worker, register
from rlworkers.workers import common, fsdp
from rlworkers.workers.config import WorkerConfig
from rlworkers.workers.rollout import build_rollout, sampling_request

logger = logging.getLogger(__name__)

ROLES = ("actor", "rollout", "ref")
POLICY_VERSION = "policy_version"  # the column of a generated batch: its policy's number of updates


class ActorRolloutRefWorker(Worker):
    def __init__(self, config: WorkerConfig | dict, role: str = "actor_rollout_ref"):
        super().__init__()
        self.config = config if isinstance(config, WorkerConfig) else WorkerConfig.model_validate(config)
        parts = role.split("_")
        if not parts or any(p not in ROLES for p in parts):
            raise ValueError(f"role {role!r}: use actor, rollout, ref or an '_'-joined combination of them")
        self.role = role
        self._is_actor, self._is_rollout, self._is_ref = ("actor" in parts, "rollout" in parts, "ref" in parts)
        self.device = self.config.device
        self.update_steps = 0

    # ------------------------------------------------------------------------------------------------ set-up
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        cfg = self.config
        self.init_process_group(cfg.backend, timeout_s=cfg.collective_timeout_s)
        common.seed_everything(cfg.seed)  # identical initial weights (and LoRA initialisation) on every rank
        path = resolve_model_path(cfg.model.path)
        self.lora = cfg.actor.lora.enabled
        self.base_path = base_model_path(path)  # path itself unless it is a LoRA adapter folder
        self.tokenizer = load_tokenizer(path, trust_remote_code=cfg.model.trust_remote_code)
        self.ref_model = None
        # fsdp2 shards what trains and the reference beside it; a rollout pool of its own holds the whole model: it
        # is sent the gathered weights (``set_policy_weights``) and generates on its own
        self.sharded = cfg.actor.strategy == "fsdp2" and (self._is_actor or self._is_ref)
        if self._is_actor or self._is_rollout:
            self.model = self._shard(self._load_policy(path))
        if self._is_actor:
            # DDP syncs what requires grad only; a sharded model is its own data-parallel wrapper
            self.module = self.model if self.sharded else common.wrap_data_parallel(self.model, self.device)
            trainable = [p for p in self.model.parameters() if p.requires_grad]
            self.optimizer = common.build_optimizer(trainable, cfg.actor.optim)
            self.lr_scheduler = common.build_lr_scheduler(self.optimizer, cfg.actor.optim)
            self.policy_loss_fn = core_algos.get_policy_loss_fn(cfg.actor.policy_loss)
        if self._is_rollout:
            self.rollout = build_rollout(
                cfg.rollout, self.model, self.tokenizer, self.base_path, synced_gpus=self._lockstep_generation
            )
            self.agent_loop = None
            if cfg.rollout.multi_turn.enable:  # several turns with tools / an environment (rlworkers.agents)
                from rlworkers.workers.rollout.agent_loop import build_agent_loop

                self.agent_loop = build_agent_loop(cfg.rollout.multi_turn, self.tokenizer)
        if self._is_ref and not (self.lora and (self._is_actor or self._is_rollout)):
            # with LoRA the reference is the base: the policy's own module with its adapter disabled, or here alone
            self.ref_model = self._shard(self._load(self.base_path if self.lora else path).to(self._load_device))
            self.ref_model.eval().requires_grad_(False)
        common.seed_everything(cfg.seed + 1000 * (self.rank + 1))  # different samples on every rank

    @property
    def _lockstep_generation(self) -> bool:
        """HF generation on this worker's sharded policy a layer gathered at a time (``lockstep_generation``)."""
        return self.config.lockstep_generation and self.sharded

    @property
    def _load_device(self) -> str:
        return "cpu" if self.sharded else self.device  # fully_shard moves each shard to the device, not the whole

    def _shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """``actor.strategy=fsdp2``: ``model`` sharded over the workers (mixed precision from ``model.autocast``)."""
        if not self.sharded:
            return model
        autocast = common.resolve_autocast(self.config.model, self.device)
        compute_dtype = torch_dtype(autocast) if autocast else None
        return fsdp.shard_model(model, self.config.actor.fsdp_config, self.device, compute_dtype)

    def _load(self, path: str) -> torch.nn.Module:
        cfg = self.config.model
        return load_model(path, dtype=torch_dtype(cfg.dtype), trust_remote_code=cfg.trust_remote_code)

    def _load_policy(self, path: str) -> torch.nn.Module:
        """The policy: the model at ``path`` (an adapter folder loads merged), or with ``actor.lora`` the base with a
        new adapter, or with the adapter saved at ``path`` (a lineage's champion) to train further."""
        cfg = self.config
        checkpointing = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}  # frozen inputs under LoRA
        if not self.lora:
            model = self._load(path)
            if cfg.model.gradient_checkpointing:
                model.gradient_checkpointing_enable(**checkpointing)
            return model.to(self._load_device)
        base = self._load(self.base_path)
        if cfg.model.gradient_checkpointing:
            base.gradient_checkpointing_enable(**checkpointing)
        settings = cfg.actor.lora
        if lora.is_adapter_folder(path):
            lora.check_settings(path, settings)
            model = lora.load_adapter(base, path, trainable=self._is_actor)
        else:
            model = lora.attach_adapter(
                base, lora.lora_config(settings.rank, settings.alpha, settings.dropout, settings.target_modules)
            )
        return model.to(self.device)

    # ------------------------------------------------------------------------------------------------ rollout
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """``input_ids``/``attention_mask`` of left-padded prompts -> sampled responses (see ``rollout``)."""
        self._require(self._is_rollout, "generate_sequences", "rollout")
        hf = self.config.rollout.name == "hf"  # vLLM runs its own kernels in the model's dtype
        prompts = common.to_device(prompts, self.device)
        # gathered once: no collective while generating (else a layer at a time, the ranks in lockstep)
        gather = hf and not self._lockstep_generation
        gathered = fsdp.gathered(self.model) if gather else contextlib.nullcontext()
        with self._autocast() if hf else contextlib.nullcontext(), gathered, self._own_random_state(prompts) as prompts:
            if self.agent_loop is None:
                out = self.rollout.generate_sequences(prompts).to("cpu")
            else:
                request = sampling_request(prompts, self.config.rollout)  # several turns, tools between them
                out = self.agent_loop.generate_sequences(
                    request.prompts,
                    request.response_length,
                    lambda contexts, budgets: self.rollout.generate_turns(contexts, budgets, request),
                ).to("cpu")
        # which policy sampled each response: the number of updates its weights have had (async_training.staleness)
        out.non_tensor_batch[POLICY_VERSION] = np.full(len(out), self.update_steps, dtype=np.int64)
        return out

    @contextlib.contextmanager
    def _own_random_state(self, prompts: DataProto):
        """A call with ``meta_info["seed"]`` (an eval set's sampled decoding) draws from a random state of its own,
        seeded per rank, and leaves the training's as it was: a run with a sampled eval set trains exactly as one
        without, and a resumed run as a straight one. Yields the prompts with this rank's seed."""
        seed = prompts.meta_info.get("seed")
        if seed is None:
            yield prompts
            return
        rank_seed = int(seed) + 1_000_003 * self.rank
        meta = {**prompts.meta_info, "seed": rank_seed}
        devices = [torch.cuda.current_device()] if str(self.device).startswith("cuda") else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(rank_seed)
            yield DataProto(batch=prompts.batch, non_tensor_batch=prompts.non_tensor_batch, meta_info=meta)

    # ------------------------------------------------------------------------------------------------ log-probs
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """``old_log_probs [B, R]`` and ``entropys [B, R]`` of ``responses`` under the current actor."""
        self._require(self._is_actor, "compute_log_prob", "actor")
        temperature = data.meta_info.get("temperature", self.config.rollout.temperature)
        with self._autocast():
            log_probs, entropy = common.response_log_probs(
                self.model,
                common.to_device(data, self.device),
                temperature,
                self.config.rollout.log_prob_micro_batch_size_per_gpu,
                with_entropy=True,
            )
        return DataProto.from_dict(
            {"old_log_probs": log_probs, "entropys": entropy}, meta_info={"temperature": temperature}
        ).to("cpu")

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_log_prob [B, R]`` under the frozen reference policy."""
        self._require(self._is_ref, "compute_ref_log_prob", "ref")
        temperature = data.meta_info.get("temperature", self.config.rollout.temperature)
        with self._reference() as reference, self._autocast():
            log_probs, _ = common.response_log_probs(
                reference, common.to_device(data, self.device), temperature, self.config.ref_micro_batch_size_per_gpu
            )
        return DataProto.from_dict({"ref_log_prob": log_probs}).to("cpu")

    def _autocast(self):
        return common.autocast(self.config.model, self.device)

    @contextlib.contextmanager
    def _reference(self):
        """The reference policy: its own frozen model, or (LoRA) the policy with its adapter disabled."""
        if self.ref_model is not None:
            yield self.ref_model
            return
        with self.model.disable_adapter():
            yield self.model

    # ------------------------------------------------------------------------------------------------ training
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        """PPO-style update on ``advantages``: ``ppo_epochs`` x mini-batches, each one optimizer step.

        Needs ``input_ids, attention_mask, position_ids, responses, response_mask, old_log_probs, advantages``
        (+ ``ref_log_prob`` with ``use_kl_loss``). Returns ``meta_info["metrics"]`` with verl's names.
        """
        self._require(self._is_actor, "update_actor", "actor")
        data = common.to_device(data, self.device)
        cfg = self.config.actor
        temperature = data.meta_info.get("temperature", self.config.rollout.temperature)
        mini_size = common.per_rank_batch_size(cfg.ppo_mini_batch_size, self.world_size, "actor.ppo_mini_batch_size")
        generator = torch.Generator().manual_seed(self.config.seed + self.update_steps)
        metrics = defaultdict(list)
        if POLICY_VERSION in data.non_tensor_batch:  # updates since the policy that sampled the batch
            staleness = self.update_steps - data.non_tensor_batch[POLICY_VERSION].astype(np.int64)
            metrics["async/staleness_mean"].append(float(staleness.mean()))
            metrics["async/staleness_max"].append(float(staleness.max()))
        self.module.train()
        for _ in range(cfg.ppo_epochs):
            for mini in common.mini_batches(data, mini_size, cfg.shuffle, generator):
                self.optimizer.zero_grad()
                micros = mini.split(cfg.ppo_micro_batch_size_per_gpu)
                for i, micro in enumerate(micros):
                    with self._maybe_no_sync(last=i == len(micros) - 1):
                        with self._autocast():
                            loss, stats = self._policy_loss(micro, temperature)
                        (loss * len(micro) / len(mini)).backward()
                    for key, value in stats.items():
                        metrics[key].append(value)
                metrics["actor/grad_norm"].append(self._optimizer_step(cfg.optim.grad_clip))
        self.lr_scheduler.step()
        self.update_steps += 1
        self._sync_rollout_weights()
        metrics["actor/lr"].append(self.lr_scheduler.get_last_lr()[0])
        return DataProto(meta_info={"metrics": {k: float(np.mean(v)) for k, v in metrics.items()}})

    def _policy_loss(self, micro: DataProto, temperature: float) -> tuple[torch.Tensor, dict]:
        cfg = self.config.actor
        batch = micro.batch
        mask = batch["response_mask"].float()
        logits = common.response_logits(self.module, batch, temperature)
        log_prob = common.logprobs_from_logits(logits, batch["responses"])
        is_weights = batch.get("rollout_is_weights", None)  # rollout correction's, when the controller added them
        pg_loss, clipfrac, ppo_kl, clipfrac_lower = self.policy_loss_fn(
            batch["old_log_probs"],
            log_prob,
            batch["advantages"],
            mask,
            loss_agg_mode=cfg.loss_agg_mode,
            config=cfg,
            rollout_is_weights=is_weights,
        )
        entropy = core_algos.compute_entropy_loss(logits, mask, cfg.loss_agg_mode)
        loss = pg_loss - cfg.entropy_coeff * entropy
        stats = {
            "actor/pg_loss": pg_loss.item(),
            "actor/pg_clipfrac": clipfrac.item(),
            "actor/ppo_kl": ppo_kl.item(),
            "actor/pg_clipfrac_lower": clipfrac_lower.item(),
            "actor/entropy": entropy.item(),
        }
        if cfg.use_kl_loss:
            kl = core_algos.kl_penalty(log_prob, batch["ref_log_prob"], cfg.kl_loss_type)
            kl_loss = core_algos.agg_loss(kl, mask, cfg.loss_agg_mode)
            loss = loss + cfg.kl_loss_coef * kl_loss
            stats.update({"actor/kl_loss": kl_loss.item(), "actor/kl_coef": cfg.kl_loss_coef})
        return loss, stats

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_actor_dpo(self, data: DataProto) -> DataProto:
        """One DPO optimizer step (Rafailov et al. 2023) against the reference, for online DPO.

        Rows come in pairs: row 2i is the chosen response and row 2i+1 the rejected one for the same prompt
        (the controller keeps pairs on one worker). Needs ``ref_log_prob``; ``meta_info["dpo_beta"]``.
        """
        self._require(self._is_actor, "update_actor_dpo", "actor")
        data = common.to_device(data, self.device)
        if len(data) % 2:
            raise ValueError(f"update_actor_dpo needs (chosen, rejected) row pairs; got {len(data)} rows")
        beta = float(data.meta_info.get("dpo_beta", 0.1))
        temperature = data.meta_info.get("temperature", self.config.rollout.temperature)
        micro_size = max(2, self.config.actor.ppo_micro_batch_size_per_gpu // 2 * 2)
        self.module.train()
        self.optimizer.zero_grad()
        micros = data.split(micro_size)
        metrics = defaultdict(list)
        for i, micro in enumerate(micros):
            batch = micro.batch
            mask = batch["response_mask"].float()
            with self._maybe_no_sync(last=i == len(micros) - 1):
                with self._autocast():
                    logits = common.response_logits(self.module, batch, temperature)
                seq_logp = (common.logprobs_from_logits(logits, batch["responses"]) * mask).sum(-1)
                ref_logp = (batch["ref_log_prob"] * mask).sum(-1)
                loss, stats = core_algos.compute_dpo_loss(
                    seq_logp[0::2], seq_logp[1::2], ref_logp[0::2], ref_logp[1::2], beta=beta
                )
                (loss * len(micro) / len(data)).backward()
            metrics["actor/dpo_loss"].append(loss.item())
            for key, value in stats.items():
                metrics[key].append(value)
        metrics["actor/grad_norm"].append(self._optimizer_step(self.config.actor.optim.grad_clip))
        self.lr_scheduler.step()
        self.update_steps += 1
        self._sync_rollout_weights()
        metrics["actor/lr"].append(self.lr_scheduler.get_last_lr()[0])
        return DataProto(meta_info={"metrics": {k: float(np.mean(v)) for k, v in metrics.items()}})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def sft_step(self, data: DataProto) -> DataProto:
        """One optimizer step of next-token cross-entropy on ``loss_mask`` tokens (``input_ids [B, T]``,
        ``attention_mask``, ``position_ids``, ``loss_mask``: 1 where the token is a target)."""
        self._require(self._is_actor, "sft_step", "actor")
        data = common.to_device(data, self.device)
        self.module.train()
        self.optimizer.zero_grad()
        micros = data.split(self.config.actor.ppo_micro_batch_size_per_gpu)
        total_tokens = data.batch["loss_mask"][:, 1:].sum().clamp(min=1)
        loss_sum = 0.0
        for i, micro in enumerate(micros):
            batch = micro.batch
            # the positions from the first one that predicts a learned token: a shared prompt prefix (a system prompt,
            # an agent's tool descriptions) before them is computed once (common.logits_sharing_prefix)
            learned_from = batch["loss_mask"][:, 1:].any(0).nonzero()
            keep = batch["input_ids"].shape[1] - (int(learned_from[0]) if len(learned_from) else 0)
            shared = common.prefix_to_compute_once(self.module, batch, keep)
            with self._maybe_no_sync(last=i == len(micros) - 1):
                with self._autocast():
                    if shared:
                        logits = common.logits_sharing_prefix(self.module, batch, shared, keep)[:, :-1]
                    else:
                        keep = batch["input_ids"].shape[1]  # every position, as without a shared prefix
                        logits = self.module(
                            input_ids=batch["input_ids"],
                            attention_mask=batch["attention_mask"],
                            position_ids=batch["position_ids"],
                            use_cache=False,
                        ).logits[:, :-1]
                targets, learned = batch["input_ids"][:, 1 - keep :], batch["loss_mask"][:, 1 - keep :]
                nll = -common.logprobs_from_logits(logits, targets)
                loss = (nll * learned).sum() / total_tokens
                loss.backward()
            loss_sum += loss.item()
        grad_norm = self._optimizer_step(self.config.actor.optim.grad_clip)
        self.lr_scheduler.step()
        self._sync_rollout_weights()
        metrics = {"sft/loss": loss_sum, "sft/grad_norm": grad_norm, "sft/lr": self.lr_scheduler.get_last_lr()[0]}
        return DataProto(meta_info={"metrics": metrics})

    def _sync_rollout_weights(self) -> None:
        if self._is_rollout:
            self.rollout.sync_weights(self.model)

    def _maybe_no_sync(self, last: bool):
        if isinstance(self.module, torch.nn.parallel.DistributedDataParallel) and not last:
            return self.module.no_sync()
        return contextlib.nullcontext()

    def _optimizer_step(self, grad_clip: float) -> float:
        grad_norm = common.clip_grad_norm(self.model.parameters(), grad_clip)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            logger.warning("rank %d: grad norm is %s; skipping this optimizer step", self.rank, grad_norm.item())
        self.optimizer.zero_grad()
        return float(grad_norm)

    # ------------------------------------------------------------------------------------------------ state
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_model(self, path: str, merged: bool = False) -> None:
        """The policy (or, on a reference-only worker, the reference) and its tokenizer as an HF folder, from rank
        0: what is published and registered, nothing else. With LoRA: the adapter folder (``lora.save_adapter``:
        the adapter, the tokenizer, and its pinned base), or with ``merged`` the adapter merged into the base."""
        model = self._primary_model()
        if fsdp.is_sharded(model):  # every rank sends its shards; rank 0 writes
            weights = fsdp.full_state_dict(model)
            if self.rank == 0:
                common.save_model(model, self.tokenizer, path, state_dict=weights)
            return
        if self.rank != 0:
            return
        if not self.lora or model is self.ref_model:
            common.save_model(model, self.tokenizer, path)
        elif merged:
            lora.save_merged(model, self.tokenizer, path)
        else:
            base = {"path": self.base_path, "sha256": lora.weights_fingerprint(self.base_path)}
            name = named_model(self.base_path)
            if name:
                base["name"] = name
            lora.save_adapter(model, self.tokenizer, path, base)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """The model folder (``save_model``), or with fsdp2 every rank's shard of the model and optimizer state
        (``fsdp.save_sharded``, no gather), plus each rank's scheduler and RNG state. DDP's optimizer state is the
        same on every rank (the gradients are all-reduced), so rank 0 alone writes it, not one copy a worker."""
        if fsdp.is_sharded(self._primary_model()):
            fsdp.save_sharded(
                f"{path}/{fsdp.SHARDS}", self._primary_model(), self.optimizer if self._is_actor else None
            )
        else:
            self.save_model(path)
        if self._is_actor:
            common.save_torch(
                {
                    **({"optimizer": self.optimizer.state_dict()} if not self.sharded and self.rank == 0 else {}),
                    "lr_scheduler": self.lr_scheduler.state_dict(),
                    "update_steps": self.update_steps,
                    "rng": common.rng_state_to_tensors(common.rng_state()),
                },
                f"{path}/actor_state_rank_{self.rank}.pt",
            )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str, load_optimizer: bool = True) -> None:
        """Load weights from an HF-format folder (with LoRA: an adapter folder) into the policy (the reference on a
        reference-only worker; a colocated reference stays the start model) and, for the actor, this rank's
        optimizer/scheduler/RNG."""
        model = self._primary_model()
        sharded = fsdp.is_sharded(model)
        if sharded:  # each rank reads its shard, resharded when the checkpoint was saved by another number of workers
            fsdp.load_sharded(
                f"{path}/{fsdp.SHARDS}", model, self.optimizer if self._is_actor and load_optimizer else None
            )
        elif self.lora and model is not self.ref_model:
            lora.load_adapter_weights(model, path)
        else:
            missing, unexpected = model.load_state_dict(common.load_weights(path), strict=False)
            real_missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied embeddings
            if real_missing or unexpected:
                raise ValueError(
                    f"{path}: checkpoint does not match the model (missing {real_missing[:5]}, unexpected "
                    f"{unexpected[:5]})"
                )
        self._sync_rollout_weights()
        if self._is_actor and load_optimizer:
            own = f"{path}/actor_state_rank_{self.rank}.pt"
            if sharded and not common.exists(own):  # saved by fewer workers: the schedule is the same on every rank
                saved = common.load_torch(f"{path}/actor_state_rank_0.pt")
                logger.warning("rank %d: %s has no RNG state of this rank; it keeps its own", self.rank, path)
                saved.pop("rng")
            else:
                saved = common.load_torch(own)
            if not sharded:  # rank 0's (checkpoints of before 2026-11-27 have a copy in every rank's file)
                optimizer = saved.get("optimizer") or common.load_torch(f"{path}/actor_state_rank_0.pt")["optimizer"]
                self.optimizer.load_state_dict(optimizer)
            self.lr_scheduler.load_state_dict(saved["lr_scheduler"])
            self.update_steps = saved["update_steps"]
            if "rng" in saved:
                common.set_rng_state(common.rng_state_from_tensors(saved["rng"]))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_policy_version(self) -> int:
        """The version of the policy this worker trains or samples with: its number of updates (a rollout worker
        of a pool of its own: that of the weights it was last sent)."""
        self._require(self._is_actor or self._is_rollout, "get_policy_version", "actor or rollout")
        return self.update_steps

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_policy_weights(self) -> dict | None:
        """The policy's weights on the CPU and their version (its number of updates), from rank 0 (None on the
        others; a sharded policy is gathered, every rank takes part): what a rollout pool of its own loads
        (``set_policy_weights``). With LoRA, the adapter's weights alone (``adapter``): the base never changes."""
        self._require(self._is_actor, "get_policy_weights", "actor")
        sharded = fsdp.is_sharded(self.model)
        adapter = self.lora and not sharded
        if sharded:
            weights = fsdp.full_state_dict(self.model)
        elif self.rank == 0:
            state = lora.adapter_weights(self.model) if adapter else self.model.state_dict()
            weights = {name: tensor.detach().to("cpu") for name, tensor in state.items()}
        return {"weights": weights, "adapter": adapter, "version": self.update_steps} if self.rank == 0 else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_policy_weights(self, policy: dict) -> None:
        """A rollout worker of a pool of its own: sample with the actor's weights of ``policy``
        (``get_policy_weights``) from now on, its responses stamped with their version."""
        self._require(self._is_rollout and not self._is_actor, "set_policy_weights", "rollout (without actor)")
        if policy.get("adapter"):
            lora.set_adapter_weights(self.model, policy["weights"], "the actor's adapter")
        else:
            missing, unexpected = self.model.load_state_dict(policy["weights"], strict=False)
            missing = [name for name in missing if not name.endswith("lm_head.weight")]  # tied embeddings
            if missing or unexpected:
                raise ValueError(
                    f"the actor's weights do not match the rollout's model ({missing[:5]}, {unexpected[:5]})"
                )
        self.update_steps = policy["version"]  # the updates these weights have had
        self._sync_rollout_weights()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_weights_checksum(self) -> float:
        """Sum of all weights in float64: equal across ranks when data-parallel replicas are in sync (sharded: the
        whole model's, gathered)."""
        model = self._primary_model()
        if fsdp.is_sharded(model):
            names = {name for name, _ in model.named_parameters()}
            return float(sum(t.double().sum() for name, t in fsdp.full_weights(model) if name in names))
        return float(sum(p.detach().double().sum() for p in model.parameters()))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_parameter_counts(self) -> dict:
        """``{"total", "trainable"}`` parameters of the policy: with LoRA only the adapter's train."""
        model = self._primary_model()
        return {
            "total": sum(p.numel() for p in model.parameters()),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_precision(self) -> dict:
        """What this worker computes in and why (``common.precision_report``): ``model.autocast=auto`` is resolved
        on the worker's own device, which may not be the controller's."""
        return common.precision_report(self.config.model, self.device)

    def _primary_model(self) -> torch.nn.Module:
        """What is saved, loaded and checked: the policy, or the reference on a reference-only worker."""
        return self.model if (self._is_actor or self._is_rollout) else self.ref_model

    def _require(self, present: bool, method: str, role: str) -> None:
        if not present:
            raise RuntimeError(f"{method} needs the {role!r} role; this worker was started with role={self.role!r}")
