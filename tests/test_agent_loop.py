"""The multi-turn loop (rlworkers/workers/rollout/agent_loop.py) against hand-built trajectories: a scripted backend
stands in for the model (it returns the turns a test writes), SmolLM2's real tokenizer and chat template render
everything else.
What the real rollouts do on top (HF and vLLM sampling the turns) is in tests/test_agent_rollouts.py."""

from __future__ import annotations

import pytest

from rlworkers.data.batching import prompt_batch
from rlworkers.models.loading import load_tokenizer
from rlworkers.models.smollm2 import default_smollm2_model_dir, ensure_smollm2_model
from rlworkers.tools.function_tool import FunctionTool
from rlworkers.workers.config import MultiTurnConfig
from rlworkers.workers.rollout import TurnOutput
from rlworkers.workers.rollout.agent_loop import AgentLoop

MODEL_LOG_PROB = -0.5  # what the scripted model says each of its tokens had


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_smollm2_model(default_smollm2_model_dir()))


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def broken(x: int) -> int:
    """A tool that always fails.

    Args:
        x: anything
    """
    raise RuntimeError("the service is down")


class ScriptedModel:
    """``generate_turns`` for the loop: row i's k-th turn is ``turns[i][k]`` (text) and the stop token. A context is
    matched to its row by what that row has seen and said so far (the loop asks for the unfinished rows only).
    Records every context a row was given."""

    def __init__(self, tokenizer, turns: list[list[str]]):
        self.tokenizer, self.turns = tokenizer, turns
        self.calls = [0] * len(turns)
        self.contexts: list[list[list[int]]] = [[] for _ in turns]
        self.said: list[list[int] | None] = [None] * len(turns)  # last context + last output, per row

    def __call__(self, contexts, budgets):
        outputs, claimed = [], set()
        for context, budget in zip(contexts, budgets):
            row = next(
                i
                for i, said in enumerate(self.said)
                if i not in claimed and (said is None or context[: len(said)] == said)
            )
            claimed.add(row)
            self.contexts[row].append(context)
            text = self.turns[row][self.calls[row]]
            self.calls[row] += 1
            ids = (self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id])[:budget]
            self.said[row] = context + ids
            outputs.append(TurnOutput(ids, [MODEL_LOG_PROB] * len(ids), stopped=ids[-1] == self.tokenizer.eos_token_id))
        return outputs


def prompts_of(tokenizer, questions: list[str], **columns):
    rows = [{"prompt": [{"role": "user", "content": q}], "answer": "", **columns} for q in questions]
    return prompt_batch(rows, tokenizer)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def run(loop: AgentLoop, prompts, model, response_length=256):
    return loop.generate_sequences(prompts, response_length, model)


def test_a_tool_call_and_its_result_are_one_sequence_with_the_model_tokens_masked_in(tokenizer):
    call = '<tool_call>{"name": "multiply", "arguments": {"a": 123, "b": 45}}</tool_call>'
    model = ScriptedModel(tokenizer, [[call, "The answer is 5535."], ["It is 12."]])
    loop = AgentLoop(MultiTurnConfig(enable=True, tools=["x.py:multiply"]), tokenizer, [FunctionTool(multiply)])
    prompts = prompts_of(tokenizer, ["What is 123*45?", "What is 3*4?"])
    out = run(loop, prompts, model)

    eos = tokenizer.eos_token_id
    turn1, turn2 = ids(tokenizer, call) + [eos], ids(tokenizer, "The answer is 5535.") + [eos]
    tool_turn = ids(tokenizer, "\n<|im_start|>tool\n5535<|im_end|>\n<|im_start|>assistant\n")
    expected = turn1 + tool_turn + turn2
    response = out.batch["responses"][0].tolist()
    assert response[: len(expected)] == expected
    assert set(response[len(expected) :]) == {tokenizer.pad_token_id}
    mask = out.batch["response_mask"][0].tolist()
    assert mask[: len(expected)] == [1] * len(turn1) + [0] * len(tool_turn) + [1] * len(turn2)
    assert sum(mask) == len(turn1) + len(turn2)
    prompt_width = prompts.batch["input_ids"].shape[1]
    assert out.batch["attention_mask"][0, prompt_width:].sum().item() == len(expected)  # tool tokens are context
    log_probs = out.batch["rollout_log_probs"][0].tolist()
    assert log_probs[: len(expected)] == [MODEL_LOG_PROB if m else 0.0 for m in mask[: len(expected)]]

    # the model's second turn saw exactly what the chat template renders for the conversation so far
    conversation = [
        {"role": "user", "content": "What is 123*45?"},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "5535"},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert model.contexts[0][1] == ids(tokenizer, rendered)

    trajectory = out.non_tensor_batch["trajectory"][0]
    assert [m["role"] for m in trajectory] == ["assistant", "tool", "assistant"]
    assert trajectory[0]["tool_calls"] == [{"name": "multiply", "arguments": {"a": 123, "b": 45}}]
    assert trajectory[1]["content"] == "5535" and trajectory[1]["error"] is None
    assert list(out.non_tensor_batch["agent/turns"]) == [2, 1]
    assert list(out.non_tensor_batch["agent/tool_calls"]) == [1, 0]
    assert list(out.non_tensor_batch["agent/cut"]) == [0, 0]
    assert out.non_tensor_batch["uid"][0] == prompts.non_tensor_batch["uid"][0]  # GRPO groups by prompt


