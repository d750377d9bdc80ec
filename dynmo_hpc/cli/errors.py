"""How a user error reaches the terminal: one ``error: <problem>; HINT: <fix>`` line, exit 2.

Why one line: batch logs, CI output and ``grep error:`` all read the last line; a multi-line
message (a YAML mark, an option listing, argparse's usage block) splits the problem from its fix.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import NoReturn

_BULLET = re.compile(r"^\s*-\s+")
"""The ``  - `` that starts each item of a multi-line listing."""


def error_line(problem: object, hint: str) -> str:
    """``error: <problem>; HINT: <fix>`` on one line; ``hint`` is used when ``problem`` has none."""
    parts = [_BULLET.sub("", line).strip() for line in str(problem).splitlines()]
    text = "; ".join(p for p in parts if p).replace(":;", ":")
    if "HINT:" not in text:
        text = f"{text}; HINT: {hint}"
    return f"error: {text}"


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one ``error:`` line (exit 2) instead of a usage block."""

    def error(self, message: str) -> NoReturn:
        print(error_line(f"{self.prog}: {message}", f"see {self.prog} --help"), file=sys.stderr)
        raise SystemExit(2)
