"""The tool side of agent rollouts (rlworkers/tools): a plain typed function's schema, Hermes tool calls read from
the model's text, every way a tool can fail turned into an error outcome of the right kind, calls of one turn run
concurrently, ``release`` run whatever happens, and a verl tool written like verl's ``Gsm8kTool`` loaded through
verl's tool config YAML (by file path and by dotted name) and driven through create, execute, calc_reward, release.

Fast: no Ray, no servers; time limits of 0.2 s.
"""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
import threading
import time

import pytest
from transformers import AutoTokenizer

from rlworkers.models.smollm2 import default_smollm2_model_dir, ensure_smollm2_model
from rlworkers.models.tiny import build_char_tokenizer
from rlworkers.tools import (
    BaseTool,
    FunctionTool,
    ToolCall,
    ToolSession,
    load_tools,
    parse_tool_calls,
    run_calls,
    template_supports_tools,
    tools_by_name,
    tools_from_config,
    tools_system_prompt,
)
from rlworkers.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

# A tool written the way verl's verl/tools/gsm8k_tool.py is, after the import change.
GSM8K_LIKE_TOOL = """
from typing import Any, Optional
from uuid import uuid4

from rlworkers.rewards.rule import gsm8k_reward
from rlworkers.tools.base_tool import BaseTool
from rlworkers.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

RELEASED = []


class Gsm8kLikeTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    async def create(
        self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None, **kwargs
    ) -> tuple[str, ToolResponse]:
        if instance_id is None:
            instance_id = str(uuid4())
        if ground_truth is None:
            ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth", None)
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        answer = parameters.get("answer", "")
        if not isinstance(answer, str):
            answer = str(answer)
        self._instance_dict[instance_id]["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        tool_reward = 0.0 if reward > self._instance_dict[instance_id]["reward"] else -0.05
        self._instance_dict[instance_id]["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), tool_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instance_dict[instance_id]
        return gsm8k_reward(state["response"], state["ground_truth"], method="flexible")

    async def release(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
        RELEASED.append(instance_id)
"""

GSM8K_TOOL_SCHEMA = """
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k."
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""


def tool_config(tmp_path, class_name: str, extra_entries: str = "") -> str:
    path = tmp_path / "tool_config.yaml"
    path.write_text(f'tools:\n  - class_name: "{class_name}"\n    config:\n      type: native\n{GSM8K_TOOL_SCHEMA}')
    if extra_entries:
        path.write_text(path.read_text() + extra_entries)
    return str(path)


def add(a: int, b: float = 1.0, label: str = "sum") -> str:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
        label: What to call the result.
    """
    return f"{label}={a + b}"


def fn_tool(fn) -> FunctionTool:
    return FunctionTool(fn)


def text_schema(name: str) -> OpenAIFunctionToolSchema:
    return OpenAIFunctionToolSchema.model_validate(
        {"type": "function", "function": {"name": name, "description": f"The {name} tool."}}
    )


def run_turn(
    tools: list[BaseTool], text: str, *, timeout_s: float = 2.0, max_response_chars: int = 1000, after_turn=None
):
    """Parse ``text`` and run its calls in a fresh ToolSession; (outcomes, seconds the turn took)."""

    async def turn():
        async with ToolSession(tools_by_name(tools)) as session:
            start = time.monotonic()
            parsed = parse_tool_calls(text)
            outcomes = await session.run(parsed.calls, parsed.errors, timeout_s, max_response_chars)
            seconds = time.monotonic() - start
        if after_turn is not None:
            after_turn()
        return outcomes, seconds

    return asyncio.run(turn())


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


# --- schema of a plain typed function ---


def test_function_schema_from_signature_and_docstring():
    schema = FunctionTool(add).tool_schema.function
    assert schema.name == "add"
    assert schema.description == "Add two numbers."
    assert {name: p.type for name, p in schema.parameters.properties.items()} == {
        "a": "integer",
        "b": "number",
        "label": "string",
    }
    assert schema.parameters.required == ["a"]
    assert schema.parameters.properties["b"].description == "The second number."