def test_failing_and_unknown_tools_become_observations_and_counts(tokenizer):
    turns = [
        '<tool_call>{"name": "broken", "arguments": {"x": 1}}</tool_call>',
        '<tool_call>{"name": "divide", "arguments": {"a": 1}}</tool_call>',
        "<tool_call>{not json</tool_call>",
        "I give up.",
    ]
    model = ScriptedModel(tokenizer, [turns])
    tools = [FunctionTool(multiply), FunctionTool(broken)]
    loop = AgentLoop(MultiTurnConfig(enable=True, tools=["x.py:f"], max_assistant_turns=8), tokenizer, tools)
    out = run(loop, prompts_of(tokenizer, ["Help"]), model)
    trajectory = out.non_tensor_batch["trajectory"][0]
    errors = [m["error"] for m in trajectory if m["role"] == "tool"]
    assert errors == ["exception", "unknown_tool", "malformed_call"]
    tool_texts = [m["content"] for m in trajectory if m["role"] == "tool"]
    assert "the service is down" in tool_texts[0] and "multiply" in tool_texts[1]  # the model learns what exists
    assert out.non_tensor_batch["agent/tool_errors"][0] == 3
    assert out.non_tensor_batch["agent/errors/exception"][0] == 1
    assert out.non_tensor_batch["agent/errors/unknown_tool"][0] == 1
    assert out.non_tensor_batch["agent/turns"][0] == 4


def test_the_token_budget_cuts_a_trajectory_without_overrunning_it(tokenizer):
    call = '<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>'
    model = ScriptedModel(tokenizer, [[call, "The answer, after a long explanation of how products work, is 6."]])
    loop = AgentLoop(MultiTurnConfig(enable=True, tools=["x.py:multiply"]), tokenizer, [FunctionTool(multiply)])
    budget = len(ids(tokenizer, call)) + 1 + 20  # the call, its stop token and 20 more tokens
    out = run(loop, prompts_of(tokenizer, ["2*3?"]), model, response_length=budget)
    assert out.batch["responses"].shape[1] == budget
    assert out.non_tensor_batch["agent/cut"][0] == 1
    assert out.batch["attention_mask"][0, -budget:].sum().item() == budget  # filled to the last token, not beyond


def test_max_assistant_turns_ends_a_model_that_keeps_calling(tokenizer):
    call = '<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>'
    model = ScriptedModel(tokenizer, [[call] * 10])
    config = MultiTurnConfig(enable=True, tools=["x.py:multiply"], max_assistant_turns=3)
    out = run(AgentLoop(config, tokenizer, [FunctionTool(multiply)]), prompts_of(tokenizer, ["2*3?"]), model)
    assert out.non_tensor_batch["agent/turns"][0] == 3
    assert out.non_tensor_batch["agent/tool_calls"][0] == 2  # the third turn's call is not run: nothing would read it
    assert out.non_tensor_batch["trajectory"][0][-1]["role"] == "assistant"


class GuessTheNumber:
    """An environment: says "wrong, try again" until the model's turn contains the row's number."""

    closed: list[str] = []

    def reset(self, row: dict):
        self.answer = row["secret"]
        return None

    async def step(self, message: str):
        if self.answer in message:
            return None, 1.0, True
        return "Wrong, try again.", -0.1, False

    def close(self):
        GuessTheNumber.closed.append(self.answer)


