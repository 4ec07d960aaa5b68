"""LoRA adapters (peft) on a frozen base model: the actor's trainable adapter, adapter folders, merged weights.

With ``actor.lora.rank > 0`` the actor wraps its model with peft's ``get_peft_model``: only the adapter's
``lora_A`` / ``lora_B`` matrices train (the optimizer and DDP see only them), the reference policy is the same
module with the adapter disabled (``disable_adapter()``, no second copy of the weights, as verl does), and HF
generate samples with the current adapter. vLLM gets merged weights, ``W + B @ A * alpha / r`` computed beside the
base weights (``merged_state_dict``): the base itself is never modified, so a run that merges and one that does not
keep bitwise-identical weights.

An *adapter folder* is what the actor saves (checkpoints, the final model, a lineage's registered versions)::

    adapter_config.json           peft's (rank, alpha, dropout, target modules)
    adapter_model.safetensors     the adapter's weights only
    base_model.json               {"path": the base model's folder, "sha256": fingerprint of its weights}
    tokenizer files

``load_model`` loads an adapter folder as one model (base + adapter, merged), so a folder or a
``models:/<lineage>@champion`` that holds an adapter works everywhere ``model.path`` is accepted; a LoRA actor
started from one continues training that adapter. A checkpoint whose base fingerprint differs from the run's base is
refused before any worker starts (``flows.controller.run_start.check_checkpoint_fits``: ``CheckpointMismatch``). A peft
adapter from elsewhere (no ``base_model.json``) names its base in peft's ``base_model_name_or_path``, unpinned.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import fsspec
import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_MODEL_FILE = "base_model.json"
ADAPTER_NAME = "default"  # peft's name for the one adapter a model has

_fingerprints: dict[tuple[str, int, int], str] = {}


def is_adapter_folder(path: str | os.PathLike) -> bool:
    """True when ``path`` (local or fsspec) holds a peft adapter (``adapter_config.json``) rather than a full model."""
    fs, p = fsspec.core.url_to_fs(os.fspath(path))
    return fs.exists(f"{p.rstrip('/')}/{ADAPTER_CONFIG}")


def read_base(adapter_dir: str | os.PathLike) -> dict:
    """``{"path", "sha256"}`` of the base model an adapter folder was trained on; for a peft adapter not written by
    rlflow, ``{"path": base_model_name_or_path}`` of its ``adapter_config.json`` (no fingerprint to check).

    Raises:
        FileNotFoundError: neither names the base; the message names the fix.
    """
    folder = os.fspath(adapter_dir).rstrip("/")
    try:
        with fsspec.open(f"{folder}/{BASE_MODEL_FILE}", "r") as f:
            return json.load(f)
    except FileNotFoundError:
        pass
    with fsspec.open(f"{folder}/{ADAPTER_CONFIG}", "r") as f:
        named = json.load(f).get("base_model_name_or_path")
    if not named:
        raise FileNotFoundError(
            f"{adapter_dir} holds a LoRA adapter that names no base model (no {BASE_MODEL_FILE}, no "
            f'base_model_name_or_path in {ADAPTER_CONFIG}). Fix: write {{"path": "<the base model>"}} into '
            f"{folder}/{BASE_MODEL_FILE}"
        )
    return {"path": named}


def weights_fingerprint(model_dir: str | os.PathLike) -> str:
    """sha256 over a model folder's ``*.safetensors`` files (name and bytes, in name order), cached per file
    size and modification time: what pins an adapter to the base it was trained on."""
    folder = Path(model_dir)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights to fingerprint")
    key = (str(folder.resolve()), sum(f.stat().st_size for f in files), max(f.stat().st_mtime_ns for f in files))
    if key not in _fingerprints:
        digest = hashlib.sha256()
        for file in files:
            digest.update(file.name.encode())
            with file.open("rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
        _fingerprints[key] = digest.hexdigest()
    return _fingerprints[key]


def lora_config(rank: int, alpha: float, dropout: float, target_modules: list[str] | str):
    from peft import LoraConfig

    return LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )


def attach_adapter(model, config):
    """A new, trainable adapter on ``model`` (peft initialises ``lora_B`` to zero: the policy starts as the base)."""
    from peft import get_peft_model

    return get_peft_model(model, config)


def load_adapter(model, adapter_dir: str, *, trainable: bool):
    """The adapter saved in ``adapter_dir`` on ``model`` (its base)."""
    from peft import PeftModel

    from rlworkers.storage import local_dir

    with local_dir(adapter_dir) as folder:
        return PeftModel.from_pretrained(model, folder, is_trainable=trainable)


def adapter_settings(adapter_dir: str) -> dict:
    """rank, alpha, dropout and target modules of a saved adapter, with ``actor.lora``'s names."""
    with fsspec.open(f"{adapter_dir.rstrip('/')}/{ADAPTER_CONFIG}", "r") as f:
        saved = json.load(f)
    targets = saved.get("target_modules")
    return {
        "rank": saved["r"],
        "alpha": saved["lora_alpha"],
        "dropout": saved.get("lora_dropout", 0.0),
        "target_modules": sorted(targets) if isinstance(targets, list) else targets,
    }


