"""Model and tokenizer loading, the tiny offline Llama with a character-level tokenizer (see tiny.py), and
SmolLM2-135M-Instruct built from a pip package (see smollm2.py)."""

from rlworkers.models.loading import (
    TINY_MODEL_NAME,
    default_tiny_model_dir,
    load_model,
    load_model_and_tokenizer,
    load_tokenizer,
    resolve_model_path,
    torch_dtype,
)
from rlworkers.models.smollm2 import (
    SMOLLM2_MODEL_NAME,
    create_smollm2_model,
    default_smollm2_model_dir,
    ensure_smollm2_model,
    find_smollm2_gguf,
    is_smollm2_model_complete,
)
from rlworkers.models.tiny import build_char_tokenizer, create_tiny_model, ensure_tiny_model, is_tiny_model_complete

__all__ = [
    "SMOLLM2_MODEL_NAME",
    "TINY_MODEL_NAME",
    "build_char_tokenizer",
    "create_smollm2_model",
    "create_tiny_model",
    "default_smollm2_model_dir",
    "default_tiny_model_dir",
    "ensure_smollm2_model",
    "ensure_tiny_model",
    "find_smollm2_gguf",
    "is_smollm2_model_complete",
    "is_tiny_model_complete",
    "load_model",
    "load_model_and_tokenizer",
    "load_tokenizer",
    "resolve_model_path",
    "torch_dtype",
]
