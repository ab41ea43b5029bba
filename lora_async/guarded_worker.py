"""Child process of `GuardedFunction`: imports one user function and calls it on request.

Protocol, JSON lines: the child writes a hello line (`{"ready": true, "params": [...],
"required": [...], "var_kw": bool}` or `{"ready": false, "error": "..."}`), then answers each
request `{"kwargs": {...}}` with `{"value": ...}` or `{"error": "...", "where": "file:line"}`.

Kept free of torch/vLLM imports so it starts in well under a second.

    python -m lora_async.guarded_worker MODULE:QUALNAME [EXTRA_SYS_PATH ...]
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
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


def describe(fn: Callable[..., Any]) -> dict[str, Any]:
    """The hello line: which keywords the function takes."""
    params = inspect.signature(fn).parameters.values()
    return {
        "ready": True,
        "params": [p.name for p in params if p.kind in KEYWORD_KINDS],
        "required": [p.name for p in params if p.kind in KEYWORD_KINDS and p.default is p.empty],
        "var_kw": any(p.kind is p.VAR_KEYWORD for p in params),
    }


def jsonable(value: Any) -> Any:
    """The value if JSON can carry it, else its text."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        pass
    # numpy/torch scalars are common reward returns; .item() gives the plain number.
    try:
        item = value.item()
        json.dumps(item)
        return item
    except Exception:
        return str(value)


def call(fn: Callable[..., Any], signature: inspect.Signature, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Run one request; every failure becomes an error reply."""
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        # Checked before the call, so the message names the function, not this file.
        return {"error": f"TypeError: {getattr(fn, '__name__', 'function')}() {exc}", "where": None}
    try:
        return {"value": jsonable(fn(**kwargs))}
    except (Exception, SystemExit) as exc:  # a user sys.exit() must not end the worker
        last = traceback.extract_tb(exc.__traceback__)[-1]
        return {"error": f"{type(exc).__name__}: {exc}", "where": f"{last.filename}:{last.lineno}"}


def send(out: TextIO, message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def main(spec: str, extra_paths: list[str]) -> None:
    # The protocol gets its own copy of stdout; fd 1 then points at stderr, so a print() in
    # user code (or in C code it calls) cannot corrupt a reply.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for path in reversed([os.getcwd(), *extra_paths]):
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        fn = load(spec)
        signature = inspect.signature(fn)
        hello = describe(fn)
    except Exception as exc:
        send(out, {"ready": False, "error": f"{type(exc).__name__}: {exc}"})
        return
    send(out, hello)
    for line in sys.stdin:
        request = json.loads(line)
        send(out, call(fn, signature, request["kwargs"]))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
