"""Prompt datasets (parquet or jsonl, local or any fsspec URL) and a resumable, seeded batch loader.

``load_prompt_dataset(path)`` returns the rows as a list of dicts, every column as the file has it (verl's layout
loads unchanged: ``data_source``, ``prompt`` as chat messages, ``ability``, ``reward_model: {style, ground_truth}``,
``extra_info`` structs), and checks every row before training starts: a row whose prompt is neither a non-empty
string nor a list of chat messages (``rlworkers.data.chat``), or without a required column, raises ``ValueError``
naming the file, the place (``line N``, 1-based, for jsonl; ``row N (0-based)`` for parquet) and the fix. With
``conversation_key`` (SFT), a row may hold a whole conversation in that column instead of a prompt.

``PromptDataLoader(rows, batch_size=..., seed=...)`` yields batches (lists of rows). Each epoch's order is a
permutation drawn from ``(seed, epoch)`` alone, so ``state_dict()`` (epoch, position, seed) is enough for a
resumed run to continue with exactly the batch an uninterrupted run would have seen next.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import fsspec
import numpy as np

from rlworkers.data.chat import check_messages, is_chat, prompt_token_ids

logger = logging.getLogger(__name__)

PARQUET_SUFFIXES = (".parquet",)
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")
TRUNCATION = ("error", "left", "right")  # verl's data.truncation (its "middle" is not offered)


def load_prompt_dataset(
    path: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    prompt_key: str = "prompt",
    required_columns: Sequence[str] = (),
    max_rows: int | None = None,
    tokenizer=None,
    max_prompt_length: int | None = None,
    truncation: str = "error",
    chat_template_kwargs: dict | None = None,
    conversation_key: str | None = None,
) -> list[dict]:
    """Read prompt rows from parquet or jsonl files (chosen by extension); several files are concatenated.
    With ``tokenizer`` and ``max_prompt_length``, every prompt (chat messages rendered with the chat template) is also
    checked to fit, before any training starts rather than at the batch that happens to hold it: with
    ``truncation="error"`` (verl's default) a longer one raises; with ``"left"``/``"right"`` (cut when batched, see
    ``rlworkers.data.batching.prompt_batch``) their number is logged as a warning.

    Raises:
        ValueError: unknown extension, unreadable JSON line, missing column, a prompt that is neither a non-empty
            string nor a list of chat messages, chat messages and a tokenizer without a chat template, or a prompt
            longer than ``max_prompt_length`` tokens; the message names the file and the line/row.
        FileNotFoundError: a file does not exist.
    """
    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    if not paths:
        raise ValueError("load_prompt_dataset got an empty list of paths; pass at least one parquet/jsonl file")
    if truncation not in TRUNCATION:
        raise ValueError(f"truncation={truncation!r}: use one of {TRUNCATION}")
    columns = (prompt_key, *[c for c in required_columns if c != prompt_key])
    rows: list[dict] = []
    for one in paths:
        found, where = _read_file(os.fspath(one), columns, conversation_key)
        if tokenizer is not None and max_prompt_length is not None:
            prompts = [(row[prompt_key], at) for row, at in zip(found, where) if row.get(prompt_key) is not None]
            _check_prompt_lengths(prompts, tokenizer, max_prompt_length, truncation, chat_template_kwargs)
        rows.extend(found)
    if not rows:
        raise ValueError(f"no rows in {[os.fspath(p) for p in paths]}; the dataset must hold at least one prompt")
    logger.info("loaded %d prompt rows from %d file(s)", len(rows), len(paths))
    return rows[:max_rows] if max_rows is not None else rows


def _check_prompt_lengths(
    prompts: list[tuple], tokenizer, max_prompt_length: int, truncation: str, chat_template_kwargs: dict | None
) -> None:
    """``prompts``: (prompt, where) pairs of one file."""
    _, ids = prompt_token_ids([prompt for prompt, _ in prompts], tokenizer, chat_template_kwargs)
    lengths = [len(one) for one in ids]
    too_long = [i for i, n in enumerate(lengths) if n > max_prompt_length]
    if not too_long:
        return
    first = too_long[0]
    where = prompts[first][1]
    if truncation != "error":
        logger.warning(
            "%s and %d other row(s) of this file have prompts longer than data.max_prompt_length=%d tokens (the "
            "longest %d): data.truncation=%s cuts them to fit",
            where,
            len(too_long) - 1,
            max_prompt_length,
            max(lengths),
            truncation,
        )
        return
    raise ValueError(
        f"{where}: the prompt has {lengths[first]} tokens, more than data.max_prompt_length="
        f"{max_prompt_length} ({len(too_long)} row(s) of this file are too long, the longest has "
        f"{max(lengths)} tokens). Fix: raise data.max_prompt_length, set data.truncation=left (keep each prompt's "
        "end) or right, or shorten or drop those rows"
    )


def row_locations(paths, prompt_key: str = "prompt", conversation_key: str | None = None) -> list[str]:
    """Where each row of ``load_prompt_dataset(paths, ...)`` comes from, in its order (``<file> line N`` /
    ``<file> row N (0-based)``): how a check made after loading names a bad row."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    return [at for one in paths for at in _read_file(os.fspath(one), (prompt_key,), conversation_key)[1]]


