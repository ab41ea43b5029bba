"""Child process of a `GuardedPool`: imports one user function and calls it on request.

Protocol, JSON lines. The child first writes a hello line, `{"ready": true, "params": [...],
"required": [...], "var_kw": bool, "is_async": bool}` or `{"ready": false, "error": "..."}`.
Then each request `{"id": k, "kwargs": {...}}` gets one reply `{"id": k, "value": ...}` or
`{"id": k, "error": "...", "where": "file:line"}`, both with the call's `started` and `ended`
wall-clock times; `{"cancel": k}` cancels call k of an async function, answered by
`{"id": k, "cancelled": true}`.

A plain function answers one call at a time (its pool runs several processes for concurrency);
an `async def` function runs every call it is sent concurrently on this process's event loop.

Kept free of torch/vLLM imports so it starts in well under a second.

    python -m lora_async.guarded.worker MODULE:QUALNAME [EXTRA_SYS_PATH ...]
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable, TextIO

# Parameters that can be passed by keyword; positional-only ones and *args cannot.
KEYWORD_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def load(spec: str) -> Callable[..., Any]:
    """The object `module:qualname` names (qualname may be dotted, e.g. `Class.method`)."""
    module_name, _, qualname = spec.partition(":")
    if not module_name or not qualname:
        raise ValueError(f"{spec!r} is not of the form module:function")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{spec} is a {type(obj).__name__}, not a function")
    return obj


def is_async(fn: Callable[..., Any]) -> bool:
    """An `async def` function, or an object whose `__call__` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def describe(fn: Callable[..., Any]) -> dict[str, Any]:
    """The hello line: which keywords the function takes, and whether it is async."""
    params = inspect.signature(fn).parameters.values()
    return {
        "ready": True,
        "params": [p.name for p in params if p.kind in KEYWORD_KINDS],
        "required": [p.name for p in params if p.kind in KEYWORD_KINDS and p.default is p.empty],
        "var_kw": any(p.kind is p.VAR_KEYWORD for p in params),
        "is_async": is_async(fn),
    }


def jsonable(value: Any) -> Any:
    """The value if JSON can carry it (lists of numbers and None included), else its text."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        pass
    if isinstance(value, (list, tuple)):  # a batched reward's list of numpy floats
        return [jsonable(v) for v in value]
    # numpy/torch scalars are common reward returns; .item() gives the plain number.
    try:
        item = value.item()
        json.dumps(item)
        return item
    except Exception:
        return str(value)


def bind_error(fn: Callable[..., Any], signature: inspect.Signature, kwargs: dict[str, Any]) -> str | None:
    """Checked before the call, so the message names the function, not this file."""
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        return f"TypeError: {getattr(fn, '__name__', 'function')}() {exc}"
    return None


def failure(exc: BaseException) -> dict[str, Any]:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None
    return {"error": f"{type(exc).__name__}: {exc}", "where": where}


def call(fn: Callable[..., Any], signature: inspect.Signature, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Run one request of a plain function; every failure becomes an error reply."""
    started = time.time()
    error = bind_error(fn, signature, kwargs)
    if error is not None:
        return {"error": error, "where": None, "started": started, "ended": time.time()}
    try:
        value = fn(**kwargs)
        if inspect.isawaitable(value):  # a plain function that hands back a coroutine
            import asyncio

            value = asyncio.run(_awaited(value))
        reply = {"value": jsonable(value)}
    except (Exception, SystemExit) as exc:  # a user sys.exit() must not end the worker
        reply = failure(exc)
    return {**reply, "started": started, "ended": time.time()}


async def _awaited(value: Any) -> Any:
    return await value


class Writer:
    """Reply lines, written whole from any thread."""

    def __init__(self, out: TextIO) -> None:
        self.out, self._lock = out, threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        line = json.dumps(message) + "\n"
        with self._lock:
            self.out.write(line)
            self.out.flush()


def serve_plain(fn: Callable[..., Any], writer: Writer) -> None:
    signature = inspect.signature(fn)
    for line in sys.stdin:
        request = json.loads(line)
        if "cancel" in request:
            continue  # a plain call is never cancelled: its pool kills this process instead
        writer.send({"id": request["id"], **call(fn, signature, request["kwargs"])})


def serve_async(fn: Callable[..., Any], writer: Writer) -> None:
    """Every request becomes a task on one event loop; stdin is read on a thread."""
    import asyncio  # here, not at the top: a plain function's worker starts without it

    signature = inspect.signature(fn)
    loop = asyncio.new_event_loop()
    tasks: dict[int, "asyncio.Task[None]"] = {}

    async def run(call_id: int, kwargs: dict[str, Any]) -> None:
        started = time.time()
        error = bind_error(fn, signature, kwargs)
        if error is not None:
            reply: dict[str, Any] = {"error": error, "where": None}
        else:
            try:
                reply = {"value": jsonable(await fn(**kwargs))}
            except asyncio.CancelledError:
                writer.send({"id": call_id, "cancelled": True})
                return
            except (Exception, SystemExit) as exc:
                reply = failure(exc)
        writer.send({"id": call_id, **reply, "started": started, "ended": time.time()})

    def handle(line: str) -> None:
        request = json.loads(line)
        if "cancel" in request:
            task = tasks.get(request["cancel"])
            if task is not None:
                task.cancel()
            return
        call_id: int = request["id"]
        tasks[call_id] = loop.create_task(run(call_id, request["kwargs"]))
        tasks[call_id].add_done_callback(lambda _task: tasks.pop(call_id, None))

    def read() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(handle, line)
        loop.call_soon_threadsafe(loop.stop)  # the pool closed our input: end

    threading.Thread(target=read, daemon=True).start()
    loop.run_forever()


def main(spec: str, extra_paths: list[str]) -> None:
    # The protocol gets its own copy of stdout; fd 1 then points at stderr, so a print() in
    # user code (or in C code it calls) cannot corrupt a reply.
    writer = Writer(os.fdopen(os.dup(1), "w"))
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for path in reversed([os.getcwd(), *extra_paths]):
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        fn = load(spec)
        hello = describe(fn)
    except Exception as exc:
        writer.send({"ready": False, "error": f"{type(exc).__name__}: {exc}"})
        return
    writer.send(hello)
    (serve_async if hello["is_async"] else serve_plain)(fn, writer)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
