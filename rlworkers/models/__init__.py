"""Model and tokenizer loading, the tiny offline Llama with a character-level tokenizer (see tiny.py), and
SmolLM2-135M-Instruct built from a pip package (see smollm2.py)."""

import transformers.utils
import transformers.utils.import_utils


def _not_for_rlflow() -> bool:
    return False


# transformers imports scikit-learn's metrics when scikit-learn is installed (mlflow requires it), for a threshold of
# assisted decoding that rlflow never uses, and scipy.optimize when scipy is installed, for the losses of its object
# detection models: ~1 s each of the start-up of every worker, of the task host and of the flow here. Set before
# transformers' generation and loss modules are imported (they bind the checks then): rlworkers imports
# transformers' models only through this package.
for _check in ("is_sklearn_available", "is_scipy_available"):
    setattr(transformers.utils, _check, _not_for_rlflow)
    setattr(transformers.utils.import_utils, _check, _not_for_rlflow)

from rlworkers.models.loading import (  # noqa: E402
    TINY_MODEL_NAME,
    default_tiny_model_dir,
    load_model,
    load_model_and_tokenizer,
    load_tokenizer,
    resolve_model_path,
    torch_dtype,
)
from rlworkers.models.smollm2 import (  # noqa: E402
    SMOLLM2_MODEL_NAME,
    create_smollm2_model,
    default_smollm2_model_dir,
    ensure_smollm2_model,
    find_smollm2_gguf,
    is_smollm2_model_complete,
)
from rlworkers.models.tiny import build_char_tokenizer, create_tiny_model, ensure_tiny_model, is_tiny_model_complete  # noqa: E402

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