def _read_file(path: str, columns: tuple[str, ...], conversation_key: str | None) -> tuple[list[dict], list[str]]:
    """The rows of one file and, for each, where it is (``<file> line N`` / ``<file> row N``)."""
    lowered = path.lower()
    if lowered.endswith(PARQUET_SUFFIXES):
        return _read_parquet(path, columns, conversation_key)
    if lowered.endswith(JSONL_SUFFIXES):
        return _read_jsonl(path, columns, conversation_key)
    raise ValueError(
        f"{path}: unknown dataset format; use a file ending in one of {list(PARQUET_SUFFIXES + JSONL_SUFFIXES)}"
    )


def _read_parquet(path: str, columns: tuple[str, ...], conversation_key: str | None) -> tuple[list[dict], list[str]]:
    import pyarrow.parquet as pq  # here, not at the top: every worker process imports this module, none reads parquet

    with fsspec.open(path, "rb") as f:
        table = pq.read_table(f)
    missing = [c for c in columns if c not in table.column_names]
    if conversation_key in table.column_names:  # SFT conversations need no prompt column
        missing = [c for c in missing if c != columns[0]]
    if missing:
        raise ValueError(
            f"{path}: missing column(s) {missing}; the file has {table.column_names}. "
            f"Fix: rename the column in the file, or pass prompt_key=/required_columns= matching it"
        )
    rows = table.to_pylist()
    where = [f"{path} row {index} (0-based)" for index in range(len(rows))]
    for row, at in zip(rows, where):
        _check_row(row, at, columns, conversation_key)
    return rows, where


def _read_jsonl(path: str, columns: tuple[str, ...], conversation_key: str | None) -> tuple[list[dict], list[str]]:
    rows, where = [], []
    with fsspec.open(path, "rt", encoding="utf-8", compression="infer") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines (a trailing newline, say) carry no row
            where.append(f"{path} line {line_number}")
            rows.append(_parse_json_line(line, where[-1]))
            _check_row(rows[-1], where[-1], columns, conversation_key)
    return rows, where


def _parse_json_line(line: str, where: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg}). Fix: each line must be one complete JSON object") from e
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}. Fix: write {{...}} per line")
    return row


def _check_row(row: dict, where: str, columns: tuple[str, ...], conversation_key: str | None) -> None:
    prompt_key = columns[0]
    if conversation_key and row.get(conversation_key) is not None:  # an SFT conversation instead of a prompt
        check_messages(row[conversation_key], where, conversation_key, need_assistant=True)
        columns = columns[1:]
    for column in columns:
        if row.get(column) is None:
            raise ValueError(f"{where}: missing value for column {column!r}. Fix: add it or drop the row")
    if prompt_key not in columns:
        return
    prompt = row[prompt_key]
    if is_chat(prompt):
        check_messages(prompt, where, prompt_key)
    elif not isinstance(prompt, str):
        raise ValueError(
            f"{where}: column {prompt_key!r} must be a string or a list of chat messages "
            f"([{{'role': 'user', 'content': ...}}]), got {type(prompt).__name__}"
        )
    elif not prompt.strip():
        raise ValueError(f"{where}: column {prompt_key!r} is empty. Fix: drop the row or fill in the prompt")


@dataclass
class LoaderState:
    """Where a PromptDataLoader stands: the next batch is batch ``position`` of epoch ``epoch``."""

    epoch: int = 0
    position: int = 0


class PromptDataLoader:
    """Seeded, resumable batches of prompt rows.

    ``__iter__`` yields the remaining batches of the current epoch (all of them for a fresh epoch);
    ``next_batch()`` yields one batch and rolls over into the next epoch as needed. The state advances as a
    batch is handed out, so a ``state_dict()`` taken after training on a batch resumes with the next one.
    """

    def __init__(
        self, rows: Sequence[dict], *, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = True
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if drop_last and len(rows) < batch_size:
            raise ValueError(
                f"batch_size={batch_size} is larger than the dataset ({len(rows)} rows) with drop_last=True; "
                "lower batch_size or add rows"
            )
        self.rows = rows
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.state = LoaderState()

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(len(self.rows), self.batch_size)
        return full if self.drop_last or not rest else full + 1

    @property
    def epoch(self) -> int:
        return self.state.epoch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Row indices of ``epoch`` in visiting order; depends only on (seed, epoch)."""
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def next_batch(self) -> list[dict]:
        """Return the next batch and advance the state (into the next epoch after the last batch)."""
        start = self.state.position * self.batch_size
        indices = self.epoch_order(self.state.epoch)[start : start + self.batch_size]
        self.state.position += 1
        if self.state.position == len(self):
            self.state = LoaderState(epoch=self.state.epoch + 1, position=0)
        return [self.rows[i] for i in indices]

    def __iter__(self) -> Iterator[list[dict]]:
        epoch = self.state.epoch
        while self.state.epoch == epoch:
            yield self.next_batch()

    def state_dict(self) -> dict:
        """Plain-int state for a checkpoint: epoch, position, seed, plus sizes checked on load."""
        return {
            "epoch": self.state.epoch,
            "position": self.state.position,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_rows": len(self.rows),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (from state_dict()).

        Raises:
            ValueError: the state came from a loader with another dataset size or batch size (resuming would not
                visit the same batches), or its position is out of range.
        """
        for key, ours in (("batch_size", self.batch_size), ("num_rows", len(self.rows))):
            if key in state and state[key] != ours:
                raise ValueError(
                    f"loader state has {key}={state[key]} but this loader has {ours}; "
                    "resume with the same dataset and batch size"
                )
        if not 0 <= state["position"] < len(self):
            raise ValueError(f"loader state position {state['position']} is outside 0..{len(self) - 1}")
        self.seed = state["seed"]
        self.state = LoaderState(epoch=int(state["epoch"]), position=int(state["position"]))
