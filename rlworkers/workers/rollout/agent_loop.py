"""Multi-turn rollouts: the model's turns interleaved with tool results and environment observations.

``AgentLoop.generate_sequences(prompts, request, generate_turns)`` takes a batch of prompts (already rendered with
the chat template and the tools, see ``rlworkers.data.chat.render_prompt``) and, for every trajectory at once:

1. generates the model's next turn (``generate_turns``: the rollout backend's batched call, HF or vLLM) until it ends
   its turn (a stop token) or the trajectory's token budget (``rollout.response_length``) runs out;
2. parses its tool calls (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, verl's Hermes format) and
   runs them, every trajectory's calls concurrently, each under ``multi_turn.tool_timeout_s``; or, without calls,
   hands the turn to the environment (``step``), when the run has one; without either the trajectory is done;
3. appends the results (``tool`` turns) or the observation (a ``user`` turn) rendered by the chat template, with
   loss mask 0, and goes on, until no trajectory is left: the model answered without a call, the environment said
   done, ``max_assistant_turns`` / ``max_user_turns``, or the token budget (the trajectory is then "cut").

The output is the single-turn rollout's contract (``rlworkers.workers.rollout``): ``responses [B, R]`` hold everything
after the prompt, ``response_mask`` is 1 on the model's own tokens only (so log-probs, advantages, KL and every loss
see only those), ``attention_mask`` is 1 on every real token (tool results are context), ``rollout_log_probs`` are
the sampled tokens' (0 elsewhere). Non-tensor columns added: ``trajectory`` (the turns after the prompt as chat
messages; an assistant turn lists its parsed ``tool_calls``, a tool turn its ``error`` kind or None), and the numbers
``agent/turns``, ``agent/tool_calls``, ``agent/tool_errors``, ``agent/tool_seconds``, ``agent/cut`` (1 when the
budget cut the trajectory), ``agent/reward`` (environment step rewards + the tools' ``calc_reward``), and
``agent/errors/<kind>`` for each kind of tool error (``rlworkers.tools.execution``). GRPO/RLOO groups stay the
``n`` whole trajectories of one prompt: the ``uid`` column is the prompt's.

Tools and environments run here, in the rollout worker's process (``rlworkers.tools.execution`` says how), never in
the controller. A tool or environment that fails gives the model an error observation and a count in the metrics;
every tool instance is released and every environment closed when its trajectory ends, however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlworkers.agents.environment import call
from rlworkers.protocol import DataProto
from rlworkers.tools.execution import ERROR_KINDS, ToolSession
from rlworkers.tools.parsing import parse_tool_calls
from rlworkers.workers.rollout import TurnOutput, rollout_output

TURN_MARKER = "\x1fturn-content\x1f"  # stands for an assistant turn's text when finding what follows its end


# (contexts: prompt + response so far, per trajectory; max new tokens per trajectory) -> one TurnOutput each
GenerateTurns = Callable[[list[list[int]], list[int]], list[TurnOutput]]


@dataclass
class Trajectory:
    row: dict  # the row's non-tensor columns (tools_kwargs, extra_info, ground_truth, ...)
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    tool_errors: Counter = field(default_factory=Counter)
    tool_seconds: float = 0.0
    reward: float = 0.0
    done: bool = False
    cut: bool = False

    def append(self, ids: list[int], mask: int, log_probs: list[float] | None = None) -> None:
        self.response_ids += ids
        self.loss_mask += [mask] * len(ids)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(ids)


class AgentLoop:
    """The multi-turn loop of one rollout worker: its tools (loaded once), the environment class, the tokenizer."""

    def __init__(self, config, tokenizer, tools: list, environment_class: type | None = None):
        self.config = config  # rlworkers.workers.config.MultiTurnConfig
        self.tokenizer = tokenizer
        self.tools = {tool.name: tool for tool in tools}
        self.environment_class = environment_class

    # ------------------------------------------------------------------------------------------------ the loop
    def generate_sequences(self, prompts: DataProto, response_length: int, generate_turns: GenerateTurns) -> DataProto:
        """Every row of ``prompts`` (already repeated ``n`` times) played to its end; the output described above."""
        rows = [
            {key: values[i] for key, values in prompts.non_tensor_batch.items()} for i in range(len(prompts))
        ]  # fmt: skip
        ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
        trajectories = [Trajectory(row, ids[i][mask[i].bool()].tolist()) for i, row in enumerate(rows)]
        loop = asyncio.new_event_loop()  # closed without waiting for abandoned tool threads (see tools.execution)
        try:
            loop.run_until_complete(self._play(trajectories, response_length, generate_turns))
        finally:
            with contextlib.suppress(Exception):
                loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
        return self._output(prompts, trajectories, response_length)

    async def _play(self, trajectories: list[Trajectory], response_length: int, generate_turns: GenerateTurns):
        async with contextlib.AsyncExitStack() as stack:
            sessions = [
                await stack.enter_async_context(ToolSession(self.tools, t.row.get("tools_kwargs") or {}))
                for t in trajectories
            ]
            environments = [await self._environment(t, stack, response_length) for t in trajectories]
            while active := [i for i, t in enumerate(trajectories) if not t.done]:
                contexts = [trajectories[i].prompt_ids + trajectories[i].response_ids for i in active]
                budgets = [self._turn_budget(trajectories[i], response_length) for i in active]
                outputs = generate_turns(contexts, budgets)
                for i, output in zip(active, outputs):
                    self._add_model_turn(trajectories[i], output, response_length)
                await asyncio.gather(
                    *(
                        self._respond(trajectories[i], sessions[i], environments[i], response_length)
                        for i in active
                        if not trajectories[i].done
                    )
                )
            for t, session in zip(trajectories, sessions):
                t.reward += await session.calc_reward()

    async def _environment(self, t: Trajectory, stack: contextlib.AsyncExitStack, response_length: int):
        """A fresh environment for ``t`` (closed with the trajectory), its first observation appended; or None."""
        if self.environment_class is None:
            return None
        environment = self.environment_class()
        if callable(getattr(environment, "close", None)):
            stack.push_async_callback(call, environment.close)
        observation = await call(environment.reset, t.row)
        if observation:
            self._append_messages(t, [{"role": "user", "content": str(observation)}], response_length)
        return environment

    def _turn_budget(self, t: Trajectory, response_length: int) -> int:
        """New tokens the next turn of ``t`` may have: what is left of the trajectory's, at most ``max_turn_tokens``."""
        left = response_length - len(t.response_ids)
        return left if self.config.max_turn_tokens is None else min(left, self.config.max_turn_tokens)

    def _add_model_turn(self, t: Trajectory, output: TurnOutput, response_length: int) -> None:
        left = response_length - len(t.response_ids)
        ids = output.token_ids[:left]
        t.append(ids, 1, output.log_probs[: len(ids)])
        t.assistant_turns += 1
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        t.messages.append({"role": "assistant", "content": text, "tool_calls": []})
        if not output.stopped and len(ids) >= left:  # the trajectory's budget ran out mid-turn: no answer to judge
            t.done = t.cut = True
        # a turn that reached max_turn_tokens without ending goes on like one that ended: the template's end of
        # turn follows it as context (continuation_ids)

    async def _respond(self, t: Trajectory, session: ToolSession, environment, response_length: int) -> None:
        """Tool results for the calls of ``t``'s last turn, or the environment's observation; or the end of ``t``."""
        turn = t.messages[-1]
        last_turn = t.assistant_turns >= self.config.max_assistant_turns
        parsed = parse_tool_calls(turn["content"]) if self.tools else None
        if parsed is not None and (parsed.calls or parsed.errors):
            if last_turn:  # no turn is left to read the results
                t.done = True
                return
            calls = parsed.calls[: self.config.max_parallel_calls]
            turn["tool_calls"] = [{"name": c.name, "arguments": c.arguments} for c in calls]
            outcomes = await session.run(
                calls,
                parsed.errors,
                self.config.tool_timeout_s,
                self.config.max_tool_response_length,
                self.config.tool_response_truncate_side,
            )
            t.tool_calls += len(outcomes)
            t.tool_errors.update(o.error for o in outcomes if o.error)
            t.tool_seconds += sum(o.seconds for o in outcomes)
            t.reward += sum(o.reward for o in outcomes)
            messages = [{"role": "tool", "content": o.text, "name": o.name, "error": o.error} for o in outcomes]
        elif environment is not None:  # every answer is judged, the last one too; only its feedback may go unsaid
            started = time.perf_counter()
            observation, reward, done = await call(environment.step, turn["content"])
            t.tool_seconds += time.perf_counter() - started
            t.reward += float(reward)
            out_of_user_turns = self.config.max_user_turns is not None and t.user_turns >= self.config.max_user_turns
            if done or not observation or last_turn or out_of_user_turns:
                t.done = True
                return
            t.user_turns += 1
            messages = [{"role": "user", "content": str(observation)}]
        else:
            t.done = True
            return
        self._append_messages(t, messages, response_length)

    def _append_messages(self, t: Trajectory, messages: list[dict], response_length: int) -> None:
        """``messages`` (tool results or an observation) as the chat template renders them after the model's turn,
        then the next assistant header; a trajectory they do not fit is cut."""
        t.messages += messages
        ids = self.continuation_ids(messages, t.response_ids[-1] if t.response_ids else None)
        if len(t.response_ids) + len(ids) >= response_length:
            t.done = t.cut = True
            return
        t.append(ids, 0)

    def continuation_ids(self, messages: list[dict], last_token: int | None) -> list[int]:
        """The tokens that follow a model turn ending in ``last_token`` (its stop token; None at the start) when
        ``messages`` come next: the rest of the template's end of turn (ChatML's newline after ``<|im_end|>``), the
        messages, and the assistant header of the next turn. Read off the template by rendering a conversation with
        and without them (the template must render turn by turn: ChatML, Llama 3 and most others do)."""
        plain = [{"role": m["role"], "content": m["content"]} for m in messages]
        base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": TURN_MARKER}]
        render = self.tokenizer.apply_chat_template
        before = render(base, tokenize=False)
        after = render(base + plain, tokenize=False, add_generation_prompt=True)
        if not after.startswith(before):
            raise ValueError(
                "the chat template renders a conversation differently once more turns follow, so multi-turn "
                "rollouts cannot extend it turn by turn; use a model whose template renders turn by turn (ChatML)"
            )
        end_of_turn = before[before.rindex(TURN_MARKER) + len(TURN_MARKER) :]
        generated_end = self.tokenizer.decode([last_token]) if last_token is not None else ""
        if generated_end and end_of_turn.startswith(generated_end):
            end_of_turn = end_of_turn[len(generated_end) :]  # the model wrote that part itself
        return self.tokenizer(end_of_turn + after[len(before) :], add_special_tokens=False)["input_ids"]

    # ------------------------------------------------------------------------------------------------ output
    def _output(self, prompts: DataProto, trajectories: list[Trajectory], response_length: int) -> DataProto:
        size = (len(trajectories), response_length)
        pad = self.tokenizer.pad_token_id
        responses = torch.full(size, pad, dtype=torch.long)
        response_mask = torch.zeros(size, dtype=torch.long)
        attention = torch.zeros(size, dtype=torch.long)
        log_probs = torch.zeros(size, dtype=torch.float32)
        for i, t in enumerate(trajectories):
            n = len(t.response_ids)
            responses[i, :n] = torch.tensor(t.response_ids, dtype=torch.long)
            response_mask[i, :n] = torch.tensor(t.loss_mask, dtype=torch.long)
            attention[i, :n] = 1
            log_probs[i, :n] = torch.tensor(t.log_probs, dtype=torch.float32)
        columns = {"trajectory": [t.messages for t in trajectories]}
        columns["agent/turns"] = [t.assistant_turns for t in trajectories]
        columns["agent/tool_calls"] = [t.tool_calls for t in trajectories]
        columns["agent/tool_errors"] = [sum(t.tool_errors.values()) for t in trajectories]
        columns["agent/tool_seconds"] = [t.tool_seconds for t in trajectories]
        columns["agent/cut"] = [int(t.cut) for t in trajectories]
        columns["agent/reward"] = [t.reward for t in trajectories]
        for kind in ERROR_KINDS:
            columns[f"agent/errors/{kind}"] = [t.tool_errors[kind] for t in trajectories]
        return rollout_output(prompts, responses, response_mask, log_probs, attention, columns)


def build_agent_loop(config, tokenizer) -> AgentLoop | None:
    """The loop ``rollout.multi_turn`` describes (its tools and environment loaded here, in the rollout worker), or
    None when it is off."""
    if not config.enable:
        return None
    from rlworkers.agents.environment import load_environment_class
    from rlworkers.tools.loading import load_tools, tools_from_config

    tools = load_tools(config.tools) + (tools_from_config(config.tool_config_path) if config.tool_config_path else [])
    environment = load_environment_class(config.environment) if config.environment else None
    return AgentLoop(config, tokenizer, tools, environment)
