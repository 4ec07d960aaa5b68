"""Rule-based rewards, one response at a time: exact match, GSM8K final answer, answer format.

- ``exact_answer_reward``: 1.0 when the response equals the ground truth after stripping whitespace (the
  built-in addition task).
- ``extract_gsm8k_answer`` / ``gsm8k_reward``: the GSM8K convention where a solution ends in ``#### 42``;
  the same rule as verl's ``gsm8k.compute_score`` ("strict" reads the last ``####`` answer, "flexible" the
  last number), extended to ``$`` signs and to numeric comparison ("42.0" equals "42").
- ``last_number_reward``: the last number of the response against the ground truth (the built-in chat task).
- ``format_reward``: ``score`` when the response matches a regex (by default the ``#### <number>`` line).

Batch-level functions with the user-facing signature are built from these in rlworkers.rewards.registry.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# Regex on very long generations is slow and the answer sits at the end: look at the tail only (as verl does).
_CLIP_CHARS = 300
_NUMBER = r"-?\s*\$?\s*-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
_STRICT = re.compile(r"####\s*(" + _NUMBER + ")")
_FLEXIBLE = re.compile(_NUMBER)
GSM8K_FORMAT_PATTERN = r"####\s*" + _NUMBER


def exact_answer_reward(response: str, ground_truth: str) -> float:
    """1.0 when ``response`` equals ``ground_truth`` after stripping surrounding whitespace, else 0.0."""
    return 1.0 if response.strip() == str(ground_truth).strip() else 0.0


def _clean_number(text: str) -> str:
    """Drop ``$``, commas and inner spaces; move a sign written after ``$`` to the front ("$-5" -> "-5")."""
    text = re.sub(r"[\s$,]", "", text)
    negative = text.count("-") % 2 == 1
    return ("-" if negative else "") + text.replace("-", "")


def extract_gsm8k_answer(text: str, method: str = "strict") -> str | None:
    """Return the final answer of a GSM8K-style solution, or None when there is none.

    ``"strict"`` takes the number after the last ``####`` (``"#### $1,234"`` -> ``"1234"``); ``"flexible"``
    takes the last number anywhere in the text.

    Raises:
        ValueError: unknown method.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"unknown method {method!r}; use 'strict' or 'flexible'")
    tail = text[-_CLIP_CHARS:]
    pattern = _STRICT if method == "strict" else _FLEXIBLE
    found = pattern.findall(tail)
    return _clean_number(found[-1]) if found else None


def _same_number(a: str, b: str) -> bool:
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return a == b


def gsm8k_reward(
    response: str, ground_truth: str, *, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """``score`` for the right final answer, ``format_score`` for a wrong but extractable one, 0.0 otherwise.

    ``ground_truth`` may be the bare answer ("72") or a full reference solution ending in ``#### 72``.
    """
    answer = extract_gsm8k_answer(response, method=method)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    expected = extract_gsm8k_answer(truth) if "####" in truth else _clean_number(truth.strip())
    return score if expected is not None and _same_number(answer, expected) else format_score


def last_number_reward(response: str, ground_truth: str) -> float:
    """1.0 when the last number of ``response`` equals ``ground_truth`` ("12 + 34 = 46" and "46" both answer 46), the
    way a chat model answers a sum; 0.0 otherwise (verl gsm8k's "flexible" extraction)."""
    return gsm8k_reward(response, ground_truth, method="flexible")


def format_reward(
    response: str, ground_truth: str | None = None, *, pattern: str = GSM8K_FORMAT_PATTERN, score: float = 1.0
) -> float:
    """``score`` when ``pattern`` (a regex) occurs in ``response``, else 0.0; ``ground_truth`` is ignored."""
    return score if re.search(pattern, response) else 0.0
