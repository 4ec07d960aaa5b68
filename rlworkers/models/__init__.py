"""Model and tokenizer loading, and the tiny offline Llama with a character-level tokenizer (see tiny.py)."""

from rlworkers.models.loading import (
    TINY_MODEL_NAME,
    default_tiny_model_dir,
    load_model,
    load_model_and_tokenizer,
    load_tokenizer,
    resolve_model_path,
    torch_dtype,
)
from rlworkers.models.tiny import build_char_tokenizer, create_tiny_model, ensure_tiny_model, is_tiny_model_complete

__all__ = [
    "TINY_MODEL_NAME",
    "build_char_tokenizer",
    "create_tiny_model",
    "default_tiny_model_dir",
    "ensure_tiny_model",
    "is_tiny_model_complete",
    "load_model",
    "load_model_and_tokenizer",
    "load_tokenizer",
    "resolve_model_path",
    "torch_dtype",
]
