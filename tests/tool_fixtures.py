"""Tool functions for tests/test_tools.py: module-level, so a worker process imports them."""

from __future__ import annotations

import time

ALLOWED = set("0123456789+-*/(). ")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: digits and + - * / ( ), e.g. "12 * (3 + 4)"
    """
    if not set(expression) <= ALLOWED:
        raise ValueError(f"only digits and + - * / ( ) are allowed, got {expression!r}")
    return str(eval(expression, {"__builtins__": {}}))  # safe: the characters are checked above


def nap(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: how long to sleep
    """
    time.sleep(seconds)
    return f"slept {seconds}"


def undocumented(x: int) -> int:
    return x


def crash(code: int) -> str:
    """End the worker process at once, as a segfault or the OOM killer would.

    Args:
        code: the exit code
    """
    import os

    os._exit(code)
