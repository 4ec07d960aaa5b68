"""A tool and an environment for the built-in arithmetic task (``make demo-agent``, tests), and examples of the two
interfaces a user writes (``rollout.multi_turn.tools`` / ``.environment``).

- ``add``: a calculator tool (``rollout.multi_turn.tools: [rlworkers.agents.examples:add]``): sums of 3-4-digit
  numbers are beyond what SmolLM2-135M does in its head, and easy with the tool.
- ``RetryArithmetic``: an environment that answers a wrong final number with "Wrong, try again." (the model gets
  ``max_user_turns`` more tries) and rewards a right one, less for each retry
  (``rollout.multi_turn.environment: rlworkers.agents.examples:RetryArithmetic``, ``reward.reward_fn: environment``).
"""

from __future__ import annotations

import re

from rlworkers.data.batching import ground_truth_of

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def add(a: int, b: int) -> int:
    """Add two integers and return their sum.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


class RetryArithmetic:
    """One arithmetic question per trajectory: the last number of a turn is the answer; a right one ends the
    trajectory with reward ``1 / (1 + retries)``, a wrong one gets "Wrong, try again."."""

    feedback = "Wrong, try again."

    def reset(self, row: dict) -> None:
        self.answer = str(ground_truth_of(row, "answer"))
        self.retries = 0

    def step(self, message: str) -> tuple[str | None, float, bool]:
        numbers = NUMBER.findall(message.replace(",", ""))
        if numbers and numbers[-1] == self.answer:
            return None, 1.0 / (1 + self.retries), True
        self.retries += 1
        return self.feedback, 0.0, False
