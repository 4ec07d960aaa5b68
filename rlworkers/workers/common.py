"""Pieces every model-holding worker uses: per-token log-probs, optimizer + LR schedule, data-parallel wrapping,
micro-batching and checkpoint files (safetensors for weights, ``torch.load(weights_only=True)`` for the rest)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import random

import fsspec
import numpy as np
import torch
import torch.nn.functional as F
from tensordict import TensorDict

from rlworkers.algorithms.utils import entropy_from_logits
from rlworkers.models.loading import torch_dtype
from rlworkers.protocol import DataProto
from rlworkers.storage import staged_dir
from rlworkers.workers.config import ModelConfig, OptimConfig


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[label]`` per position. ``[B, T, V], [B, T] -> [B, T]``."""
    return torch.gather(F.log_softmax(logits.float(), dim=-1), -1, labels.unsqueeze(-1)).squeeze(-1)


def takes_logits_to_keep(model) -> bool:
    """Whether ``model``'s forward (under its DDP or PEFT wrapper) takes ``logits_to_keep``."""
    model = unwrap(model)
    if hasattr(model, "get_base_model"):  # a PEFT model passes the keyword on to its base model
        model = model.get_base_model()
    return _forward_takes_logits_to_keep(type(model))


@functools.cache
def _forward_takes_logits_to_keep(cls) -> bool:
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


# Fewer shared prompt tokens than this are computed in every row: sharing them would save too little.
MIN_SHARED_PREFIX = 16


def response_logits(model, batch: TensorDict, temperature: float = 1.0) -> torch.Tensor:
    """Logits that predict each response token of ``batch`` (``input_ids``, ``attention_mask``, ``position_ids``
    ``[B, P+R]`` and ``responses`` ``[B, R]``): ``[B, R, V]``, divided by the sampling temperature.

    Where every row's prompt starts with the same tokens (a system prompt, an agent's tool descriptions), they are
    computed once (``logits_sharing_prefix``): the same values to rounding, the gradient of the shared tokens the
    sum of every row's."""
    keep = batch["responses"].shape[-1] + 1
    shared = prefix_to_compute_once(model, batch, keep)
    if shared:
        return logits_sharing_prefix(model, batch, shared, keep)[:, :-1, :] / temperature
    # A model that takes transformers' ``logits_to_keep`` applies its output layer to those positions alone: the same
    # values, and with a vocabulary of ~50k that layer is about a fifth of a small model's forward and backward.
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        use_cache=False,
        **({"logits_to_keep": keep} if takes_logits_to_keep(model) else {}),
    ).logits
    return logits[:, -keep:-1, :] / temperature


def prefix_to_compute_once(model, batch: TensorDict, keep: int) -> int:
    """How many prompt tokens every row of ``batch`` starts with and ``model`` should compute once, for the logits
    of the last ``keep`` positions (``logits_sharing_prefix``); 0: compute the rows as they are."""
    input_ids = batch["input_ids"]
    shared = shared_prompt_prefix(input_ids, batch["attention_mask"], input_ids.shape[1] - keep + 1)
    return shared if shared >= MIN_SHARED_PREFIX and _sharing_pays(model, input_ids.shape, shared) else 0


def shared_prompt_prefix(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int) -> int:
    """How many tokens every row's prompt (its first ``prompt_length`` columns) starts with after its left padding,
    leaving each row at least one prompt token of its own (whose logits predict its first response token); 0 for a
    single row or prompts that are not left-padded."""
    rows = input_ids.shape[0]
    if rows < 2:
        return 0
    pads = _left_pads(attention_mask)
    real = attention_mask[:, :prompt_length].sum(1)
    if not bool((pads + real == prompt_length).all()):  # padding inside a prompt: not this layout
        return 0
    longest = int(real.min()) - 1
    if longest < 1:
        return 0
    offsets = pads.unsqueeze(1) + torch.arange(longest, device=input_ids.device)
    starts = input_ids.gather(1, offsets)
    differs = (starts != starts[:1]).any(0).nonzero()
    return int(differs[0]) if len(differs) else longest


