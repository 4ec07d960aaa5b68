"""The rows a run reads: its data files, or the built-in task's, checked against ``data.max_prompt_length``."""

from __future__ import annotations

import functools
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
    formats = {"truncation": data.truncation, "chat_template_kwargs": chat_template_kwargs(config)}
    keys = keys or {"prompt_key": data.prompt_key, "conversation_key": data.messages_key}
    return load_prompt_dataset(files, **keys, **limit, **formats)


def chat_template_kwargs(config: RLConfig) -> dict:
    """What prompts are rendered with: ``data.apply_chat_template_kwargs``, and the run's tools as ``tools`` (OpenAI
    schemas) when it has some (``rollout.multi_turn``): the template shows them to the model, or, when it ignores
    them, the system message does (``rlworkers.data.chat.with_tools``)."""
    kwargs = dict(config.data.apply_chat_template_kwargs)
    multi_turn = config.rollout.multi_turn
    if multi_turn.enable and (multi_turn.tools or multi_turn.tool_config_path):
        kwargs["tools"] = tool_schemas(tuple(multi_turn.tools), multi_turn.tool_config_path)
    return kwargs


@functools.lru_cache(maxsize=4)
def tool_schemas(specs: tuple[str, ...], tool_config_path: str | None) -> list[dict]:
    """The schemas of the tools the specs and the tool config name (loaded here for their schemas only: they run in
    the rollout workers)."""
    from rlworkers.tools.loading import load_tools, tools_from_config

    tools = load_tools(list(specs)) + (tools_from_config(tool_config_path) if tool_config_path else [])
    return [tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for tool in tools]


def check_ground_truth(config: RLConfig, reward_fn, rows: list[dict], split: str) -> None:
    """Refuse, before anything starts, a row without a ground truth when the reward compares with one
    (``rlworkers.rewards.needs_ground_truth``): verl's ``compute_score`` would get None, a rule would fail at the
    first reward call, after the workers and the MLflow run started."""
    from rlworkers.data.batching import ground_truth_of
    from rlworkers.rewards import describe_reward_fn, needs_ground_truth

    answer_key = config.data.answer_key
    for index, row in enumerate(rows):
        if ground_truth_of(row, answer_key) is None and needs_ground_truth(reward_fn, row.get("data_source")):
            raise ValueError(
                f"{row_location(config, split, index)} has no ground truth (no {answer_key!r} or 'ground_truth' "
                f"column, no reward_model.ground_truth) and the reward {describe_reward_fn(reward_fn)} compares "
                "with one. Fix: add the column (or set data.answer_key to the column that holds it), choose a reward "
                "that needs none, or declare that yours needs none (a ground_truth=None default in verl's "
                "signature, or needs_ground_truth = False on the function)"
            )


def row_location(config: RLConfig, split: str, index: int) -> str:
    """Where row ``index`` of a split comes from: ``<file> line N`` (jsonl) / ``<file> row N (0-based)`` (parquet)."""
    from rlworkers.data.datasets import row_locations

    files = config.data.train_files if split == "train" else (config.data.val_files or config.data.train_files)
    if not files:
        return f"the built-in task's {split} row {index}"
    return row_locations(files, config.data.prompt_key, config.data.messages_key)[index]