def test_function_schema_errors_say_the_fix():
    def undocumented(a: int) -> int:
        """Return a."""
        return a

    def two_types(a: int | str) -> int:
        """Return a.

        Args:
            a: A number.
        """
        return a

    with pytest.raises(ValueError, match="undocumented.*Args:"):
        FunctionTool(undocumented)
    with pytest.raises(ValueError, match="one JSON type"):
        FunctionTool(two_types)


# --- parsing the Hermes format ---


def test_parse_one_call_and_text_around_it():
    turn = parse_tool_calls(f"Let me add. {call('add', a=1, b=2)} Done.")
    assert turn.calls == [ToolCall(name="add", arguments={"a": 1, "b": 2})]
    assert turn.content == "Let me add.  Done."
    assert turn.errors == []


def test_parse_two_calls_across_lines():
    turn = parse_tool_calls(
        f"<tool_call>\n{json.dumps({'name': 'a', 'arguments': {}})}\n</tool_call>\n{call('b', x=1)}"
    )
    assert [c.name for c in turn.calls] == ["a", "b"]
    assert turn.content == "\n"


def test_parse_text_without_calls():
    turn = parse_tool_calls("The answer is 4.")
    assert (turn.content, turn.calls, turn.errors) == ("The answer is 4.", [], [])


def test_parse_arguments_as_json_string_and_missing_arguments():
    turn = parse_tool_calls(
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call><tool_call>{"name": "now"}</tool_call>'
    )
    assert turn.calls == [ToolCall("add", {"a": 1}), ToolCall("now", {})]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>', "invalid JSON"),
        ('<tool_call>{"arguments": {"a": 1}}</tool_call>', 'no "name"'),
        ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "add", "arguments": "not json"}</tool_call>', "not JSON"),
        ("<tool_call>[1, 2]</tool_call>", "expected a JSON object"),
        ('ok <tool_call>{"name": "add", "arguments": {"a"', "unclosed <tool_call>"),
    ],
)
def test_malformed_calls_are_errors_not_exceptions(text, error):
    turn = parse_tool_calls(text)
    assert turn.calls == []
    assert len(turn.errors) == 1 and error in turn.errors[0]


def test_unclosed_call_after_a_good_one():
    turn = parse_tool_calls(f'a {call("add", a=1)} b <tool_call>{{"name": "add"')
    assert [c.name for c in turn.calls] == ["add"]
    assert turn.content == "a  b " and "unclosed" in turn.errors[0]


# --- every bad tool behaviour is an error outcome ---


def test_a_tool_that_raises_is_an_exception_outcome():
    def divide(a: int, b: int) -> float:
        """Divide.

        Args:
            a: Numerator.
            b: Denominator.
        """
        raise ValueError("b must not be zero")

    [outcome], _ = run_turn([fn_tool(divide)], call("divide", a=1, b=0))
    assert outcome.error == "exception"
    assert outcome.text == "Error: tool 'divide' raised ValueError: b must not be zero"
    assert "Traceback" not in outcome.text


def test_wrong_arguments_are_an_exception_outcome():
    [outcome], _ = run_turn([fn_tool(add)], call("add", x=1))
    assert outcome.error == "exception" and "TypeError" in outcome.text


def hanging_sync_tool(release: threading.Event, name: str) -> BaseTool:
    """A sync tool named ``name`` that returns only once ``release`` is set (or after 30 s)."""

    def hang(x: int) -> str:
        """Hang in a thread.

        Args:
            x: Ignored.
        """
        release.wait(30)
        return "late"

    hang.__name__ = hang.__qualname__ = name
    return fn_tool(hang)


def test_hung_tools_time_out_and_the_turn_returns():
    release_thread = threading.Event()

    async def hang_async(x: int) -> str:
        """Hang in the loop.

        Args:
            x: Ignored.
        """
        await asyncio.sleep(10)
        return "late"

    try:
        outcomes, seconds = run_turn(
            [hanging_sync_tool(release_thread, "hang_sync"), fn_tool(hang_async)],
            call("hang_sync", x=1) + call("hang_async", x=1),
            timeout_s=0.2,
            after_turn=release_thread.set,  # frees the abandoned thread as soon as the turn is over
        )
    finally:
        release_thread.set()
    assert [o.error for o in outcomes] == ["timeout", "timeout"]
    assert outcomes[0].text == "Error: tool 'hang_sync' took longer than 0.2 s"
    assert seconds < 1.0


