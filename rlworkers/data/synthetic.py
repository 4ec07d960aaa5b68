"""Built-in synthetic task that the tiny character-level model can learn: integer addition.

``make_addition_dataset(out_dir)`` writes ``train.parquet`` and ``validation.parquet`` with one row per
problem and the columns

    prompt       "12+34="        short and character-level (the tiny tokenizer has one token per character)
    answer       "46"            the ground truth for rule rewards (rlworkers.rewards "exact")
    response     "46"            the SFT target (the tokenizer's eos is appended by the SFT collator, not here)
    data_source  "addition"      selects the default reward (rlworkers.rewards.registry.DATA_SOURCE_DEFAULTS)
    extra_info   {"split", "index", "a", "b"}

``prompt_format`` picks how a problem is asked: ``"plain"`` (above, for the tiny model), or as a chat model is asked,
in verl's layout (``prompt`` a list of chat messages, ``ability``, ``reward_model: {style, ground_truth}``):
``"chat"`` ("What is 12 + 34? Reply with the number only.", data_source ``addition_chat``, scored by the last
number of the response), ``"tool"`` (the same, asked to use the ``add`` tool, data_source ``addition_tool``, scored
by the last number; a ``messages`` column holds the demonstration an SFT warm-up learns from: the call, its result,
the answer) or ``"gsm8k"`` (the answer written after ``####`` as in GSM8K, data_source
``addition_gsm8k``, scored by the ``gsm8k`` rule: nothing for an answer without ``####``).

Operands are drawn uniformly from ``[0, 10**max_digits)``; every (a, b) pair appears at most once across both
splits, so train and validation are disjoint. The output depends only on the arguments (numpy Generator seeded
with ``seed``). ``out_dir`` may be a local folder or an fsspec URL.

    python -c "from rlworkers.data import make_addition_dataset; make_addition_dataset('data/addition')"
"""

from __future__ import annotations

import json
import logging
import os

import fsspec
import numpy as np

from rlworkers.storage import filesystem, join_path, write_bytes_atomic

logger = logging.getLogger(__name__)

DATA_SOURCE = "addition"
PROMPT_FORMATS = {  # prompt_format -> (data_source, chat question)
    "plain": (DATA_SOURCE, None),
    "chat": ("addition_chat", "What is {a} + {b}? Reply with the number only."),
    "gsm8k": ("addition_gsm8k", 'What is {a} + {b}? Write the final answer after "####", e.g. "#### 7".'),
    "tool": ("addition_tool", "What is {a} + {b}? Use the add tool, then reply with the number only."),
}
TOOL_NAME = "add"  # the tool the "tool" format's demonstrations call: rlworkers.agents.examples:add
SPLIT_FILES = {"train": "train.parquet", "validation": "validation.parquet"}
META_FILE = "meta.json"


def sample_operand_pairs(count: int, *, max_digits: int, seed: int) -> list[tuple[int, int]]:
    """Return ``count`` distinct (a, b) pairs with ``0 <= a, b < 10**max_digits``, in a seed-determined order.

    Raises:
        ValueError: more pairs asked for than exist.
    """
    if max_digits < 1:
        raise ValueError(f"max_digits must be >= 1, got {max_digits}")
    limit = 10**max_digits
    if count > limit * limit:
        raise ValueError(f"asked for {count} problems but only {limit * limit} exist with max_digits={max_digits}")
    rng = np.random.default_rng(seed)
    seen: set[tuple[int, int]] = set()
    pairs: list[tuple[int, int]] = []
    while len(pairs) < count:
        for a, b in rng.integers(0, limit, size=(count - len(pairs), 2)).tolist():
            if (a, b) not in seen:
                seen.add((a, b))
                pairs.append((a, b))
    return pairs


def addition_row(a: int, b: int, *, split: str, index: int, prompt_format: str = "plain") -> dict:
    """One dataset row for ``a + b``."""
    answer = str(a + b)
    extra_info = {"split": split, "index": index, "a": a, "b": b}
    data_source, question = PROMPT_FORMATS[prompt_format]
    if question is None:
        return {
            "prompt": f"{a}+{b}=",
            "answer": answer,
            "response": answer,
            "data_source": data_source,
            "extra_info": extra_info,
        }
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": question.format(a=a, b=b)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": extra_info,
        "response": answer if prompt_format in ("chat", "tool") else f"{a} + {b} = {answer}\n#### {answer}",
        **({"messages": tool_demonstration(question.format(a=a, b=b), a, b)} if prompt_format == "tool" else {}),
    }


