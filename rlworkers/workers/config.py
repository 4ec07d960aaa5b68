"""Worker configuration: small frozen pydantic models, validated before any worker starts.

Field names follow verl's ``ppo_trainer.yaml`` where they overlap (``ppo_mini_batch_size``,
``ppo_micro_batch_size_per_gpu``, ``clip_ratio_low``, ``loss_agg_mode``, ``use_kl_loss`` ...), so a verl user
recognises them. Batch sizes count sequences (prompts x samples) across the whole data-parallel group.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlworkers.algorithms.kl import KL_ESTIMATORS
from rlworkers.algorithms.losses import LOSS_AGG_MODES

LossAggMode = Literal[LOSS_AGG_MODES]
KLEstimator = Literal[KL_ESTIMATORS]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelConfig(_Frozen):
    path: str = Field("tiny", description="HF model path or hub name; 'tiny' creates the offline tiny Llama")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    autocast: Literal["auto", "bfloat16", "float16"] | None = Field(
        None,
        description="mixed precision: forward passes (HF generation, log-probs, the update) under torch.autocast in "
        "this dtype, weights and optimizer state in float32 (model.dtype). 'auto': bfloat16 where the device computes "
        "it natively (CUDA with bf16, a CPU with AMX or AVX512-BF16), none elsewhere (bf16 emulated on an AVX2 CPU "
        "is many times slower than float32). null / none: float32 compute",
    )
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False

    @field_validator("autocast", mode="before")
    @classmethod
    def _none_spelled_out(cls, value):
        """``model.autocast=none`` (or null, off, false) on a command line turns a preset's autocast off."""
        if value is False or (isinstance(value, str) and value.strip().lower() in ("none", "null", "off", "false", "")):
            return None  # YAML reads `off` and `false` as False
        return value

    @model_validator(mode="after")
    def _check_autocast(self):
        if self.autocast and self.dtype != "float32":
            raise ValueError(
                f"model.autocast={self.autocast} computes in {self.autocast} over float32 weights; model.dtype is "
                f"{self.dtype}. Fix: set model.dtype=float32 (mixed precision), or drop model.autocast"
            )
        return self


class OptimConfig(_Frozen):
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0)
    lr_scheduler: Literal["constant", "cosine", "linear"] = "constant"
    lr_warmup_steps: int = Field(0, ge=0)
    total_training_steps: int | None = Field(
        None, gt=0, description="scheduler horizon in update calls; unset = the run's trainer.total_steps"
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    low_precision_weights: bool = Field(
        False,
        description="train weights held in model.dtype bfloat16/float16 directly, with no float32 master copy: "
        "AdamW steps smaller than the dtype's resolution (bf16: ~1/256 of a weight) are lost, so small learning "
        "rates barely move the model. Off: such a config is refused; use model.dtype=float32 model.autocast=bfloat16",
    )


class MultiTurnConfig(_Frozen):
    """Multi-turn rollouts with tools and an environment (``rollout.agent_loop``); verl's ``rollout.multi_turn``
    names where they overlap. ``rollout.response_length`` is then the budget of a whole trajectory after the prompt
    (the model's turns and the tool results / observations between them), as in verl."""

    enable: bool = False
    tools: list[str] = Field(
        default_factory=list, description="typed Python functions as tools: 'file.py:function' or 'module:function'"
    )
    tool_config_path: str | None = Field(None, description="verl's tool config YAML (tools: [{class_name, ...}])")
    environment: str | None = Field(
        None, description="an environment class ('file.py:Class' or 'module:Class'): reset(row), step(message)"
    )
    max_assistant_turns: int = Field(4, gt=0, description="model turns per trajectory")
    max_user_turns: int | None = Field(None, gt=0, description="environment observations per trajectory")
    max_turn_tokens: int | None = Field(
        None, gt=0, description="new tokens of one model turn (unset: what is left of rollout.response_length)"
    )
    max_parallel_calls: int = Field(1, gt=0, description="tool calls of one turn that run (later ones are dropped)")
    max_tool_response_length: int = Field(256, gt=0, description="characters of a tool result the model sees")
    tool_response_truncate_side: Literal["left", "middle", "right"] = "middle"
    tool_timeout_s: float = Field(10.0, gt=0, description="time limit of one tool call")
    format: Literal["hermes"] = Field("hermes", description="tool-call format: <tool_call>{json}</tool_call>")

    @model_validator(mode="after")
    def _check_something_to_do(self):
        if self.enable and not (self.tools or self.tool_config_path or self.environment):
            raise ValueError(
                "rollout.multi_turn.enable=true needs rollout.multi_turn.tools, .tool_config_path or .environment"
            )
        return self


class RolloutConfig(_Frozen):
    name: Literal["hf", "vllm"] = "hf"
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    response_length: int = Field(8, gt=0, description="max new tokens")
    n: int = Field(1, gt=0, description="samples per prompt (rows come back interleaved: a a b b)")
    do_sample: bool = True
    log_prob_micro_batch_size_per_gpu: int = Field(64, gt=0)
    n_workers: int = Field(
        0,
        ge=0,
        description="processes of a rollout pool of its own (verl's one-step-off rollout.n_gpus_per_node x nnodes), "
        "which gets the actor's weights after each update; 0: the rollout runs in the actor's processes",
    )
    # vLLM only (rollout.name: vllm); see rlworkers/workers/rollout/vllm_rollout.py
    stop: list[str] | None = Field(None, description="strings that end a response (vLLM only; the response keeps them)")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="share of GPU memory vLLM may take")
    enforce_eager: bool | None = Field(None, description="no CUDA graphs; default True on CPU, False on CUDA")
    free_cache_engine: bool = Field(True, description="CUDA: sleep the engine while the actor trains")
    max_model_len: int | None = Field(None, gt=0, description="default: prompt width + response_length, >= 1024")
    multi_turn: MultiTurnConfig = MultiTurnConfig()

    @model_validator(mode="after")
    def _check_backend_options(self):
        if self.stop and self.name != "vllm":
            raise ValueError("rollout.stop is supported by the vllm backend only; set rollout.name=vllm or remove it")
        return self


