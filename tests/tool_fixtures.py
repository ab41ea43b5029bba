"""Tool functions for tests/test_tools.py: module-level, so a worker process imports them."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

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
    os._exit(code)



def _arrive(directory: str) -> float:
    Path(directory, f"{os.getpid()}-{time.monotonic_ns()}").touch()
    return time.time()


def _report(directory: str, parties: int, started: float) -> str:
    """What a meeting call returns: its process, its own start and end, and whether all met."""
    met = len(list(Path(directory).iterdir())) >= parties
    return json.dumps({"pid": os.getpid(), "started": started, "ended": time.time(), "met": met})


def meet(directory: str, parties: int, patience: float) -> str:
    """Arrive, then wait until `parties` calls have arrived (or `patience` seconds pass).

    Calls that run one after another never all meet, so `met` proves they ran at once.

    Args:
        directory: where each call leaves a file to say it arrived
        parties: how many calls must arrive
        patience: how long to wait for them, in seconds
    """
    started = _arrive(directory)
    while len(list(Path(directory).iterdir())) < parties and time.time() - started < patience:
        time.sleep(0.01)
    return _report(directory, parties, started)


async def ameet(directory: str, parties: int, patience: float) -> str:
    """`meet` as a coroutine: its calls meet only if they run at once on one event loop.

    Args:
        directory: where each call leaves a file to say it arrived
        parties: how many calls must arrive
        patience: how long to wait for them, in seconds
    """
    started = _arrive(directory)
    while len(list(Path(directory).iterdir())) < parties and time.time() - started < patience:
        await asyncio.sleep(0.01)
    return _report(directory, parties, started)


async def anap(seconds: float, marker: str) -> str:
    """Sleep without blocking the event loop, then give the process id; if cancelled, write
    the process id to `marker` first.

    Args:
        seconds: how long to sleep
        marker: the file written when the call is cancelled
    """
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        Path(marker).write_text(str(os.getpid()))
        raise
    return str(os.getpid())
