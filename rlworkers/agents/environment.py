"""Environments: multi-turn tasks where the model gets feedback that is not a tool's result.

An environment is a class the config names (``rollout.multi_turn.environment: path/to/file.py:ClassName`` or
``package.module:ClassName``), with one instance per trajectory (SkyRL-gym's and TRL's shape)::

    class GuessTheSum:
        def reset(self, row: dict) -> str | None:
            '''The row (every column of the dataset row); an observation to show before the first turn, or None.'''
        def step(self, message: str) -> tuple[str | None, float, bool]:
            '''The model's turn (its text) -> (observation for the model, reward, done).'''
        def close(self) -> None:   # optional: always called when the trajectory ends

Any of the three may be ``async``. The observation goes back to the model as a ``user`` turn; the rewards of a
trajectory's steps add up to its ``agent/reward`` column (``rlworkers.workers.rollout.agent_loop``), which the
``environment`` reward function returns and a user reward function can combine with its own score.
"""

from __future__ import annotations

import inspect
from typing import Any

from rlworkers.loading import UserCodeNotFoundError, import_module_named, load_file_module


def load_environment_class(spec: str) -> type:
    """The class ``spec`` names (``file.py:ClassName`` or ``module:ClassName``), checked for ``reset`` and ``step``.

    Raises:
        ValueError: the spec does not name a class with ``reset(row)`` and ``step(message)``.
    """
    field = "rollout.multi_turn.environment"
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"{field}={spec!r}: expected 'path/to/file.py:ClassName' or 'package.module:ClassName'")
    target, name = spec.rsplit(":", 1)
    try:
        module = (
            load_file_module(target, "environment", spec) if target.endswith(".py") else import_module_named(target)
        )
    except UserCodeNotFoundError as error:
        raise ValueError(f"{field}={spec!r}: {error}") from error
    cls = getattr(module, name, None)
    if cls is None:
        raise ValueError(f"{field}={spec!r}: {target!r} has no attribute {name!r}")
    if not inspect.isclass(cls):
        raise ValueError(f"rollout.multi_turn.environment={spec!r} is a {type(cls).__name__}, not a class")
    missing = [name for name in ("reset", "step") if not callable(getattr(cls, name, None))]
    if missing:
        raise ValueError(
            f"rollout.multi_turn.environment={spec!r}: the class has no {' or '.join(missing)} method. An environment "
            "needs reset(row) -> first observation or None, and step(message) -> (observation, reward, done)"
        )
    return cls


async def call(method, *args) -> Any:
    """``method(*args)``, awaited when it is a coroutine function (environments may be sync or async)."""
    result = method(*args)
    return await result if inspect.isawaitable(result) else result
