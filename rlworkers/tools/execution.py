"""Running the tool calls of one trajectory's turn, with time limits, and the tools' life over a trajectory.

Where tools execute: in the rollout worker process, in its asyncio event loop, beside the generation of the other
trajectories (never in the controller process). An async ``execute`` runs in the loop itself; a plain sync
function (FunctionTool) runs in a daemon thread of its own, so that one slow tool does not hold up the others. The
calls of one turn run concurrently, each under its own time limit (``timeout_s``). A thread cannot be killed: when a
sync function hangs, its time limit returns control to the loop and the trajectory goes on with a "timeout"
observation, while the thread is abandoned until the function returns. It holds nothing else: no executor slot
that later calls would queue behind (``asyncio.to_thread`` has ``min(32, CPUs + 4)``: six hung calls on two cores
would time out every later sync call), and being a daemon it does not keep the worker process from exiting.
No process pool instead: verl tools keep per-trajectory state in their own object (``create`` ... ``release``),
which a separate process would not share, and the results must come back within the turn.

A tool's fault is an observation for the model and a metric for the user, never an exception (DESIGN.md, Agents):
``run_calls`` returns one ``ToolOutcome`` per call, with ``error`` one of ERROR_KINDS:

- "unknown_tool": the model named no tool that exists (the text lists the known names);
- "malformed_call": the call could not be read (rlworkers.tools.parsing's error);
- "exception": the tool raised (the text has the exception's type and message, no traceback), or its ``create``
  failed earlier so that it is unavailable in this trajectory;
- "timeout": the call ran past ``timeout_s``;
- "not_text": the tool returned no text form (a FunctionTool's None, bytes or object; a verl tool's image or video,
  or a return value that is not ``(ToolResponse, reward, metrics)``).

Texts longer than ``max_response_chars`` are cut as verl's ``tool_response_truncate_side`` says
(``verl/experimental/agent_loop/tool_agent_loop.py``, ``_call_tool``): "middle" (the default) keeps head and tail
around ``...(truncated)...``, "left" keeps the head (``...(truncated)`` after it), "right" the tail
(``(truncated)...`` before it).

``ToolSession`` is one trajectory's tools: ``create`` on enter (with the row's ``tools_kwargs[name]["create_kwargs"]``,
passed as verl's agent loop passes them: ``create(create_kwargs=...)``), ``release`` always on exit, ``calc_reward``
summed over the tools. Unlike verl's agent loop, which creates and releases an instance around every single call,
an instance here lives for the whole trajectory, so a tool's state (verl's gsm8k tool's best answer) carries from
call to call and ``calc_reward`` can read it at the end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from rlworkers.tools.base_tool import BaseTool
from rlworkers.tools.function_tool import NotTextResultError
from rlworkers.tools.parsing import TOOL_CALL_END, TOOL_CALL_START, ToolCall
from rlworkers.tools.schemas import ToolResponse

logger = logging.getLogger(__name__)

ERROR_KINDS = ("unknown_tool", "malformed_call", "exception", "timeout", "not_text")
TRUNCATION_MARKER = "...(truncated)..."  # verl's marker for the middle side
EXCEPTION_MESSAGE_CHARS = 200


@dataclasses.dataclass(frozen=True)
class ToolOutcome:
    """What one call gave: the text the model reads, the tool's step reward and metrics, and the error kind (one of
    ERROR_KINDS) when it failed; ``name`` is empty for a malformed call."""

    name: str
    text: str
    reward: float = 0.0
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None
    seconds: float = 0.0


async def run_calls(
    tools: dict[str, BaseTool],
    instance_ids: dict[str, str],
    calls: list[ToolCall],
    malformed: list[str],
    timeout_s: float,
    max_response_chars: int,
    truncate_side: str = "middle",
) -> list[ToolOutcome]:
    """Run one turn's calls concurrently and return their outcomes: the calls' in order, then one per malformed call.

    ``instance_ids`` maps a tool's name to its instance in this trajectory; a tool in ``tools`` but not there
    failed to start and its calls get an "exception" outcome. Never raises for a tool's fault (module docstring);
    cancelling the caller cancels the calls.
    """
    outcomes = await asyncio.gather(*(_run_call(tools, instance_ids, call, timeout_s) for call in calls))
    outcomes += [
        ToolOutcome(
            name="",
            text=f"Error: malformed tool call: {error}. Write each call as "
            f'{TOOL_CALL_START}{{"name": ..., "arguments": {{...}}}}{TOOL_CALL_END}',
            error="malformed_call",
        )
        for error in malformed
    ]
    return [_truncated(outcome, max_response_chars, truncate_side) for outcome in outcomes]


async def _run_call(
    tools: dict[str, BaseTool], instance_ids: dict[str, str], call: ToolCall, timeout_s: float
) -> ToolOutcome:
    name = call.name
    if name not in tools:
        known = ", ".join(repr(known) for known in sorted(tools)) or "none"
        return ToolOutcome(
            name=name, text=f"Error: there is no tool {name!r}. Known tools: {known}", error="unknown_tool"
        )
    if name not in instance_ids:
        return ToolOutcome(
            name=name,
            text=f"Error: tool {name!r} is unavailable in this conversation (it failed to start)",
            error="exception",
        )
    start = time.monotonic()
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            returned = await tools[name].execute(instance_ids[name], dict(call.arguments))
        text, reward, metrics = _read_execute_result(returned)
    except TimeoutError as e:
        if deadline.expired():
            return _failed(name, f"Error: tool {name!r} took longer than {timeout_s:g} s", "timeout", start)
        return _failed(name, _exception_text(name, e), "exception", start)
    except NotTextResultError as e:
        return _failed(name, f"Error: tool {name!r} {e}", "not_text", start)
    except (Exception, SystemExit) as e:  # SystemExit: a tool calling sys.exit() must not end the worker
        return _failed(name, _exception_text(name, e), "exception", start)
    return ToolOutcome(name=name, text=text, reward=reward, metrics=metrics, seconds=time.monotonic() - start)


def _read_execute_result(returned: Any) -> tuple[str, float, dict]:
    """(text, reward, metrics) from what ``execute`` returned; verl's None reward and None text read as 0.0 and ""."""
    if not (isinstance(returned, tuple | list) and len(returned) == 3 and isinstance(returned[0], ToolResponse)):
        raise NotTextResultError(
            f"returned {type(returned).__name__}, not (ToolResponse, reward, metrics) as BaseTool.execute must"
        )
    response, reward, metrics = returned
    if response.image or response.video:
        raise NotTextResultError("returned an image or video: only text is shown to the model")
    return response.text or "", 0.0 if reward is None else float(reward), dict(metrics or {})