class LoraConfig(_Frozen):
    """A LoRA adapter on the frozen base model (peft; verl's ``lora_rank`` / ``lora_alpha`` / ``target_modules``)."""

    rank: int = Field(0, ge=0, description="adapter rank; 0 trains the full model (no adapter)")
    alpha: float = Field(16.0, gt=0, description="scale of the adapter's update: alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="module names to adapt (e.g. [q_proj, v_proj]); all-linear = every linear but lm_head"
    )
    publish_merged: bool = Field(
        False, description="also save (and log to MLflow) the final adapter merged into the base, as a full model"
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @model_validator(mode="after")
    def _check(self):
        if isinstance(self.target_modules, list) and not self.target_modules:
            raise ValueError("actor.lora.target_modules is empty: name the modules to adapt, or use 'all-linear'")
        if self.publish_merged and not self.enabled:
            raise ValueError("actor.lora.publish_merged needs an adapter: set actor.lora.rank > 0 (or drop it)")
        return self


Strategy = Literal["ddp", "fsdp2"]


class FSDPConfig(_Frozen):
    """FSDP2 settings (``strategy: fsdp2``; verl's ``fsdp_config`` names). Mixed precision comes from
    ``model.autocast``: the gathered parameters are cast to it for compute, gradients are reduced in float32, the
    sharded master weights and AdamW's state stay float32 (``torch.distributed.fsdp.MixedPrecisionPolicy``)."""

    reshard_after_forward: bool = Field(
        True, description="free each layer's gathered parameters after its forward (less memory, one more all-gather)"
    )
    offload_policy: bool = Field(
        False,
        description="FSDP2's CPUOffloadPolicy: sharded parameters, gradients and optimizer state in CPU memory, the "
        "optimizer step on the CPU (a GPU run's memory for speed; nothing changes on a CPU-only run)",
    )
    gather_for_generation: bool = Field(
        True,
        description="HF generation on the whole policy gathered once per call (fast: no collective per token; the "
        "model in its compute dtype is whole on every worker meanwhile); false: each layer gathered for each token, "
        "the ranks in lockstep (HF's synced_gpus), for a model whose whole copy does not fit (single-turn only)",
    )
    wrap_policy: list[str] | None = Field(
        None,
        description="module class names sharded as units (verl's transformer_layer_cls_to_wrap); default: the "
        "model's own _no_split_modules (its decoder layer), each layer one unit",
    )


class ActorConfig(_Frozen):
    ppo_mini_batch_size: int = Field(16, gt=0, description="sequences per optimizer step, whole group")
    ppo_micro_batch_size_per_gpu: int = Field(8, gt=0, description="sequences per forward/backward on a worker")
    ppo_epochs: int = Field(1, gt=0)
    shuffle: bool = True
    clip_ratio: float = Field(0.2, gt=0)
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = Field(3.0, gt=1)
    loss_agg_mode: LossAggMode = "token-mean"
    policy_loss: Literal["vanilla", "gspo"] = "vanilla"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.001, ge=0)
    kl_loss_type: KLEstimator = "low_var_kl"
    optim: OptimConfig = OptimConfig()
    lora: LoraConfig = LoraConfig()
    strategy: Strategy = Field(
        "ddp",
        description="ddp: every worker holds the whole model (and the reference); fsdp2: parameters, gradients and "
        "optimizer state sharded over the workers (torch's fully_shard), for models one worker cannot hold",
    )
    fsdp_config: FSDPConfig = FSDPConfig()

    @model_validator(mode="after")
    def _check_strategy(self):
        if self.strategy == "fsdp2" and self.lora.enabled:
            raise ValueError(
                "actor.strategy=fsdp2 with actor.lora is not supported yet: a LoRA adapter is small enough for ddp "
                "(actor.strategy=ddp), or train the whole model with fsdp2 (actor.lora.rank=0)"
            )
        return self


