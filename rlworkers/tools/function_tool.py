"""``FunctionTool``: a plain typed Python function (sync or async) used as a tool.

The schema the model sees comes from the function's signature and its Google-style docstring, through
``transformers.utils.get_json_schema``: every parameter needs a type hint and a line under ``Args:``::

    def add(a: int, b: int) -> int:
        \"\"\"Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        \"\"\"
        return a + b

Each parameter takes one JSON type (str, int, float, bool, list, dict; ``Literal[...]`` of strings for choices),
since verl's ``OpenAIFunctionPropertySchema`` has a single ``type`` and string ``enum``: ``int | str`` is refused,
and what that model has no field for is dropped (``items`` of a list, ``nullable`` of ``int | None``). A parameter
with a default is optional.

The call is ``fn(**arguments)``. An async function is awaited in the event loop; a sync one runs in a daemon thread
of its own (``run_in_daemon_thread``) so that a slow tool does not hold up the other calls, and a hung one holds
only its own thread (rlworkers.tools.execution says what happens to it). The value returned becomes the text the
model reads: a ``str`` as it is; an int, float or bool through ``str()``; a dict or list as JSON. Anything else
(None, bytes, other objects) raises ``NotTextResultError``, which the execution turns into an error observation of
kind "not_text".
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import json
import threading
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from transformers.utils import get_json_schema

from rlworkers.tools.base_tool import BaseTool
from rlworkers.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

DOCSTRING_FORM = (
    "a first line saying what the tool does ('Add two integers.'), then 'Args:' and one indented line per "
    "parameter ('a: The first integer.')"
)


class NotTextResultError(TypeError):
    """A tool returned a value that is not text and has no text form (None, bytes, an arbitrary object)."""


class FunctionTool(BaseTool):
    """A plain typed Python function as a tool; no per-trajectory state (create and release are BaseTool's)."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        super().__init__(config={}, tool_schema=function_tool_schema(fn))

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        """Call the function with ``parameters`` as keyword arguments; the reward is 0.0 and the metrics empty.

        Raises:
            NotTextResultError: the function returned a value with no text form.
            Exception: whatever the function raises (a wrong argument name raises TypeError here).
        """
        if inspect.iscoroutinefunction(self.fn):
            result = await self.fn(**parameters)
        else:
            result = await run_in_daemon_thread(self.fn, **parameters)
        return ToolResponse(text=result_as_text(result)), 0.0, {}


async def run_in_daemon_thread(fn: Callable[..., Any], /, **kwargs) -> Any:
    """``fn(**kwargs)`` in a daemon thread of its own, awaited. Unlike ``asyncio.to_thread`` (the loop's executor:
    ``min(32, CPUs + 4)`` threads, joined at exit), a call that never returns holds only its own thread: it takes
    no slot that later calls would queue behind, and it does not keep the worker process from exiting."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    context = contextvars.copy_context()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # the call's time limit cancelled it
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def call() -> None:
        try:
            result, error = context.run(fn, **kwargs), None
        except BaseException as raised:  # SystemExit too: the awaiting side decides what it means
            result, error = None, raised
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed meanwhile (the trajectory ended without this call)
            pass

    threading.Thread(target=call, name=f"tool {getattr(fn, '__name__', fn)}", daemon=True).start()
    return await future


def function_tool_schema(fn: Callable[..., Any]) -> OpenAIFunctionToolSchema:
    """The OpenAI tool schema of ``fn``, from its type hints and Google-style docstring.

    Raises:
        ValueError: a parameter has no type hint or no description under ``Args:``, the docstring has no
            description line, or a type has no single JSON type (the message names the function and the fix).
    """
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        schema = get_json_schema(fn)
    except Exception as e:
        raise ValueError(
            f"cannot describe function {name} as a tool: {e}. Fix: give every parameter a type hint and a line "
            f"under `Args:` in a Google-style docstring: {DOCSTRING_FORM}"
        ) from e
    function = schema["function"]
    if not function.get("description"):
        raise ValueError(
            f"cannot describe function {name} as a tool: its docstring has no description before `Args:`. "
            f"Fix: a docstring of {DOCSTRING_FORM}"
        )
    function["parameters"].setdefault("required", [])
    try:
        return OpenAIFunctionToolSchema.model_validate(schema)
    except ValidationError as e:
        raise ValueError(
            f"cannot describe function {name} as a tool: {e}. Fix: give each parameter one JSON type (str, int, "
            "float, bool, list, dict; Literal of strings for choices)"
        ) from e


def result_as_text(result: Any) -> str:
    """The text the model reads for a function's return value (see the module docstring).

    Raises:
        NotTextResultError: the value is None, bytes, another object, or a dict/list that JSON cannot encode.
    """
    if isinstance(result, str):
        return result
    if isinstance(result, int | float | bool):
        return str(result)
    if isinstance(result, dict | list):
        try:
            return json.dumps(result, ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise NotTextResultError(f"returned a {type(result).__name__} that JSON cannot encode ({e})") from e
    raise NotTextResultError(
        f"returned {type(result).__name__}, not text: return a str, a number, or a JSON-serialisable dict or list"
    )
