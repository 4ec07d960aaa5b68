"""Loading of reward functions from a reward spec: a registered name, an explicitly named file or module, or a
callable. User code is loaded only from what the spec names (no scanning of folders, no ``eval``).

``load_reward_fn(spec)`` accepts exactly these forms:

- a registered name: "exact", "gsm8k", "last_number", "format", or "auto" (per row, by the ``data_source`` column,
  through DATA_SOURCE_DEFAULTS, e.g. "addition" -> "exact"); "exact", "gsm8k" and "last_number" score each row against
  its ground truth (``ground_truth``, else ``answer``, else ``reward_model["ground_truth"]``) and refuse a row that
  has none;
- "path/to/file.py:function_name": the file is executed as a fresh module, and the function taken from it;
- "package.module:function_name": the module is imported;
- a callable, taken as it is (a verl-signature one is wrapped).

A function it loads may have any of the three signatures (rlworkers.rewards.registry's docstring); a verl one is
wrapped into rlflow's batch signature.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from rlworkers.loading import UserCodeNotFoundError, import_module_named, load_file_module
from rlworkers.rewards.registry import (
    _STYLE_NAMES,
    REWARD_FUNCTIONS,
    RewardFn,
    as_batch_reward_fn,
    auto_reward,
    reward_fn_style,
)

logger = logging.getLogger(__name__)

SPEC_FORMS = (
    "a registered name ({names})",
    "'path/to/file.py:function_name'",
    "'package.module:function_name'",
)


def _bad_spec(spec: object, why: str) -> ValueError:
    forms = ", ".join(SPEC_FORMS).format(names=", ".join(sorted([*REWARD_FUNCTIONS, "auto"])))
    return ValueError(f"bad reward spec {spec!r}: {why}. Accepted forms: {forms}")


def load_reward_fn(spec: str | Callable) -> RewardFn:
    """Resolve a reward spec (see the module docstring) to a callable with rlflow's batch signature: a verl-signature
    function is wrapped (``as_batch_reward_fn``), any other returned as it is.

    Raises:
        ValueError: the spec has none of the accepted forms, names a missing file, module or attribute, or the
            attribute is not callable (the message names the spec and the accepted forms); or a verl-signature
            function requires parameters verl does not pass.
    """
    if callable(spec):
        return as_batch_reward_fn(spec)
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
    try:
        module = load_file_module(target, "reward", spec) if target.endswith(".py") else import_module_named(target)
    except UserCodeNotFoundError as e:
        raise _bad_spec(spec, str(e)) from e
    fn = getattr(module, function_name, None)
    if fn is None:
        raise _bad_spec(spec, f"{target!r} has no attribute {function_name!r}")
    if not callable(fn):
        raise _bad_spec(spec, f"{target}:{function_name} is a {type(fn).__name__}, not a function")
    _remember_spec(fn, spec)
    wrapped = as_batch_reward_fn(fn)
    logger.info("loaded reward function %s with %s", spec, _STYLE_NAMES[reward_fn_style(fn)])
    return wrapped


def _remember_spec(fn: Callable, spec: str) -> None:
    try:
        fn.__rlflow_reward_spec__ = spec
    except (AttributeError, TypeError):
        pass  # builtins and some callables take no attributes; error messages fall back to the qualname