class CriticConfig(_Frozen):
    model: ModelConfig | None = Field(None, description="defaults to the actor's model")
    ppo_mini_batch_size: int = Field(16, gt=0)
    ppo_micro_batch_size_per_gpu: int = Field(8, gt=0)
    ppo_epochs: int = Field(1, gt=0)
    cliprange_value: float = Field(0.5, gt=0)
    loss_agg_mode: LossAggMode = "token-mean"
    optim: OptimConfig = OptimConfig(lr=1e-4)
    strategy: Strategy = Field("ddp", description="as actor.strategy, for the value model")
    fsdp_config: FSDPConfig = FSDPConfig()


class RewardConfig(_Frozen):
    reward_fn: str = Field("auto", description="registered name, 'file.py:fn' or 'package.module:fn'")
    reward_model: ModelConfig | None = Field(None, description="a sequence-classification model instead of rules")
    num_workers: int | None = Field(
        None,
        ge=0,
        description="reward worker processes; 0 scores a rule in the compute_reward stage itself, where the batch "
        "already is (default for rules); a reward model needs >= 1 (default 1)",
    )

    @model_validator(mode="after")
    def _check_workers(self):
        if self.reward_model is not None and self.num_workers == 0:
            raise ValueError(
                "reward.num_workers=0 scores rule functions in the stage itself; a reward model runs in reward "
                "workers: set reward.num_workers >= 1 (or leave it unset)"
            )
        return self

    @property
    def worker_count(self) -> int:
        """Reward worker processes to start: ``num_workers``, else 1 for a reward model and 0 for a rule."""
        if self.num_workers is not None:
            return self.num_workers
        return 1 if self.reward_model is not None else 0


class WorkerConfig(_Frozen):
    """Everything ActorRolloutRefWorker needs."""

    model: ModelConfig = ModelConfig()
    actor: ActorConfig = ActorConfig()
    rollout: RolloutConfig = RolloutConfig()
    ref_micro_batch_size_per_gpu: int = Field(64, gt=0)
    device: Literal["cpu", "cuda"] = "cpu"
    backend: Literal["gloo", "nccl"] | None = Field(None, description="defaults to gloo on cpu, nccl on cuda")
    collective_timeout_s: float = Field(600.0, gt=0, description="torch.distributed timeout of the workers' world")
    seed: int = 0

    @model_validator(mode="after")
    def _check_device(self):
        if self.backend == "nccl" and self.device != "cuda":
            raise ValueError("backend 'nccl' needs device 'cuda'; use backend 'gloo' (or leave it unset) on CPU")
        if self.actor.ppo_micro_batch_size_per_gpu > self.actor.ppo_mini_batch_size:
            raise ValueError(
                f"actor.ppo_micro_batch_size_per_gpu ({self.actor.ppo_micro_batch_size_per_gpu}) is larger than "
                f"actor.ppo_mini_batch_size ({self.actor.ppo_mini_batch_size}); lower it"
            )
        if self.lockstep_generation and self.rollout.multi_turn.enable:
            raise ValueError(
                "actor.fsdp_config.gather_for_generation=false generates with the ranks in lockstep, which a "
                "multi-turn rollout cannot keep (each rank's trajectories take their own number of turns): set it "
                "true, or use rollout.name=vllm"
            )
        return self

    @property
    def lockstep_generation(self) -> bool:
        """HF generation on a sharded policy, a layer gathered at a time: every rank runs the same forward passes."""
        return (
            self.actor.strategy == "fsdp2"
            and not self.actor.fsdp_config.gather_for_generation
            and self.rollout.name == "hf"
        )
