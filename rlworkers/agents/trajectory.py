"""Trajectories as a person reads them (the MLflow samples table)."""

from __future__ import annotations


def trajectory_text(messages: list[dict]) -> str:
    """A trajectory as a person reads it in the samples table: one block per turn, each call and each result."""
    lines = []
    for message in messages:
        if message["role"] == "tool":
            error = f" [{message['error']}]" if message.get("error") else ""
            lines.append(f"[tool {message.get('name') or '?'}{error}] {message['content']}")
        else:
            lines.append(f"[{message['role']}] {message['content']}")
    return "\n".join(lines)
