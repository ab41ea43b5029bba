"""Guarded calls of user code (rewards, tools, environments, scorers): each under a time limit,
concurrently, its faults returned as data; nothing user code does can take the training run down.

A user function named `module:qualname` runs in child processes (`GuardedPool`); an object that
lives in this process (an environment, a dataset's scorer) is called here (`call_guarded`).

    result.py     CallResult (a call's value or error), GuardedError (the function cannot be used)
    pool.py       GuardedPool (the parent side: the queue, workers on demand, deadlines)
    process.py    one worker from the parent's side: spawn, pipes, request and reply lines, kill
    worker.py     the child: imports the function, answers calls (plain: one at a time; async: all at once)
    inprocess.py  call_guarded: an object of this process, on a thread of its own (or its event loop)

The names are loaded on first use, so a worker process (which imports this package first)
does not pay for the parent's imports: a pool starts its workers on demand, many at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .inprocess import call_guarded
    from .pool import GuardedPool
    from .result import CallResult, GuardedError

# Where each name lives, loaded on first use.
HOMES = {"CallResult": "result", "GuardedError": "result", "GuardedPool": "pool", "call_guarded": "inprocess"}

__all__ = ["CallResult", "GuardedError", "GuardedPool", "call_guarded"]


def __getattr__(name: str) -> Any:
    if name in HOMES:
        import importlib

        return getattr(importlib.import_module(f".{HOMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
