"""Reward function registry, loading of user reward functions, and validated scoring.

A reward function scores a batch::

    def reward_fn(prompts: list[str], responses: list[str], **columns) -> list[float]: ...

``columns`` are the dataset's other columns for the same rows, one list each (``answer`` / ``ground_truth``,
``data_source``, ``extra_info``, ...); accept ``**columns`` and ignore what you do not need. Return one finite
float per response.

``load_reward_fn(spec)`` accepts exactly these forms, and loads user code only from what the spec names (no
scanning of folders, no ``eval``):

- a registered name: "exact", "gsm8k", "format", or "auto" (per row, by the ``data_source`` column, through
  DATA_SOURCE_DEFAULTS, e.g. "addition" -> "exact");
- "path/to/file.py:function_name": the file is executed as a fresh module, and the function taken from it;
- "package.module:function_name": the module is imported.

``compute_scores(reward_fn, prompts, responses, **columns)`` calls a reward function and checks its result.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import math
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from rlworkers.rewards.rule import exact_answer_reward, format_reward, gsm8k_reward

logger = logging.getLogger(__name__)

RewardFn = Callable[..., Sequence[float]]

GROUND_TRUTH_COLUMNS = ("ground_truth", "answer")
SPEC_FORMS = (
    "a registered name ({names})",
    "'path/to/file.py:function_name'",
    "'package.module:function_name'",
)


def _ground_truths(columns: dict, name: str) -> list:
    for key in GROUND_TRUTH_COLUMNS:
        if key in columns:
            return list(columns[key])
    if "reward_model" in columns:  # verl's parquet layout: reward_model = {"ground_truth": ..., "style": ...}
        return [row["ground_truth"] for row in columns["reward_model"]]
    raise ValueError(
        f"reward {name!r} needs one of the columns {[*GROUND_TRUTH_COLUMNS, 'reward_model']}; got "
        f"{sorted(columns)}. Fix: add an 'answer' or 'ground_truth' column to the dataset"
    )


def per_sample(score_fn: Callable[[str, str], float], name: str) -> RewardFn:
    """Turn ``score_fn(response, ground_truth) -> float`` into a batch reward function."""

    def reward_fn(prompts: list[str], responses: list[str], **columns) -> list[float]:
        truths = _ground_truths(columns, name)
        return [float(score_fn(r, t)) for r, t in zip(responses, truths, strict=True)]

    reward_fn.__name__ = reward_fn.__qualname__ = f"{name}_reward"
    return reward_fn


def _format_batch(prompts: list[str], responses: list[str], **columns) -> list[float]:
    return [format_reward(r) for r in responses]


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "exact": per_sample(exact_answer_reward, "exact"),
    "gsm8k": per_sample(gsm8k_reward, "gsm8k"),
    "format": _format_batch,
}

# data_source value -> registered reward name, used by "auto".
DATA_SOURCE_DEFAULTS: dict[str, str] = {
    "addition": "exact",
    "gsm8k": "gsm8k",
    "openai/gsm8k": "gsm8k",
}


def register_reward_fn(name: str, fn: RewardFn, *, overwrite: bool = False) -> None:
    """Add ``fn`` to the registry under ``name``.

    Raises:
        ValueError: the name is taken (pass overwrite=True to replace it) or contains ':'.
    """
    if ":" in name or name == "auto":
        raise ValueError(f"reward name {name!r} is reserved or contains ':'; choose another name")
    if name in REWARD_FUNCTIONS and not overwrite:
        raise ValueError(f"reward {name!r} is already registered; pass overwrite=True to replace it")
    REWARD_FUNCTIONS[name] = fn


def reward_fn_for_data_source(data_source: str) -> RewardFn:
    """The registered reward for a data_source value.

    Raises:
        ValueError: no default for it; the message lists the known data sources.
    """
    if data_source not in DATA_SOURCE_DEFAULTS:
        raise ValueError(
            f"no default reward for data_source {data_source!r}; known: {sorted(DATA_SOURCE_DEFAULTS)}. "
            "Fix: name a reward function explicitly (reward spec) or add the data source to DATA_SOURCE_DEFAULTS"
        )
    return REWARD_FUNCTIONS[DATA_SOURCE_DEFAULTS[data_source]]


def auto_reward(prompts: list[str], responses: list[str], **columns) -> list[float]:
    """Score each row with the default reward of its ``data_source`` (rows grouped per source)."""
    if "data_source" not in columns:
        raise ValueError("reward 'auto' needs a 'data_source' column; name a reward function instead")
    columns = {key: list(values) for key, values in columns.items()}
    sources = columns["data_source"]
    scores = [0.0] * len(responses)
    for source in dict.fromkeys(sources):
        rows = [i for i, s in enumerate(sources) if s == source]
        picked = {key: [values[i] for i in rows] for key, values in columns.items()}
        fn = reward_fn_for_data_source(source)
        for i, score in zip(rows, fn([prompts[i] for i in rows], [responses[i] for i in rows], **picked)):
            scores[i] = float(score)
    return scores


def _bad_spec(spec: object, why: str) -> ValueError:
    forms = ", ".join(SPEC_FORMS).format(names=", ".join(sorted([*REWARD_FUNCTIONS, "auto"])))
    return ValueError(f"bad reward spec {spec!r}: {why}. Accepted forms: {forms}")


def load_reward_fn(spec: str | RewardFn) -> RewardFn:
    """Resolve a reward spec (see the module docstring) to a callable; a callable is returned as is.

    Raises:
        ValueError: the spec has none of the accepted forms, names a missing file, module or attribute, or the
            attribute is not callable; the message names the spec and the accepted forms.
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise _bad_spec(spec, "expected a non-empty string")
    if spec == "auto":
        return auto_reward
    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[spec]
    if ":" not in spec:
        raise _bad_spec(spec, "not a registered name and no ':function_name' part")
    # rsplit: a Windows path ("C:\\x\\r.py:fn") has a colon of its own.
    target, function_name = spec.rsplit(":", 1)
    if not function_name.isidentifier():
        raise _bad_spec(spec, f"{function_name!r} is not a function name")
    module = _load_file(spec, target) if target.endswith(".py") else _import_module(spec, target)
    fn = getattr(module, function_name, None)
    if fn is None:
        raise _bad_spec(spec, f"{target!r} has no attribute {function_name!r}")
    if not callable(fn):
        raise _bad_spec(spec, f"{target}:{function_name} is a {type(fn).__name__}, not a function")
    _remember_spec(fn, spec)
    logger.info("loaded reward function %s", spec)
    return fn


