"""Guarded calls of user functions (rewards, tools): each runs in child processes, concurrently,
with a time limit per call; nothing a user function does can take the training run down.

    pool.py     GuardedPool (the parent side: the queue, workers on demand, deadlines), Outcome, GuardedError
    process.py  one worker from the parent's side: spawn, pipes, reply lines, kill
    worker.py   the child: imports the function, answers calls (plain: one at a time; async: all at once)

The names are loaded on first use, so a worker process (which imports this package first)
does not pay for the parent's imports: a pool starts its workers on demand, many at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .pool import GuardedError, GuardedPool, Outcome

__all__ = ["GuardedError", "GuardedPool", "Outcome"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import pool

        return getattr(pool, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