def _exception_text(name: str, error: BaseException) -> str:
    message = str(error)
    if len(message) > EXCEPTION_MESSAGE_CHARS:
        message = message[:EXCEPTION_MESSAGE_CHARS] + "..."
    return f"Error: tool {name!r} raised {type(error).__name__}: {message}"


def _failed(name: str, text: str, kind: str, start: float) -> ToolOutcome:
    logger.warning("%s (%s)", text, kind)
    return ToolOutcome(name=name, text=text, error=kind, seconds=time.monotonic() - start)


def _truncated(outcome: ToolOutcome, max_chars: int, side: str) -> ToolOutcome:
    """The outcome with its text cut to ``max_chars`` plus verl's marker for ``side`` (module docstring)."""
    text = outcome.text
    if len(text) <= max_chars:
        return outcome
    if side == "left":
        return dataclasses.replace(outcome, text=text[:max_chars] + "...(truncated)")
    if side == "right":
        return dataclasses.replace(outcome, text="(truncated)..." + text[len(text) - max_chars :])
    half = max_chars // 2
    return dataclasses.replace(outcome, text=text[:half] + TRUNCATION_MARKER + text[len(text) - half :])


class ToolSession:
    """The tools of one trajectory: an instance of each, created on enter and always released on exit.

    ``tools_kwargs`` is the row's ``tools_kwargs`` column (verl's: ``{name: {"create_kwargs": {...}}}``). A tool
    whose ``create`` raises or runs past ``lifecycle_timeout_s`` is unavailable for this trajectory (its calls get
    an error outcome); failures of create, calc_reward and release (each under ``lifecycle_timeout_s``) are logged
    and kept in ``errors``, never raised.

    Usage::

        async with ToolSession(tools_by_name(tools), row.get("tools_kwargs")) as session:
            turn = parse_tool_calls(text)
            outcomes = await session.run(turn.calls, turn.errors, timeout_s=10, max_response_chars=256)
            ...
            reward = await session.calc_reward()
    """

    def __init__(
        self,
        tools: dict[str, BaseTool],
        tools_kwargs: dict[str, Any] | None = None,
        *,
        lifecycle_timeout_s: float = 60.0,
    ):
        self.tools = tools
        self.tools_kwargs = tools_kwargs or {}
        self.lifecycle_timeout_s = lifecycle_timeout_s
        self.instance_ids: dict[str, str] = {}
        self.errors: list[str] = []

    async def __aenter__(self) -> ToolSession:
        try:
            await asyncio.gather(*(self._create(name) for name in self.tools))
        except BaseException:  # cancelled while creating: release what was created, as __aexit__ will not run
            await self._release_all()
            raise
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self._release_all()

    async def run(
        self,
        calls: list[ToolCall],
        malformed: list[str],
        timeout_s: float,
        max_response_chars: int,
        truncate_side: str = "middle",
    ) -> list[ToolOutcome]:
        """``run_calls`` with this trajectory's tool instances."""
        return await run_calls(
            self.tools, self.instance_ids, calls, malformed, timeout_s, max_response_chars, truncate_side
        )

    async def calc_reward(self) -> float:
        """The sum of ``calc_reward`` over the tools created for this trajectory; a tool whose ``calc_reward`` raises,
        returns no number or runs past the time limit adds 0.0 (and an entry in ``errors``)."""
        rewards = await asyncio.gather(
            *(
                self._guarded(name, "calc_reward", _as_float(tool.calc_reward(instance_id)))
                for name, tool, instance_id in self._live()
            )
        )
        return float(sum(reward for reward in rewards if reward is not None))

    async def _create(self, name: str) -> None:
        create_kwargs = (self.tools_kwargs.get(name) or {}).get("create_kwargs") or {}
        created = await self._guarded(name, "create", self.tools[name].create(create_kwargs=create_kwargs))
        if created is None:
            return
        # verl's create returns (instance_id, ToolResponse) since v0.6 (#2870); before, the id alone.
        instance_id = created if isinstance(created, str) else created[0]
        self.instance_ids[name] = instance_id

    async def _release_all(self) -> None:
        live = self._live()
        self.instance_ids = {}
        releases = asyncio.gather(
            *(self._guarded(name, "release", tool.release(instance_id)) for name, tool, instance_id in live)
        )
        # Shielded: a trajectory cancelled while its tools are being released still releases them all.
        await asyncio.shield(releases)

    def _live(self) -> list[tuple[str, BaseTool, str]]:
        return [(name, self.tools[name], instance_id) for name, instance_id in self.instance_ids.items()]

    async def _guarded(self, name: str, method: str, call) -> Any:
        """Await a tool's lifecycle call under the time limit; None (and an entry in ``errors``) when it fails."""
        deadline = asyncio.timeout(self.lifecycle_timeout_s)
        try:
            async with deadline:
                return await call
        except (Exception, SystemExit) as e:
            if isinstance(e, TimeoutError) and deadline.expired():
                error = f"tool {name!r}: {method} took longer than {self.lifecycle_timeout_s:g} s"
            else:
                error = f"tool {name!r}: {method} raised {type(e).__name__}: {e}"
            self.errors.append(error)
            logger.warning(error)
            return None


async def _as_float(reward) -> float:
    return float(await reward)