def _load_file(spec: str, file: str):
    path = Path(file).expanduser()
    if not path.is_file():
        raise _bad_spec(spec, f"file {str(path)!r} does not exist")
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:10]
    name = f"_rlflow_reward_{path.stem}_{digest}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    # The module sits in sys.modules only while it runs (dataclasses and typing look it up there). Left out
    # afterwards, cloudpickle ships its functions to Ray workers by value, where the file path may not exist.
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        e.add_note(f"while loading reward file {str(path)!r} for spec {spec!r}")
        raise
    finally:
        sys.modules.pop(name, None)
    return module


def _import_module(spec: str, module_name: str):
    if not all(part.isidentifier() for part in module_name.split(".")):
        raise _bad_spec(spec, f"{module_name!r} is neither a .py file nor a dotted module name")
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):  # the named module itself is missing, not its imports
            raise _bad_spec(spec, f"module {module_name!r} cannot be imported ({e})") from e
        raise


def _remember_spec(fn: Callable, spec: str) -> None:
    try:
        fn.__rlflow_reward_spec__ = spec
    except (AttributeError, TypeError):
        pass  # builtins and some callables take no attributes; error messages fall back to the qualname


def describe_reward_fn(fn: Callable) -> str:
    """A name for error messages: the spec it was loaded by, else module.qualname."""
    spec = getattr(fn, "__rlflow_reward_spec__", None)
    if spec:
        return spec
    qualname = getattr(fn, "__qualname__", type(fn).__name__)
    return f"{getattr(fn, '__module__', '?')}.{qualname}"


class RewardFunctionError(ValueError):
    """The reward function raised: a bug in it (or a column the data lacks), not a fault a restart would cure."""


def compute_scores(reward_fn: RewardFn, prompts: Sequence[str], responses: Sequence[str], **columns) -> list[float]:
    """Call ``reward_fn(prompts, responses, **columns)`` and return its scores as finite floats.

    Raises:
        RewardFunctionError: the function raised; the message names it and the line that raised.
        ValueError: inputs of different lengths, or the function returned something other than one finite
            number per response; the message names the function.
    """
    n = len(responses)
    lengths = {"prompts": len(prompts), **{k: len(v) for k, v in columns.items()}}
    wrong = {k: v for k, v in lengths.items() if v != n}
    if wrong:
        raise ValueError(f"compute_scores got {n} responses but lengths {wrong}; pass one value per response")
    name = describe_reward_fn(reward_fn)
    try:
        result = reward_fn(list(prompts), list(responses), **{k: list(v) for k, v in columns.items()})
    except Exception as error:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        raise RewardFunctionError(
            f"reward function {name} raised {type(error).__name__}: {error} ({frame.filename} line {frame.lineno})"
        ) from error
    if isinstance(result, (str, bytes, dict)) or not hasattr(result, "__len__"):
        raise ValueError(f"reward function {name} must return a list of floats, got {type(result).__name__}")
    try:
        scores = [float(s) for s in result]
    except Exception as e:  # float() of a str, None, a multi-element tensor, ...
        raise ValueError(f"reward function {name} returned a score that is not a number: {e}") from e
    if len(scores) != n:
        raise ValueError(f"reward function {name} returned {len(scores)} scores for {n} responses; return one each")
    bad = [i for i, s in enumerate(scores) if not math.isfinite(s)]
    if bad:
        raise ValueError(f"reward function {name} returned non-finite scores at positions {bad[:10]}")
    return scores
