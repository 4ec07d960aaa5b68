"""What a run reads (``RunInputs``, from ``read_inputs``): its data files' rows or the built-in task's, its eval sets,
and what its prompts are rendered with, each checked before any worker starts: prompts against
``data.max_prompt_length``, ground truths against the reward, chat messages against the tokenizer and the agent's
settings, the scorers and tools by loading them."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from flows.config import RLConfig
from flows.lineages import evaluation
from rlworkers.data.chat import conversation_as_prompt, is_chat
from rlworkers.data.datasets import load_prompt_dataset
from rlworkers.data.synthetic import ensure_addition_dataset
from rlworkers.rewards import load_reward_fn
from rlworkers.workers.config import RewardConfig
from rlworkers.workers.reward import RuleReward

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunInputs:
    """What a run reads, resolved and checked once before any worker starts: its training and validation rows, its
    eval sets, and what every prompt is rendered with (``template_kwargs``, see ``chat_template_kwargs``)."""

    train_rows: list[dict]
    val_rows: list[dict]
    eval_sets: list[evaluation.EvalSet]
    template_kwargs: dict


def read_inputs(config: RLConfig, algorithm: str, tokenizer, model_dir: str) -> RunInputs:
    """The run's rows, eval sets and prompt rendering, checked: a bad file, row, tool, environment or scorer fails
    here, naming the file and line, before any worker or MLflow run starts. ``tokenizer`` (a ``TokenCache``)
    tokenizes each prompt once for the length check; ``model_dir`` is where it came from (named in errors)."""
    checked = tokenizer if algorithm != "sft" else None  # SFT rows are prompt + response, cut by the tokenizer
    template_kwargs = chat_template_kwargs(config)  # loads the tools (their schemas): a bad spec or tool config fails
    train_rows, val_rows = dataset_rows(config, "train", checked), dataset_rows(config, "validation", checked)
    eval_sets = evaluation.resolve_sets(
        config, val_rows, lambda files: read_rows(config, files, checked), template_kwargs
    )
    check_rows_fit(config, algorithm, tokenizer, model_dir, train_rows, val_rows)
    check_agent_fits(config, tokenizer, model_dir, train_rows, val_rows)
    for eval_set in eval_sets:  # a scorer that does not load fails here
        if eval_set.scorer is not None:
            RuleReward(RewardConfig(reward_fn=eval_set.scorer), model_dir).load()
    return RunInputs(train_rows, val_rows, eval_sets, template_kwargs)


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


def check_rows_fit(config: RLConfig, algorithm: str, tokenizer, model_dir: str, train_rows, val_rows) -> None:
    """What the rows need of the reward and the tokenizer, checked before anything starts: a ground truth for every
    row when the reward compares with one (validation rows only for SFT, which trains on responses), and a chat
    template when SFT rows hold chat messages (prompts are checked when they are tokenized above)."""
    if config.reward.reward_model is None:
        reward_fn = load_reward_fn(config.reward.reward_fn)
        data = config.data  # validation asks an SFT conversation's last question, its answer the ground truth
        validated = [conversation_as_prompt(row, data.prompt_key, data.messages_key) for row in val_rows]
        for split, rows in (("train", train_rows), ("validation", validated)):
            if split == "validation" or algorithm != "sft":
                check_ground_truth(config, reward_fn, rows, split)
    if algorithm == "sft" and not getattr(tokenizer, "chat_template", None):
        data = config.data
        for index, row in enumerate(train_rows):
            column = next((k for k in (data.messages_key, data.prompt_key) if is_chat(row.get(k))), None)
            if column:
                raise ValueError(
                    f"{row_location(config, 'train', index)}: column {column!r} holds chat messages and the "
                    f"tokenizer of {model_dir} has no chat template to render them. Fix: a chat model (or a "
                    "tokenizer with a chat_template), or prompt/response strings"
                )


def check_agent_fits(config: RLConfig, tokenizer, model_dir: str, train_rows, val_rows) -> None:
    """A multi-turn run (``rollout.multi_turn``), checked before anything starts: its tools and environment load,
    the tokenizer has a chat template to render the turns, and every prompt is chat messages."""
    multi_turn = config.rollout.multi_turn
    if not multi_turn.enable:
        return
    from rlworkers.agents.environment import load_environment_class

    if multi_turn.environment:
        load_environment_class(multi_turn.environment)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"rollout.multi_turn needs a chat template to render the turns, and the tokenizer of {model_dir} has none. "
            "Fix: a chat (instruct) model, e.g. model.path=smollm2-135m-instruct"
        )
    key = config.data.prompt_key
    for split, rows in (("train", train_rows), ("validation", val_rows)):
        for index, row in enumerate(rows):
            if not is_chat(row.get(key)):
                raise ValueError(
                    f"{row_location(config, split, index)}: column {key!r} is a string; rollout.multi_turn continues "
                    "a conversation, so prompts must be chat messages ([{'role': 'user', 'content': ...}]). Fix: "
                    "store the prompts as messages (data.task.prompt_format=chat for the built-in task)"
                )


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
