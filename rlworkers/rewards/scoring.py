"""Validated scoring: ``compute_reward_values(reward_fn, prompts, responses, **columns)`` calls a (loaded) reward
function and checks its result: ``(scores, extras)``. ``compute_scores(...)`` is the same call, scores only. What a
reward function may return is in rlworkers.rewards.registry's docstring.
"""

from __future__ import annotations

import logging
import math
import numbers
import traceback
from collections.abc import Mapping, Sequence

from rlworkers.rewards.registry import RESERVED_COLUMNS, MissingGroundTruthError, RewardFn, describe_reward_fn

logger = logging.getLogger(__name__)


class RewardFunctionError(ValueError):
    """The reward function raised: a bug in it (or a column the data lacks), not a fault a restart would cure."""


def compute_reward_values(
    reward_fn: RewardFn, prompts: Sequence[str], responses: Sequence[str], /, **columns
) -> tuple[list[float], dict[str, list[float]]]:
    """Call ``reward_fn(prompts, responses, **columns)`` (rlflow's batch signature: pass a function through
    ``load_reward_fn``/``as_batch_reward_fn`` first) and return ``(scores, extras)``: one finite float per response,
    and for each extra key of the dicts it returned, one float per response (NaN where a row has none).

    Raises:
        RewardFunctionError: the function raised; the message names it and the line that raised.
        ValueError: inputs of different lengths, a column named ``prompts`` or ``responses``, or the function
            returned something other than one finite number (or dict with a finite ``score``) per response; the
            message names the function.
    """
    n = len(responses)
    lengths = {"prompts": len(prompts), **{k: len(v) for k, v in columns.items()}}
    wrong = {k: v for k, v in lengths.items() if v != n}
    if wrong:
        raise ValueError(f"compute_scores got {n} responses but lengths {wrong}; pass one value per response")
    name = describe_reward_fn(reward_fn)
    clash = [k for k in RESERVED_COLUMNS if k in columns]
    if clash:
        raise ValueError(
            f"the data has columns {clash}, the names of reward function {name}'s first two arguments "
            "(prompts, responses); rename those columns in the dataset"
        )
    try:
        result = reward_fn(list(prompts), list(responses), **{k: list(v) for k, v in columns.items()})
    except MissingGroundTruthError:
        raise  # the data's fault, not the function's: its message names the reward, the row and the fix
    except Exception as error:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        raise RewardFunctionError(
            f"reward function {name} raised {type(error).__name__}: {error} ({frame.filename} line {frame.lineno})"
        ) from error
    if isinstance(result, (str, bytes, Mapping)) or not hasattr(result, "__len__"):
        raise ValueError(
            f"reward function {name} must return a list of floats (or of dicts with a 'score'), "
            f"got {type(result).__name__}"
        )
    scores, extras = _split_results(list(result), name)
    if len(scores) != n:
        raise ValueError(f"reward function {name} returned {len(scores)} scores for {n} responses; return one each")
    bad = [i for i, s in enumerate(scores) if not math.isfinite(s)]
    if bad:
        raise ValueError(f"reward function {name} returned non-finite scores at positions {bad[:10]}")
    return scores, extras


def compute_scores(reward_fn: RewardFn, prompts: Sequence[str], responses: Sequence[str], /, **columns) -> list[float]:
    """``compute_reward_values``' scores alone (the same checks and errors)."""
    return compute_reward_values(reward_fn, prompts, responses, **columns)[0]


_warned_extras: set[tuple[str, str]] = set()


def _split_results(results: list, name: str) -> tuple[list[float], dict[str, list[float]]]:
    """Per-row results (numbers, or dicts with ``score`` and extras) -> (scores, {extra key: one float per row})."""
    scores: list[float] = []
    for i, value in enumerate(results):
        if isinstance(value, Mapping):
            if "score" not in value:
                raise ValueError(
                    f"reward function {name} returned a dict without 'score' for row {i} (keys "
                    f"{sorted(map(str, value))}); return a number, or a dict with the reward under 'score' "
                    "(its other keys are logged as reward_extra/<key>), e.g. {'score': 1.0, 'acc': True}"
                )
            value = value["score"]
        try:
            scores.append(float(value))
        except Exception as e:  # float() of a str, None, a list, a multi-element tensor, ...
            raise ValueError(f"reward function {name} returned a score that is not a number (row {i}): {e}") from e
    dicts = [value if isinstance(value, Mapping) else {} for value in results]
    keys = dict.fromkeys(key for d in dicts for key in d if key != "score")
    extras: dict[str, list[float]] = {}
    for key in keys:
        column = [_as_number(d.get(key)) for d in dicts]
        bad = next((i for i, v in enumerate(column) if v is _NOT_A_NUMBER), None)
        if bad is None and all(math.isnan(v) for v in column):
            bad = next(i for i, d in enumerate(dicts) if key in d)
        if bad is not None:
            if (name, str(key)) not in _warned_extras:
                _warned_extras.add((name, str(key)))
                logger.warning(
                    "reward function %s returned %r for extra key %r (row %d): extra values must be numbers or "
                    "bools; %r is left out of the reward's extras (warned once)",
                    name,
                    dicts[bad].get(key),
                    key,
                    bad,
                    key,
                )
            continue
        extras[str(key)] = column
    return scores, extras


_NOT_A_NUMBER = object()


def _as_number(value) -> float | object:
    """A float for a number, bool, or 0-d array/tensor; NaN for None; ``_NOT_A_NUMBER`` for anything else."""
    if value is None:
        return math.nan
    if getattr(value, "shape", None) == () and hasattr(value, "item"):  # numpy scalars, 0-d arrays and tensors
        value = value.item()
    if isinstance(value, numbers.Real):  # bool and numpy's numbers too
        return float(value)
    return _NOT_A_NUMBER