def check_settings(adapter_dir: str, settings) -> None:
    """Refuse to train the adapter in ``adapter_dir`` further under other ``actor.lora`` settings.

    Raises:
        ValueError: names each field that differs and the fix.
    """
    saved = adapter_settings(adapter_dir)
    wanted = {"rank": settings.rank, "alpha": settings.alpha, "dropout": settings.dropout}
    if settings.target_modules != "all-linear":  # peft saves all-linear as the module names it found
        wanted["target_modules"] = sorted(settings.target_modules)
    differ = [f"actor.lora.{k}={v!r} but the adapter has {saved[k]!r}" for k, v in wanted.items() if saved[k] != v]
    if differ:
        raise ValueError(
            f"model.path {adapter_dir} is a LoRA adapter trained with other settings: {'; '.join(differ)}. Fix: set "
            "actor.lora to the adapter's settings to train it further, or start from its base model"
        )


def check_fits(model_dir: str, settings) -> None:
    """Before any worker starts: the modules ``actor.lora.target_modules`` names exist in the model (as peft matches
    them: a module's name, or the end of its dotted path), and a start model that is an adapter was trained with
    ``actor.lora``'s settings (``check_settings``).

    Raises:
        ValueError: names the field, what the model has, and the fix.
    """
    if not settings.enabled:
        return
    if is_adapter_folder(model_dir):
        check_settings(model_dir, settings)
        return
    if settings.target_modules == "all-linear":
        return
    names = linear_module_names(model_dir)
    unknown = [t for t in settings.target_modules if not any(n == t or n.endswith(f".{t}") for n in names)]
    if unknown:
        short = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise ValueError(
            f"actor.lora.target_modules names {unknown}, which the model in {model_dir} does not have. Fix: pick "
            f"from its linear layers {short}, or use all-linear"
        )


def linear_module_names(model_dir: str) -> list[str]:
    """Dotted names of the model's ``nn.Linear`` modules, from its config alone (built on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def load_adapter_weights(model, adapter_dir: str) -> None:
    """Set ``model``'s adapter to the weights saved in ``adapter_dir`` (safetensors: no code runs on load).

    Raises:
        ValueError: the saved adapter does not fit the model's (other rank or target modules).
    """
    from safetensors.torch import load

    with fsspec.open(f"{adapter_dir.rstrip('/')}/{ADAPTER_WEIGHTS}", "rb") as f:
        set_adapter_weights(model, load(f.read()), adapter_dir)


def adapter_weights(model) -> dict[str, torch.Tensor]:
    """The adapter's weights of ``model`` alone, on the CPU, under peft's saved names (what ``set_adapter_weights``
    takes): the part of a LoRA policy that training changes."""
    from peft import get_peft_model_state_dict

    return {name: tensor.detach().to("cpu") for name, tensor in get_peft_model_state_dict(model).items()}


def set_adapter_weights(model, weights: dict[str, torch.Tensor], source: str) -> None:
    """Set ``model``'s adapter to ``weights`` (``adapter_weights`` of a model of the same settings, or a saved
    adapter's), every one of its weights replaced.

    Raises:
        ValueError: the weights do not fit the model's adapter (other rank or target modules), naming ``source``.
    """
    from peft import set_peft_model_state_dict

    expected = {k for k in model.state_dict() if "lora_" in k}
    try:
        result = set_peft_model_state_dict(model, weights)
    except RuntimeError as error:  # size mismatch
        raise ValueError(f"{source}: the adapter does not fit this model's ({error})") from None
    missing = [k for k in result.missing_keys if k in expected]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{source}: the adapter does not fit this model's (missing {missing[:5]}, unexpected "
            f"{list(result.unexpected_keys)[:5]})"
        )


@torch.no_grad()
def merged_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the full model with the adapter merged in, one at a time, under the base model's own names
    (what vLLM's loader and a plain model's ``load_state_dict`` take); a model without an adapter yields its
    ``state_dict()``. The base weights are not modified."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    if not isinstance(model, PeftModel):
        yield from model.state_dict().items()
        return
    base = model.get_base_model()
    adapted = {
        f"{name}.base_layer.weight": module
        for name, module in base.named_modules()
        if isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A
    }
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue
        if name in adapted:
            tensor = tensor + adapted[name].get_delta_weight(ADAPTER_NAME)
        yield name.replace(".base_layer.", "."), tensor


def merged_state_dict(model) -> dict[str, torch.Tensor]:
    return dict(merged_weights(model))


def save_adapter(model, tokenizer, folder: str, base: dict) -> None:
    """peft's adapter files, the tokenizer and ``base_model.json`` as one folder on any fsspec path."""
    from rlworkers.storage import staged_dir

    with staged_dir(folder) as local:
        model.save_pretrained(local, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(local)
        Path(local, BASE_MODEL_FILE).write_text(json.dumps(base, indent=2) + "\n")


def save_merged(model, tokenizer, folder: str) -> None:
    """The adapter merged into a copy of the base (``merge_and_unload``: the same sums as ``merged_state_dict``),
    saved as a plain HF model folder."""
    import copy

    from rlworkers.storage import staged_dir

    plain = copy.deepcopy(model).merge_and_unload()
    with staged_dir(folder) as local:
        plain.save_pretrained(local, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(local)