def test_an_environment_gives_feedback_as_a_user_turn_and_its_rewards_add_up(tokenizer):
    GuessTheNumber.closed = []
    model = ScriptedModel(tokenizer, [["41", "42"], ["7"]])
    config = MultiTurnConfig(enable=True, environment="x.py:GuessTheNumber", max_assistant_turns=4)
    loop = AgentLoop(config, tokenizer, [], GuessTheNumber)
    prompts = prompts_of(tokenizer, ["Guess", "Guess"], secret="42")
    prompts.non_tensor_batch["secret"][1] = "7"
    out = run(loop, prompts, model)
    eos = tokenizer.eos_token_id
    feedback = ids(tokenizer, "\n<|im_start|>user\nWrong, try again.<|im_end|>\n<|im_start|>assistant\n")
    expected = ids(tokenizer, "41") + [eos] + feedback + ids(tokenizer, "42") + [eos]
    assert out.batch["responses"][0].tolist()[: len(expected)] == expected
    assert out.batch["response_mask"][0].sum().item() == len(ids(tokenizer, "41") + ids(tokenizer, "42")) + 2
    assert list(out.non_tensor_batch["agent/reward"]) == pytest.approx([0.9, 1.0])
    assert list(out.non_tensor_batch["agent/turns"]) == [2, 1]
    assert sorted(GuessTheNumber.closed) == ["42", "7"]


@pytest.mark.parametrize("limit", [{"max_assistant_turns": 3}, {"max_user_turns": 2}])
def test_the_environment_judges_the_last_answer_a_limit_allows(tokenizer, limit):
    """Three tries (two feedback turns): the third answer is scored, though no feedback may follow it."""
    model = ScriptedModel(tokenizer, [["40", "41", "42", "43"], ["1", "2", "3", "4"]])
    config = MultiTurnConfig(enable=True, environment="x.py:GuessTheNumber", **limit)
    prompts = prompts_of(tokenizer, ["Guess", "Guess"], secret="42")
    out = run(AgentLoop(config, tokenizer, [], GuessTheNumber), prompts, model)
    assert list(out.non_tensor_batch["agent/turns"]) == [3, 3]
    assert list(out.non_tensor_batch["agent/reward"]) == pytest.approx([0.8, -0.3])  # right at the third, never
    assert [m["role"] for m in out.non_tensor_batch["trajectory"][1]][-2:] == ["user", "assistant"]


class CountingTool(FunctionTool):
    """multiply, counting its instances."""

    live: set = set()
    released: list = []

    async def create(self, instance_id=None, **kwargs):
        instance_id, response = await super().create(instance_id, **kwargs)
        CountingTool.live.add(instance_id)
        return instance_id, response

    async def release(self, instance_id, **kwargs):
        CountingTool.live.discard(instance_id)
        CountingTool.released.append(instance_id)


def test_tool_instances_are_released_when_the_rollout_fails_midway(tokenizer):
    CountingTool.live, CountingTool.released = set(), []
    call = '<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>'
    model = ScriptedModel(tokenizer, [[call, "6"], [call, "6"]])

    def failing_model(contexts, budgets):
        if model.calls[0] == 1:
            raise RuntimeError("the engine died")
        return model(contexts, budgets)

    loop = AgentLoop(MultiTurnConfig(enable=True, tools=["x.py:multiply"]), tokenizer, [CountingTool(multiply)])
    with pytest.raises(RuntimeError, match="the engine died"):
        run(loop, prompts_of(tokenizer, ["2*3?", "2*3?"]), failing_model)
    assert len(CountingTool.released) == 2 and not CountingTool.live


def test_a_turn_cut_by_max_turn_tokens_is_closed_by_the_template_and_the_trajectory_goes_on(tokenizer):
    GuessTheNumber.closed = []
    model = ScriptedModel(tokenizer, [["I think it is one hundred and six", "42"]])
    config = MultiTurnConfig(enable=True, environment="x.py:GuessTheNumber", max_turn_tokens=5)
    prompts = prompts_of(tokenizer, ["Guess"], secret="42")
    out = run(AgentLoop(config, tokenizer, [], GuessTheNumber), prompts, model)
    first = ids(tokenizer, "I think it is one hundred and six")[:5]  # no stop token: the turn ran out of tokens
    closing = ids(tokenizer, "<|im_end|>\n<|im_start|>user\nWrong, try again.<|im_end|>\n<|im_start|>assistant\n")
    expected = first + closing + ids(tokenizer, "42") + [tokenizer.eos_token_id]
    assert out.batch["responses"][0].tolist()[: len(expected)] == expected
    answer = len(ids(tokenizer, "42")) + 1  # and its stop token
    assert out.batch["response_mask"][0].tolist()[: len(expected)] == [1] * 5 + [0] * len(closing) + [1] * answer
    assert out.non_tensor_batch["agent/cut"][0] == 0 and out.non_tensor_batch["agent/turns"][0] == 2
