"""Model and tokenizer loading, and the tiny offline Llama with a character-level tokenizer (see tiny.py)."""

import transformers.utils
import transformers.utils.import_utils


def _sklearn_unused() -> bool:
    return False


# transformers imports scikit-learn's metrics when scikit-learn is installed (mlflow requires it), for a threshold of
# assisted decoding that rlflow never uses: ~1 s of the start-up of every worker, of the task host and of the flow
# here. Set before transformers' generation module is imported (it binds the check then): rlworkers imports
# transformers' models only through this package.
transformers.utils.is_sklearn_available = transformers.utils.import_utils.is_sklearn_available = _sklearn_unused

from rlworkers.models.loading import (  # noqa: E402
    TINY_MODEL_NAME,
    default_tiny_model_dir,
    load_model,
    load_model_and_tokenizer,
    load_tokenizer,
    resolve_model_path,
    torch_dtype,
)
from rlworkers.models.tiny import build_char_tokenizer, create_tiny_model, ensure_tiny_model, is_tiny_model_complete  # noqa: E402

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