def test_hung_sync_tools_leave_later_calls_free_to_run():
    """40 calls of a sync tool that never returns (more threads than an executor has: min(32, CPUs + 4)), then a
    quick one: each hung call holds only its own thread, so the quick call still answers in time."""
    release_threads = threading.Event()

    async def turns() -> list:
        tools = {"hang": hanging_sync_tool(release_threads, "hang"), "add": fn_tool(add)}
        ids = {"hang": "h", "add": "a"}
        hung = await run_calls(tools, ids, [ToolCall("hang", {"x": i}) for i in range(40)], [], 0.2, 100)
        quick = await run_calls(tools, ids, [ToolCall("add", {"a": 1, "b": 2})], [], 2.0, 100)
        return hung + quick

    try:
        outcomes = asyncio.run(turns())
    finally:
        release_threads.set()
    assert [o.error for o in outcomes[:40]] == ["timeout"] * 40
    assert outcomes[40].error is None and outcomes[40].text == "sum=3"
    assert all(t.daemon for t in threading.enumerate() if t.name == "tool hang")


@pytest.mark.parametrize("returned", [None, b"bytes", object()])
def test_a_result_without_text_form_is_not_text(returned):
    def bad(x: int) -> str:
        """Return something that is not text.

        Args:
            x: Ignored.
        """
        return returned

    [outcome], _ = run_turn([fn_tool(bad)], call("bad", x=1))
    assert outcome.error == "not_text" and type(returned).__name__ in outcome.text


def test_results_with_a_text_form():
    def value(kind: str):
        """Return a value of a kind.

        Args:
            kind: Which value.
        """
        return {"int": 3, "float": 0.5, "bool": True, "dict": {"a": [1, "é"]}, "list": [1, 2]}[kind]

    kinds = ["int", "float", "bool", "dict", "list"]
    outcomes, _ = run_turn([fn_tool(value)], "".join(call("value", kind=k) for k in kinds))
    assert [o.text for o in outcomes] == ["3", "0.5", "True", '{"a": [1, "é"]}', "[1, 2]"]
    assert all(o.error is None for o in outcomes)


def test_a_verl_tool_returning_an_image_or_a_bad_tuple_is_not_text():
    class ImageTool(BaseTool):
        async def execute(self, instance_id, parameters, **kwargs):
            return ToolResponse(image=["pixels"]), 0.0, {}

    class BareTextTool(BaseTool):
        async def execute(self, instance_id, parameters, **kwargs):
            return "just text"

    tools = [ImageTool({}, text_schema("image")), BareTextTool({}, text_schema("bare"))]
    outcomes, _ = run_turn(tools, call("image") + call("bare"))
    assert [o.error for o in outcomes] == ["not_text", "not_text"]
    assert "image or video" in outcomes[0].text and "not (ToolResponse, reward, metrics)" in outcomes[1].text


def test_unknown_tool_and_malformed_call():
    outcomes, _ = run_turn([fn_tool(add)], call("multiply", a=1) + '<tool_call>{"name": </tool_call>')
    assert [o.error for o in outcomes] == ["unknown_tool", "malformed_call"]
    assert outcomes[0].text == "Error: there is no tool 'multiply'. Known tools: 'add'"
    assert "invalid JSON" in outcomes[1].text and outcomes[1].name == ""


