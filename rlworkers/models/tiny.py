"""The tiny offline model: a small Llama with a character-level tokenizer, created locally.

No model hub is reachable on the machines this project is developed and tested on, so the demo flows and the
tests use a model built here from nothing:

- tokenizer: one token per character (digits, ``+ - * / =``, space, ``a-z``, ``A-Z``, ``# : ? . , ! $ ( ) '``,
  newline) plus the special tokens ``<pad>`` (id 0), ``<bos>`` (1), ``<eos>`` (2), ``<unk>`` (3), built with the
  ``tokenizers`` library and wrapped in ``PreTrainedTokenizerFast``. Encoding prepends ``<bos>``; decoding
  concatenates characters, so ``decode(encode(s), skip_special_tokens=True) == s`` for text in the vocabulary.
- model: a standard ``LlamaConfig`` / ``LlamaForCausalLM`` (4 layers, hidden 256 by default (2.6M parameters: learns
  2-digit addition in a few CPU minutes), head_dim 64, randomly initialised from ``seed``), saved as
  ``model.safetensors``.

Both are written with ``save_pretrained`` so ``AutoModelForCausalLM.from_pretrained(path)`` and
``AutoTokenizer.from_pretrained(path)`` load them offline, and so does vLLM (standard Llama, safetensors).

Usage::

    from rlworkers.models import ensure_tiny_model
    path = ensure_tiny_model("/tmp/rlflow-tiny")   # creates it only if missing; returns the path

Creation writes into a temporary sibling folder and renames it into place, so concurrent callers (several Ray
actors starting at once) never see a half-written model.
"""

from __future__ import annotations

import json
import logging
import os
import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rlworkers.models.atomic import build_into_place
from rlworkers.models.cards import TINY_CARD, write_model_card

logger = logging.getLogger(__name__)

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
CHARACTERS = string.digits + "+-*/=" + " " + string.ascii_lowercase + string.ascii_uppercase + "#:?.,!$()'" + "\n"

# What must exist for a folder to count as a complete tiny model (see ensure_tiny_model).
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def build_char_tokenizer(*, model_max_length: int = 128, characters: str = CHARACTERS) -> PreTrainedTokenizerFast:
    """Return the character-level tokenizer (vocabulary: SPECIAL_TOKENS, then ``characters``, in that order).

    ``characters`` in another order gives a tokenizer that reads the same text as other ids: what a reward model
    with a vocabulary of its own looks like to a test (tests/test_reward_model.py)."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(characters))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Every character is its own pre-token; `[\s\S]` rather than `.` so newlines are split too.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    bos_id = vocab[BOS_TOKEN]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        # The default clean-up would turn " ." into "." and break exact round trips.
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
        padding_side="left",
    )


def tiny_llama_config(
    tokenizer: PreTrainedTokenizerFast,
    *,
    num_layers: int,
    hidden_size: int,
    intermediate_size: int | None,
    num_heads: int | None,
    max_position_embeddings: int,
    tie_word_embeddings: bool,
) -> LlamaConfig:
    """Return a standard LlamaConfig sized for the tiny model (head_dim 64 unless num_heads says otherwise)."""
    heads = num_heads or max(1, hidden_size // 64)
    if hidden_size % heads:
        raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={heads}; pick a divisor")
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        rms_norm_eps=1e-5,
    )


def create_tiny_model(
    path: str | os.PathLike,
    *,
    num_layers: int = 4,
    hidden_size: int = 256,
    intermediate_size: int | None = None,
    num_heads: int | None = None,
    max_position_embeddings: int = 128,
    tie_word_embeddings: bool = True,
    seed: int = 0,
) -> Path:
    """Create the tiny Llama and its tokenizer in ``path`` (overwriting files there) and return the path.

    The weights depend only on ``seed`` and the sizes; the global torch RNG state is left untouched.
    """
    path = Path(path)
    tokenizer = build_char_tokenizer(model_max_length=max_position_embeddings)
    config = tiny_llama_config(
        tokenizer,
        num_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    _write_portable_tokenizer_class(path)
    write_model_card(
        path, TINY_CARD, "tiny-llama", "A tiny Llama with random weights and a character tokenizer, made by rlflow."
    )
    logger.info("created tiny model (%d parameters) in %s", model.num_parameters(), path)
    return path


def _write_portable_tokenizer_class(path: Path) -> None:
    # transformers 5 writes its internal class name "TokenizersBackend", which transformers 4.x does not know;
    # "PreTrainedTokenizerFast" loads the same tokenizer.json in both (and in vLLM).
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def is_tiny_model_complete(path: str | os.PathLike) -> bool:
    """True when ``path`` holds every file in REQUIRED_FILES."""
    return all((Path(path) / name).is_file() for name in REQUIRED_FILES)


def ensure_tiny_model(path: str | os.PathLike, *, seed: int = 0, **sizes) -> Path:
    """Create the tiny model in ``path`` unless a complete one is already there; return the path.

    ``sizes`` are create_tiny_model's keywords; they are used only when the model is created. The model is
    built in a temporary sibling folder and renamed into place, so a concurrent caller either sees no model or a
    complete one.

    Raises:
        FileExistsError: ``path`` exists but is not a complete tiny model (delete it or choose another path).
    """
    path = Path(path)
    if is_tiny_model_complete(path):
        return path
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} exists but lacks some of {list(REQUIRED_FILES)}; delete it or pass another path")
    return build_into_place(
        path, lambda staging: create_tiny_model(staging, seed=seed, **sizes), is_tiny_model_complete
    )
