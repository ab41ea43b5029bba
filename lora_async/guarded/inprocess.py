"""`call_guarded`: user code that lives in this process (an environment's methods, a dataset's
scorer) called under a deadline, its faults returned as a `CallResult`.

Objects built in this process cannot move to a `GuardedPool`'s children, so their calls are
guarded here instead: an `async def` runs on the caller's event loop and is cancelled at its
deadline; a plain function runs on a daemon thread of its own, so calls never queue behind one
another (nor behind a shared executor's busy threads), and one past its deadline is left
behind: nobody waits for it, not the caller and not the interpreter's exit.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from typing import Callable

from .result import CallResult
from .worker import failure


async def call_guarded(fn: Callable[..., object], *args: object, timeout_s: float, what: str) -> CallResult:
    """`fn(*args)` within `timeout_s`; a raise (SystemExit included: user code must not end the
    run), a plain function handing back an awaitable, and the deadline become the result's error.
    `what` names the call in errors and in its thread's name ("reset", "chain_sum.score_answer")."""
    submitted, started = time.monotonic(), time.time()
    try:
        if inspect.iscoroutinefunction(fn):
            value = await asyncio.wait_for(fn(*args), timeout_s)
        else:
            value = await asyncio.wait_for(_on_own_thread(fn, args, what), timeout_s)
    except asyncio.TimeoutError:
        return CallResult(message=f"timed out after {timeout_s:g}s", timed_out=True, started=started,
                          ended=time.time(), wait_s=time.monotonic() - submitted)
    except (Exception, SystemExit) as exc:
        fault = failure(exc)
        return CallResult(message=fault["error"], location=fault["where"], started=started, ended=time.time(),
                          wait_s=time.monotonic() - submitted, exception=exc)
    return CallResult(value=value, started=started, ended=time.time(), wait_s=time.monotonic() - submitted)


def _on_own_thread(fn: Callable[..., object], args: tuple[object, ...], what: str) -> "asyncio.Future[object]":
    """A future of the caller's loop, settled by `fn(*args)` on a new daemon thread (unless the
    caller stopped waiting first)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[object] = loop.create_future()

    def settle(value: object, error: BaseException | None) -> None:
        if future.done():
            return  # timed out meanwhile
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def run() -> None:
        value: object = None
        error: BaseException | None = None
        try:
            value = fn(*args)
            if inspect.isawaitable(value):
                raise TypeError(f"{what} returned an awaitable from a plain method")
        except BaseException as exc:  # noqa: BLE001 - a user's fault, reported as data
            error = exc
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:
            pass  # the loop is gone: the run ended while this call hung

    threading.Thread(target=run, name=f"lora-async-guarded-{what}", daemon=True).start()
    return future