def _sharing_pays(model, shape: torch.Size, shared: int) -> bool:
    """Whether one sequence of the prefix and every row's rest costs less than the rows: it has fewer tokens, but
    its attention spans all of it. A token's layers cost about 6 x hidden size query-key pairs of attention. Only
    under PyTorch's SDPA attention, which takes the boolean mask the sequence needs."""
    config = getattr(unwrap(model), "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not getattr(config, "hidden_size", None):
        return False
    rows, length = shape
    packed = shared + rows * (length - shared)
    per_token = 6 * config.hidden_size
    return packed * per_token + packed**2 < 0.9 * (rows * length * per_token + rows * length**2)


def logits_sharing_prefix(model, batch: TensorDict, shared: int, keep: int) -> torch.Tensor:
    """The logits of every row's last ``keep`` positions (``[B, keep, V]``) from one sequence: the ``shared``
    prompt tokens once, then each row without them, each row's tokens attending to the prefix and to their own
    row's earlier tokens alone, at the positions they have in the row. One forward and one backward, as any batch:
    DDP, FSDP2 and gradient checkpointing see nothing else."""
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    rows, length = input_ids.shape
    width, device = length - shared, input_ids.device
    pads = _left_pads(attention_mask)
    columns = columns_after_prefix(attention_mask, shared)
    rest = attention_mask.gather(1, columns).bool()
    sequence = torch.cat([input_ids[0, pads[0] : pads[0] + shared], input_ids.gather(1, columns).flatten()])
    positions = torch.cat([torch.arange(shared, device=device), batch["position_ids"].gather(1, columns).flatten()])
    size = shared + rows * width
    allowed = torch.zeros(size, size, dtype=torch.bool, device=device)
    allowed[:shared, :shared] = torch.ones(shared, shared, dtype=torch.bool, device=device).tril()
    own = torch.ones(width, width, dtype=torch.bool, device=device).tril() & rest.unsqueeze(1) & rest.unsqueeze(2)
    own |= torch.eye(width, dtype=torch.bool, device=device)  # a padding token attends to itself: never to nothing
    for row in range(rows):
        start = shared + row * width
        allowed[start : start + width, start : start + width] = own[row]
        allowed[start : start + width, :shared] = rest[row].unsqueeze(1)
    wanted = (
        shared
        + torch.arange(rows, device=device).unsqueeze(1) * width
        + torch.arange(width - keep, width, device=device)
    )
    wanted = wanted.flatten()
    takes = takes_logits_to_keep(model)
    logits = model(
        input_ids=sequence.unsqueeze(0),
        attention_mask=allowed[None, None],
        position_ids=positions.unsqueeze(0),
        use_cache=False,
        **({"logits_to_keep": wanted} if takes else {}),
    ).logits
    return (logits[0] if takes else logits[0, wanted]).view(rows, keep, -1)


def columns_after_prefix(attention_mask: torch.Tensor, shared: int) -> torch.Tensor:
    """Each row's columns but its copy of the ``shared`` prefix: its left padding, then its rest. ``[B, T - shared]``"""
    rows, length = attention_mask.shape
    columns = torch.arange(length - shared, device=attention_mask.device).unsqueeze(0).expand(rows, -1)
    return columns + shared * (columns >= _left_pads(attention_mask).unsqueeze(1))


def _left_pads(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask == 0).long().cumprod(1).sum(1)


@torch.no_grad()
def response_log_probs(
    model, data: DataProto, temperature: float, micro_batch_size: int, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of ``data.batch["responses"]`` under ``model``, in micro-batches, without grad.
    ``[B, R]``."""
    log_probs, entropies = [], []
    was_training = model.training
    model.eval()  # no dropout (a LoRA adapter's, or the model's own) in what the update compares against
    for micro in data.split(micro_batch_size):
        logits = response_logits(model, micro.batch, temperature)
        log_probs.append(logprobs_from_logits(logits, micro.batch["responses"]))
        if with_entropy:
            entropies.append(entropy_from_logits(logits))
    model.train(was_training)
    return torch.cat(log_probs), (torch.cat(entropies) if with_entropy else None)


def mini_batches(data: DataProto, mini_batch_size: int, shuffle: bool, generator: torch.Generator) -> list[DataProto]:
    """Consecutive mini-batches of a (per-epoch shuffled) batch."""
    if shuffle:
        data = data.select_idxs(torch.randperm(len(data), generator=generator))
    return data.split(mini_batch_size)


def to_device(data: DataProto, device: str) -> DataProto:
    """``data`` with its tensors on ``device`` (batches arrive from the controller on CPU); the caller's object is
    left as it is. Worker methods return their results on CPU: they travel back through Ray."""
    if data.batch is None or device == "cpu":
        return data
    return DataProto(batch=data.batch.to(device), non_tensor_batch=data.non_tensor_batch, meta_info=data.meta_info)


def per_rank_batch_size(total: int, world_size: int, what: str) -> int:
    if total % world_size:
        raise ValueError(f"{what} ({total}) must be divisible by the number of workers ({world_size})")
    return total // world_size


# bf16 emulated on a CPU without native support, against float32: SmolLM2-135M-Instruct forward+backward on an
# AVX2-only AMD EPYC (docs/performance.md, "Precision for the hardware"; bench/precision.py measures it on any CPU)
EMULATED_BF16_SLOWDOWN = "about 13x slower than float32"


@functools.cache
def native_bf16(device: str) -> tuple[bool, str]:
    """Whether ``device`` computes bfloat16 natively, and what says so (for the log and the run's params)."""
    kind = torch.device(device).type
    if kind == "cuda":
        if not torch.cuda.is_available():
            return False, "CUDA is not available in this process"
        name = torch.cuda.get_device_name()
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"{name} computes bf16"
        return False, f"{name} has no native bf16"
    if kind == "cpu":
        features = cpu_bf16_features()
        capability = torch.backends.cpu.get_cpu_capability()
        if features:
            return True, f"the CPU has {' and '.join(features)} ({capability})"
        return False, f"the CPU has no AMX or AVX512-BF16 (torch reports {capability})"
    return False, f"device type {kind!r}: native bf16 unknown"


def cpu_bf16_features() -> list[str]:
    """This CPU's instructions that compute bf16 natively: AMX, AVX512-BF16 (empty on AVX2-only CPUs)."""
    found = []
    for name, probe, flag in (
        ("AMX", "_is_amx_tile_supported", "amx_bf16"),
        ("AVX512-BF16", "_is_avx512_bf16_supported", "avx512_bf16"),
    ):
        check = getattr(torch.cpu, probe, None)  # torch's own probes (private; /proc/cpuinfo where they are gone)
        if check is not None:
            present = bool(check())
        else:
            try:
                with open("/proc/cpuinfo") as f:
                    present = flag in f.read().split()
            except OSError:
                present = False
        if present:
            found.append(name)
    return found


def resolve_autocast(model: ModelConfig, device: str) -> str | None:
    """The dtype ``model.autocast`` computes in on ``device``: 'auto' is bfloat16 where bf16 is native, else None."""
    if model.autocast != "auto":
        return model.autocast
    return "bfloat16" if native_bf16(device)[0] else None


def precision_report(model: ModelConfig, device: str) -> dict:
    """What a worker computes in and why: ``autocast`` (a dtype name or "none"), ``reason``, and ``slow`` when bf16
    is forced on a device that only emulates it."""
    resolved = resolve_autocast(model, device)
    native, why = native_bf16(device) if resolved == "bfloat16" or model.autocast == "auto" else (True, "")
    if model.autocast == "auto":
        reason = f"model.autocast=auto: {'bfloat16' if resolved else 'float32'} compute, {why}"
    elif resolved is None:
        reason = "model.autocast is unset: float32 compute"
    else:
        reason = f"model.autocast={resolved}" + (f" ({why})" if why else "")
    slow = resolved == "bfloat16" and not native and torch.device(device).type == "cpu"
    return {"autocast": resolved or "none", "reason": reason, "slow": slow}


def autocast(model: ModelConfig, device: str):
    """``model.autocast``: forward passes in bf16/fp16 over the float32 weights (mixed precision), else nothing."""
    dtype = resolve_autocast(model, device)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch_dtype(dtype))


# ---------------------------------------------------------------------------------------------- optimisation
def build_optimizer(parameters, config: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameters, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig):
    """Linear warm-up, then constant, cosine or linear decay to ``min_lr_ratio * lr`` over the horizon
    (``total_training_steps`` update calls; a run sets it to its steps unless the config does)."""
    if config.lr_scheduler != "constant" and config.total_training_steps is None:
        raise ValueError(
            f"lr_scheduler={config.lr_scheduler} decays over optim.total_training_steps, which is unset: set it "
            "(a training run sets it to trainer.total_steps)"
        )

    def factor(step: int) -> float:
        if step < config.lr_warmup_steps:
            return (step + 1) / config.lr_warmup_steps
        if config.lr_scheduler == "constant":
            return 1.0
        decay_steps = max(1, config.total_training_steps - config.lr_warmup_steps)
        progress = min(1.0, (step - config.lr_warmup_steps) / decay_steps)
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if config.lr_scheduler == "cosine" else 1 - progress
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * decay

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def wrap_data_parallel(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """DDP over the default process group when there is more than one worker (gloo on CPU, nccl on CUDA).

    ``strategy: ddp``, the default: for models one worker holds, DDP keeps replicas identical with one all-reduce per
    step and no gathers. ``fsdp2`` (``rlworkers.workers.fsdp``) is for models that do not fit (see the README).
    """
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return model
    device_ids = [torch.cuda.current_device()] if device == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` that also takes sharded (DTensor) gradients: their norm is the whole model's, the same on
    every rank."""
    from torch.distributed.tensor import DTensor

    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach=True)
    return total


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


# ---------------------------------------------------------------------------------------------- randomness
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_state_to_tensors(state: dict) -> dict:
    """RNG state as tensors and plain lists, so it loads with ``weights_only=True``."""
    version, python_state, gauss = state["python"]
    kind, keys, pos, has_gauss, cached = state["numpy"]
    return {
        "python": [version, list(python_state), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": state["torch"],
        "cuda": list(state["cuda"]),
    }


def rng_state_from_tensors(saved: dict) -> dict:
    version, python_state, gauss = saved["python"]
    kind, keys, pos, has_gauss, cached = saved["numpy"]
    return {
        "python": (version, tuple(python_state), gauss),
        "numpy": (kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached),
        "torch": saved["torch"],
        "cuda": saved["cuda"],
    }


# ---------------------------------------------------------------------------------------------- files
def save_torch(obj, path: str) -> None:
    with fsspec.open(path, "wb") as f:
        torch.save(obj, f)


def exists(path: str) -> bool:
    fs, local = fsspec.core.url_to_fs(path)
    return fs.exists(local)


def load_torch(path: str):
    """Load optimizer/scheduler/RNG state without unpickling arbitrary objects."""
    with fsspec.open(path, "rb") as f:
        return torch.load(f, map_location="cpu", weights_only=True)


def load_weights(folder: str) -> dict[str, torch.Tensor]:
    """``model.safetensors`` of an HF folder on any fsspec path (safetensors: no code runs on load)."""
    from safetensors.torch import load

    with fsspec.open(f"{folder.rstrip('/')}/model.safetensors", "rb") as f:
        return load(f.read())


def save_model(model, tokenizer, folder: str, state_dict: dict | None = None) -> None:
    """Weights (safetensors; ``state_dict`` when given, e.g. a sharded model's gathered weights) and, if given, the
    tokenizer as an HF folder on any fsspec path."""
    with staged_dir(folder) as local:
        model.save_pretrained(local, safe_serialization=True, state_dict=state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(local)