def tool_demonstration(question: str, a: int, b: int) -> list[dict]:
    """The conversation an SFT warm-up shows for the "tool" format: the question, a call of the add tool (verl's
    Hermes format), its result, and the answer."""
    call = json.dumps({"name": TOOL_NAME, "arguments": {"a": a, "b": b}})
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
        {"role": "tool", "content": str(a + b)},
        {"role": "assistant", "content": str(a + b)},
    ]


def addition_rows(
    *, num_train: int, num_val: int, max_digits: int, seed: int, prompt_format: str = "plain"
) -> dict[str, list[dict]]:
    """The rows of both splits: ``{"train": [...], "validation": [...]}``, disjoint by construction."""
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format={prompt_format!r}: use one of {sorted(PROMPT_FORMATS)}")
    pairs = sample_operand_pairs(num_train + num_val, max_digits=max_digits, seed=seed)
    splits = {"train": pairs[:num_train], "validation": pairs[num_train:]}
    return {
        split: [
            addition_row(a, b, split=split, index=i, prompt_format=prompt_format)
            for i, (a, b) in enumerate(split_pairs)
        ]
        for split, split_pairs in splits.items()
    }


def make_addition_dataset(
    out_dir: str | os.PathLike,
    *,
    num_train: int = 2000,
    num_val: int = 200,
    max_digits: int = 2,
    seed: int = 0,
    prompt_format: str = "plain",
) -> dict[str, str]:
    """Write the addition task to ``out_dir`` and return ``{"train": url, "validation": url}``."""
    out_dir = os.fspath(out_dir)
    fs, root = filesystem(out_dir)
    fs.makedirs(root, exist_ok=True)
    rows = addition_rows(
        num_train=num_train, num_val=num_val, max_digits=max_digits, seed=seed, prompt_format=prompt_format
    )
    paths = {}
    # Each file whole or not at all, meta.json last: runs that start at once on one runs_dir (two lineages) may
    # write the same folder while the other reads it.
    import pyarrow as pa  # here: every worker process imports this package, only a run's start writes parquet
    import pyarrow.parquet as pq

    for split, split_rows in rows.items():
        paths[split] = join_path(out_dir, SPLIT_FILES[split])
        buffer = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_pylist(split_rows), buffer)
        write_bytes_atomic(paths[split], buffer.getvalue().to_pybytes())
    meta = {"num_train": num_train, "num_val": num_val, "max_digits": max_digits, "seed": seed}
    if prompt_format != "plain":  # plain folders written before the formats existed stay valid
        meta["prompt_format"] = prompt_format
    write_bytes_atomic(join_path(out_dir, META_FILE), json.dumps(meta).encode())
    logger.info("wrote addition dataset (%d train, %d validation) to %s", num_train, num_val, out_dir)
    return paths


def ensure_addition_dataset(out_dir: str | os.PathLike, **params) -> dict[str, str]:
    """Like make_addition_dataset, but reuse the files in ``out_dir`` when they were made with the same
    parameters (recorded in ``meta.json``)."""
    out_dir = os.fspath(out_dir)
    wanted = {"num_train": 2000, "num_val": 200, "max_digits": 2, "seed": 0, **params}
    if wanted.get("prompt_format") == "plain":
        del wanted["prompt_format"]
    fs, root = filesystem(out_dir)
    paths = {split: join_path(out_dir, name) for split, name in SPLIT_FILES.items()}
    meta_path = join_path(out_dir, META_FILE)
    if fs.exists(join_path(root, META_FILE)) and all(fs.exists(join_path(root, n)) for n in SPLIT_FILES.values()):
        with fsspec.open(meta_path, "r") as f:
            if json.load(f) == wanted:
                return paths
    return make_addition_dataset(out_dir, **wanted)
