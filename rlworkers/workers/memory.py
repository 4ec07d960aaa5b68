"""What the workers of a run hold in memory before any activation: the least a run needs, estimated before any worker
starts, so a model that cannot fit fails with the reason and the fix instead of an out-of-memory kill mid-step.

Per trainable model, in bytes a parameter: the weights (4 in float32, 2 in bf16/fp16), their gradients (the same,
trainable parameters only) and AdamW's two moments (8, float32); a colocated reference adds its weights. DDP holds all
of it on every worker; FSDP2 a 1/n shard of each, plus, while HF generates on the gathered policy
(``fsdp_config.gather_for_generation``), the whole policy in its compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAM_BYTES = 8  # exp_avg and exp_avg_sq in float32


def parameter_count(model_dir: str, trust_remote_code: bool = False) -> int:
    """Parameters of the model at ``model_dir`` (tied ones once), built on the meta device: no weights read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class TrainedModel:
    """One data-parallel group's model: ``parameters`` in all, ``trainable`` of them, weights in ``dtype``."""

    parameters: int
    trainable: int
    dtype: str
    strategy: str  # ddp | fsdp2
    workers: int
    reference: bool = False  # a frozen copy in the same worker (the actor's colocated reference)
    gathered_bytes: int = 0  # a whole copy held while generating (fsdp2's gathered policy), bytes a parameter

    def bytes_per_worker(self) -> int:
        weight = DTYPE_BYTES[self.dtype]
        state = self.parameters * weight + self.trainable * (weight + ADAM_BYTES)
        if self.reference:
            state += self.parameters * weight
        if self.strategy == "fsdp2":
            return state // self.workers + self.parameters * self.gathered_bytes
        return state


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"
