"""The rows a run reads: its data files, or the built-in task's, checked against ``data.max_prompt_length``."""

from __future__ import annotations

import logging

from flows.config import RLConfig
from rlworkers.data.datasets import load_prompt_dataset
from rlworkers.data.synthetic import ensure_addition_dataset

logger = logging.getLogger(__name__)


def dataset_rows(config: RLConfig, split: str, tokenizer=None) -> list[dict]:
    """Rows of a split: the configured files (validation falls back to the training files, with a warning), or
    the built-in task's split. With ``tokenizer``, every prompt is checked against ``data.max_prompt_length``."""
    files = config.data.train_files if split == "train" else config.data.val_files
    if split != "train" and not files and config.data.train_files:
        logger.warning("data.val_files is not set: validating on data.train_files")
        files = config.data.train_files
    if files:
        return read_rows(config, files, tokenizer)
    task_cfg = config.data.task
    style = "" if task_cfg.prompt_format == "plain" else f"-{task_cfg.prompt_format}"
    folder = f"{task_cfg.name}-{task_cfg.max_digits}d-{task_cfg.seed}{style}"
    paths = ensure_addition_dataset(
        f"{config.trainer.runs_dir.rstrip('/')}/_data/{folder}",
        num_train=task_cfg.num_train,
        num_val=task_cfg.num_val,
        max_digits=task_cfg.max_digits,
        seed=task_cfg.seed,
        prompt_format=task_cfg.prompt_format,
    )
    return read_rows(config, [paths[split]], tokenizer, keys={"prompt_key": "prompt"})


def read_rows(config: RLConfig, files: list[str], tokenizer=None, keys: dict | None = None) -> list[dict]:
    """Rows of data files, each prompt checked against ``data.max_prompt_length`` when ``tokenizer`` is given;
    ``keys``: the built-in task's columns instead of ``data.prompt_key`` / ``data.messages_key``."""
    data = config.data
    limit = {"tokenizer": tokenizer, "max_prompt_length": data.max_prompt_length} if tokenizer else {}
    formats = {"truncation": data.truncation, "chat_template_kwargs": data.apply_chat_template_kwargs}
    keys = keys or {"prompt_key": data.prompt_key, "conversation_key": data.messages_key}
    return load_prompt_dataset(files, **keys, **limit, **formats)
