"""Comments and docstrings in the code say why, not how fast on one machine: a measured time ("~30 ms here",
"7-13 s", "0.12 CPU-s a check") goes stale with the next machine or change, and belongs in docs/performance.md
with the date, the CPU and the command that measured it."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a duration with a unit of time as a measurement states it: "~30 ms", "7-10 ms", "0.12 CPU-s", "~9 CPU-seconds",
# "0.14 s a step"; not a setting's value in words ("every 2 s", "a 600 s limit" are not preceded by ~ or a range)
MEASURED = re.compile(
    r"~\s?\d+(\.\d+)?\s?(ms|s|CPU-s|CPU-seconds|seconds)\b"
    r"|\b\d+(\.\d+)?-\d+(\.\d+)?\s?(ms|s)\b"
    r"|\b\d+(\.\d+)?\s?(ms|CPU-s|CPU-seconds)\b"
)


def commentary(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring-like string (a string statement) of a Python file; every comment
    line of a YAML file."""
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        return [(n, line.split("#", 1)[1]) for n, line in enumerate(text.splitlines(), 1) if "#" in line]
    found, previous = [], None
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            found.append((token.start[0], token.string))
        elif token.type == tokenize.STRING and previous in (tokenize.INDENT, tokenize.NEWLINE, tokenize.DEDENT, None):
            found.append((token.start[0], token.string))
        if token.type not in (tokenize.NL, tokenize.COMMENT):
            previous = token.type
    return found


def test_no_measured_times_in_code_comments():
    files = [
        p for package in ("flows", "rlworkers") for p in (ROOT / package).rglob("*") if p.suffix in (".py", ".yaml")
    ]
    stale = [
        f"{path.relative_to(ROOT)}:{line}: {match.group(0)!r}"
        for path in files
        for line, text in commentary(path)
        for match in [MEASURED.search(text)]
        if match
    ]
    assert not stale, "measured times in code comments (move them to docs/performance.md):\n" + "\n".join(stale)


def test_the_check_finds_a_measured_time_in_a_comment_and_a_docstring(tmp_path):
    source = tmp_path / "example.py"
    source.write_text('def f():\n    """Fast: ~30 ms here."""\n    return 1  # 7-10 ms per call\n\nLIMIT = "600 ms"\n')
    found = [text for _, text in commentary(source) if MEASURED.search(text)]
    assert found == ['"""Fast: ~30 ms here."""', "# 7-10 ms per call"]  # the string constant is code, not a comment