def test_long_texts_are_cut_on_the_side_asked():
    def long_text(n: int) -> str:
        """A long text.

        Args:
            n: Its length.
        """
        return "a" * (n // 2) + "z" * (n - n // 2)

    [outcome], _ = run_turn([fn_tool(long_text)], call("long_text", n=1000), max_response_chars=20)
    assert outcome.text == "a" * 10 + "...(truncated)..." + "z" * 10
    # verl's other sides: "left" keeps the head, "right" the tail
    for side, kept in (("left", "a" * 20 + "...(truncated)"), ("right", "(truncated)..." + "z" * 20)):
        outcomes = asyncio.run(
            run_calls({"long_text": fn_tool(long_text)}, {"long_text": "id"}, [ToolCall("long_text", {"n": 1000})], [],
                      timeout_s=2, max_response_chars=20, truncate_side=side)
        )  # fmt: skip
        assert outcomes[0].text == kept, side


def test_run_calls_with_instance_ids_of_its_own():
    tools = {"add": fn_tool(add), "idle": fn_tool(add)}
    calls = [ToolCall("add", {"a": 1}), ToolCall("idle", {"a": 1})]
    outcomes = asyncio.run(run_calls(tools, {"add": "id-1"}, calls, ["bad call"], timeout_s=1, max_response_chars=100))
    assert [o.text for o in outcomes][0] == "sum=2.0"
    assert [o.error for o in outcomes] == [None, "exception", "malformed_call"]
    assert "unavailable" in outcomes[1].text and outcomes[0].seconds >= 0


# --- concurrency ---


def test_calls_of_one_turn_run_concurrently():
    spans = {}

    def slow_sync(tag: str) -> str:
        """Sleep in a thread.

        Args:
            tag: A label.
        """
        start = time.monotonic()
        time.sleep(0.3)
        spans[tag] = (start, time.monotonic())
        return tag

    async def slow_async(tag: str) -> str:
        """Sleep in the loop.

        Args:
            tag: A label.
        """
        start = time.monotonic()
        await asyncio.sleep(0.3)
        spans[tag] = (start, time.monotonic())
        return tag

    text = call("slow_sync", tag="s1") + call("slow_sync", tag="s2") + call("slow_async", tag="a1")
    outcomes, _ = run_turn([fn_tool(slow_sync), fn_tool(slow_async)], text)
    assert [o.text for o in outcomes] == ["s1", "s2", "a1"]
    # Every call started before any call ended: they overlapped.
    assert max(start for start, _ in spans.values()) < min(end for _, end in spans.values())


# --- lifecycle: create, release always, calc_reward ---


class RecordingTool(BaseTool):
    """A verl-style tool that records its lifecycle calls; ``execute`` raises when asked to."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self.events: list[tuple[str, str]] = []

    async def create(self, instance_id=None, **kwargs):
        if kwargs.get("create_kwargs", {}).get("fail"):
            raise RuntimeError("no sandbox")
        instance_id, response = await super().create(instance_id)
        self.events.append(("create", instance_id))
        return instance_id, response

    async def execute(self, instance_id, parameters, **kwargs):
        if parameters.get("raise"):
            raise RuntimeError("tool broke")
        return ToolResponse(text="ok"), 0.5, {"calls": 1}

    async def calc_reward(self, instance_id, **kwargs):
        return 2.0

    async def release(self, instance_id, **kwargs):
        self.events.append(("release", instance_id))


def recording_tool(name: str = "rec") -> RecordingTool:
    return RecordingTool({"type": "native"}, text_schema(name))


def test_release_runs_when_execute_raises_and_when_the_body_raises():
    tool = recording_tool()

    async def trajectory():
        async with ToolSession({"rec": tool}) as session:
            [outcome] = await session.run([ToolCall("rec", {"raise": True})], [], 1, 100)
            assert outcome.error == "exception"
            raise KeyError("the trajectory failed")

    with pytest.raises(KeyError, match="the trajectory failed"):
        asyncio.run(trajectory())
    assert [event for event, _ in tool.events] == ["create", "release"]
    assert tool.events[0][1] == tool.events[1][1]


def test_release_runs_when_the_trajectory_is_cancelled():
    tool = recording_tool()

    async def main():
        entered = asyncio.Event()

        async def trajectory():
            async with ToolSession({"rec": tool}):
                entered.set()
                await asyncio.sleep(10)

        task = asyncio.create_task(trajectory())
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert [event for event, _ in tool.events] == ["create", "release"]


def test_a_failed_create_makes_only_that_tool_unavailable():
    broken, working = recording_tool("broken"), recording_tool("working")

    async def trajectory():
        tools_kwargs = {"broken": {"create_kwargs": {"fail": True}}, "working": None}
        async with ToolSession({"broken": broken, "working": working}, tools_kwargs) as session:
            outcomes = await session.run([ToolCall("broken", {}), ToolCall("working", {})], [], 1, 100)
            return outcomes, await session.calc_reward(), session.errors

    outcomes, reward, errors = asyncio.run(trajectory())
    assert outcomes[0].error == "exception" and "unavailable" in outcomes[0].text
    assert (outcomes[1].text, outcomes[1].reward, outcomes[1].metrics) == ("ok", 0.5, {"calls": 1})
    assert reward == 2.0  # only the working tool's
    assert errors == ["tool 'broken': create raised RuntimeError: no sandbox"]
    assert broken.events == [] and [e for e, _ in working.events] == ["create", "release"]


def test_hung_release_and_failing_calc_reward_are_errors_not_crashes():
    class BadEndTool(BaseTool):
        async def calc_reward(self, instance_id, **kwargs):
            raise ZeroDivisionError("no answer yet")

        async def release(self, instance_id, **kwargs):
            await asyncio.sleep(10)

    async def trajectory():
        session = ToolSession({"bad": BadEndTool({}, text_schema("bad"))}, lifecycle_timeout_s=0.2)
        async with session:
            reward = await session.calc_reward()
        return reward, session.errors

    reward, errors = asyncio.run(trajectory())
    assert reward == 0.0
    assert errors == [
        "tool 'bad': calc_reward raised ZeroDivisionError: no answer yet",
        "tool 'bad': release took longer than 0.2 s",
    ]


def test_a_pre_v06_create_returning_only_the_id_is_accepted():
    class OldTool(BaseTool):
        async def create(self, instance_id=None, **kwargs):
            return "old-id"

        async def execute(self, instance_id, parameters, **kwargs):
            return ToolResponse(text=instance_id), 0.0, {}

    [outcome], _ = run_turn([OldTool({}, text_schema("old"))], call("old"))
    assert outcome.text == "old-id"


# --- verl tools through the tool config YAML ---


def drive_gsm8k_tool(tools: list[BaseTool]) -> tuple[list, float, dict]:
    async def trajectory():
        tools_kwargs = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}
        outcomes = []
        async with ToolSession(tools_by_name(tools), tools_kwargs) as session:
            for answer in ("71", "72"):
                turn = parse_tool_calls(call("calc_gsm8k_reward", answer=answer))
                outcomes += await session.run(turn.calls, turn.errors, 1, 256)
            reward = await session.calc_reward()
            state = dict(tools[0]._instance_dict)
        return outcomes, reward, state

    return asyncio.run(trajectory())


def test_gsm8k_like_tool_from_a_file_path_class_name(tmp_path):
    tool_file = tmp_path / "gsm8k_like_tool.py"
    tool_file.write_text(GSM8K_LIKE_TOOL)
    [tool] = tools_from_config(tool_config(tmp_path, f"{tool_file}:Gsm8kLikeTool"))
    assert tool.name == "calc_gsm8k_reward" and tool.config == {"type": "native"}

    outcomes, reward, state = drive_gsm8k_tool([tool])
    assert [o.text for o in outcomes] == [
        "Current parsed answer='71' reward=0.0",
        "Current parsed answer='72' reward=1.0",
    ]
    assert [o.reward for o in outcomes] == [-0.05, 0.0]  # verl's penalty for an answer that did not improve
    assert reward == 1.0 and len(state) == 1
    assert tool._instance_dict == {}  # released
    assert type(tool).__module__ not in sys.modules  # a file module is not left in sys.modules


def test_gsm8k_like_tool_from_a_dotted_class_name(tmp_path, monkeypatch):
    package = tmp_path / "rlflow_test_verl_tools"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "gsm8k_like.py").write_text(GSM8K_LIKE_TOOL)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        [tool] = tools_from_config(tool_config(tmp_path, "rlflow_test_verl_tools.gsm8k_like.Gsm8kLikeTool"))
        _, reward, _ = drive_gsm8k_tool([tool])
        assert reward == 1.0
        assert len(sys.modules["rlflow_test_verl_tools.gsm8k_like"].RELEASED) == 1
    finally:
        for name in ("rlflow_test_verl_tools.gsm8k_like", "rlflow_test_verl_tools"):
            sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ("  - config: {type: native}\n", "no `class_name`"),
        ('  - class_name: "x.Y"\n    config: {type: mcp}\n', "mcp"),
        ('  - class_name: "x.Y"\n', "`config.type` must be `native`"),
        ('  - class_name: "surely_not_a_module_xyz.Tool"\n    config: {type: native}\n', "cannot be imported"),
        ('  - class_name: "json.JSONDecoder"\n    config: {type: native}\n', "not a subclass of rlworkers' BaseTool"),
        (
            '  - class_name: "rlworkers.tools.BaseTool"\n    config: {type: native}\n'
            "    tool_schema: {type: function}\n",
            "does not validate",
        ),
    ],
)
def test_a_bad_tool_config_entry_is_named(tmp_path, entry, why):
    tool_file = tmp_path / "gsm8k_like_tool.py"
    tool_file.write_text(GSM8K_LIKE_TOOL)
    path = tool_config(tmp_path, f"{tool_file}:Gsm8kLikeTool", extra_entries=entry)
    with pytest.raises(ValueError, match=r"tools\[1\]") as info:
        tools_from_config(path)
    assert why in str(info.value) and "tool_config.yaml" in str(info.value)


def test_a_tool_file_still_importing_verl_says_which_imports_to_change(tmp_path):
    tool_file = tmp_path / "unported.py"
    tool_file.write_text(GSM8K_LIKE_TOOL.replace("rlworkers.tools.base_tool", "verl.tools.base_tool"))
    with pytest.raises(ValueError, match=r"tools\[0\].*verl is not installed. Fix: port the tool.*rlworkers.tools"):
        tools_from_config(tool_config(tmp_path, f"{tool_file}:Gsm8kLikeTool"))


def test_a_tool_config_that_is_not_a_tools_list(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("tools: {a: [1\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        tools_from_config(str(path))
    path.write_text("tool: []\n")
    with pytest.raises(ValueError, match="no `tools:` list"):
        tools_from_config(str(path))


# --- function specs ---


def test_load_tools_from_specs_and_refusals(tmp_path):
    tool_file = tmp_path / "my_tools.py"
    tool_file.write_text(
        textwrap.dedent(
            '''
            from rlworkers.tools.base_tool import BaseTool

            class NotAFunction(BaseTool):
                pass

            def add(a: int, b: int) -> int:
                """Add two integers.

                Args:
                    a: The first integer.
                    b: The second integer.
                """
                return a + b
            '''
        )
    )
    [tool] = load_tools(f"{tool_file}:add")
    [outcome], _ = run_turn([tool], call("add", a=2, b=3))
    assert outcome.text == "5"
    with pytest.raises(ValueError, match="BaseTool class, not a function.*tool config YAML"):
        load_tools([f"{tool_file}:NotAFunction"])
    with pytest.raises(ValueError, match="does not exist.*Accepted forms"):
        load_tools([f"{tmp_path}/missing.py:add"])
    other_file = tmp_path / "other_tools.py"
    other_file.write_text(tool_file.read_text())
    with pytest.raises(ValueError, match=r"two tools are named 'add': tool spec .*my_tools.py:add.* and tool spec"):
        load_tools([f"{tool_file}:add", f"{other_file}:add"])


# --- prompts and chat templates ---

TOOLS_TEMPLATE = (
    "{% if tools %}{% for t in tools %}{{ t['function']['name'] }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
)
NO_TOOLS_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def test_template_supports_tools_on_small_templates():
    tokenizer = build_char_tokenizer()
    assert template_supports_tools(tokenizer) is False  # no chat template
    tokenizer.chat_template = NO_TOOLS_TEMPLATE
    assert template_supports_tools(tokenizer) is False
    tokenizer.chat_template = TOOLS_TEMPLATE
    assert template_supports_tools(tokenizer) is True


def test_smollm2_template_ignores_tools():
    folder = ensure_smollm2_model(default_smollm2_model_dir())  # built once (~30 s), then cached
    assert template_supports_tools(AutoTokenizer.from_pretrained(folder)) is False


def test_tools_system_prompt_names_the_tools_and_the_call_format():
    prompt = tools_system_prompt([FunctionTool(add).tool_schema.model_dump(exclude_unset=True, exclude_none=True)])
    assert '"name": "add"' in prompt and "The first number." in prompt
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in prompt
