"""Guarded calls of user functions (rewards, tools): each runs in child processes, concurrently,
with a time limit per call; nothing a user function does can take the training run down.

    result.py     CallResult (a call's value or error), GuardedError (the function cannot be used)
    pool.py       GuardedPool (the parent side: the queue, workers on demand, deadlines)
    process.py    one worker from the parent's side: spawn, pipes, request and reply lines, kill
    worker.py     the child: imports the function, answers calls (plain: one at a time; async: all at once)

The names are loaded on first use, so a worker process (which imports this package first)
does not pay for the parent's imports: a pool starts its workers on demand, many at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .pool import GuardedPool
    from .result import CallResult, GuardedError

# Where each name lives, loaded on first use.
HOMES = {"CallResult": "result", "GuardedError": "result", "GuardedPool": "pool"}

__all__ = ["CallResult", "GuardedError", "GuardedPool"]


def __getattr__(name: str) -> Any:
    if name in HOMES:
        import importlib

        return getattr(importlib.import_module(f".{HOMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
