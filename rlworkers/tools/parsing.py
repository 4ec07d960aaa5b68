"""Reading tool calls out of a model's turn (Hermes format), and telling the model which tools it has.

``parse_tool_calls(text)`` reads the format of verl's ``HermesToolParser``
(``verl/experimental/agent_loop/tool_parser.py``, itself vLLM's hermes parser), which Qwen2.5 and Hermes models
write::

    <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>

As in verl, calls are the non-greedy matches of ``<tool_call>(.*?)</tool_call>`` across lines, and the content is
the text with those blocks removed. Unlike verl, which logs a call it cannot decode and drops it, each malformed
call here is an entry in ``ParsedTurn.errors`` (the rollout shows it to the model as an error observation):
invalid JSON, no "name", arguments that are not an object, an unclosed ``<tool_call>`` (its text is left out of
the content too). Arguments written as a JSON string holding an object (``"arguments": "{\\"a\\": 1}"``) are
decoded, as verl's ``OpenAIFunctionCallSchema.from_openai_function_parsed_schema`` decodes its JSON string; missing
arguments are ``{}`` (a tool without parameters).

``tools_system_prompt(schemas)`` is the default for chat templates that ignore ``tools=`` (SmolLM2's ChatML
template does; ``template_supports_tools(tokenizer)`` tells): the schemas described in a system message, in the
wording of Qwen2.5's template, short enough for a 135M model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_CALL_PATTERN = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
SNIPPET_CHARS = 80


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    """A model's turn read for tool calls: the text outside the calls, the calls in order, one error per bad call."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def parse_tool_calls(text: str) -> ParsedTurn:
    """Read the Hermes tool calls of one turn (see the module docstring); never raises for what the model wrote."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for index, match in enumerate(TOOL_CALL_PATTERN.finditer(text), start=1):
        call_or_error = _read_call(match.group(1))
        if isinstance(call_or_error, ToolCall):
            calls.append(call_or_error)
        else:
            errors.append(f"tool call {index}: {call_or_error}")
    content = TOOL_CALL_PATTERN.sub("", text)
    unclosed = content.find(TOOL_CALL_START)
    if unclosed >= 0:
        errors.append(
            f"unclosed {TOOL_CALL_START}: {_snippet(content[unclosed:])} has no {TOOL_CALL_END} "
            "(the turn ended before the call did)"
        )
        content = content[:unclosed]
    return ParsedTurn(content=content, calls=calls, errors=errors)


def _read_call(body: str) -> ToolCall | str:
    """The call written in one ``<tool_call>`` block, or why it is malformed."""
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as e:
        return f"invalid JSON ({e}) in {_snippet(body)}"
    if not isinstance(payload, dict):
        return f"expected a JSON object with a name and arguments, got {_snippet(body)}"
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return f'no "name" (a non-empty string) in {_snippet(body)}'
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            return f"the arguments of {name!r} are a string but not JSON ({e})"
    if not isinstance(arguments, dict):
        return f"the arguments of {name!r} must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(name=name, arguments=arguments)


def _snippet(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= SNIPPET_CHARS else text[:SNIPPET_CHARS] + "...")


def tools_system_prompt(schemas: list[dict]) -> str:
    """A system message describing the tools (OpenAI tool schemas as dicts) and how to call them.

    For chat templates without tool support; the wording is Qwen2.5's template's. Results come back in a turn of
    role ``tool``.
    """
    lines = "\n".join(json.dumps(schema, ensure_ascii=False) for schema in schemas)
    return (
        "# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        f"{TOOL_CALL_START}{TOOL_CALL_END} XML tags:\n"
        f'{TOOL_CALL_START}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{TOOL_CALL_END}\n\n'
        "The result of each call comes back to you in a message from the tool."
    )


PROBE_TOOL_NAME = "rlflow_probe_tool_7f3a"
PROBE_TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": PROBE_TOOL_NAME,
        "description": "A probe.",
        "parameters": {"type": "object", "properties": {}, "required": []},
    },
}


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders the ``tools=`` it is given.

    Renders one user message with a probe tool and looks for the probe's name. False for a tokenizer without a
    chat template, and for a template that fails on ``tools=``.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        return False
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hello."}], tools=[PROBE_TOOL_SCHEMA], tokenize=False
        )
    except Exception:  # a template that raises on tools does not support them, whatever the reason
        return False
    return PROBE_TOOL_NAME in rendered
