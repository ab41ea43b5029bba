"""Tools for agent environments: schemas, the prompt that describes them, parsing the model's
calls, and running them in guarded worker processes.

A tool is a module-level Python function with type hints and a docstring (see `base.py`). The
model calls it by writing `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the
format of chat templates with tool support (Qwen, Hermes, SmolLM3) and of `fallback_tool_prompt`
for templates without. Every mistake the model makes (bad JSON, an unknown tool, a wrong
argument) comes back to it as an error message, never as an exception in the trainer.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Mapping

from ..guarded import GuardedError, GuardedPool
from ..tokenizer import Tokenizer
from .base import ToolCall, ToolResult

# An unterminated block at the very end is a reply cut by the token limit; it still counts.
BLOCK_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
FORMAT_HINT = 'write <tool_call>{"name": ..., "arguments": {...}}</tool_call>'


class ToolError(ValueError):
    """A tool list that cannot be used (no docstring, untyped argument, not importable)."""


def tool_schemas(tools: list[Callable[..., Any]]) -> list[dict[str, Any]]:
    """The JSON schema of each tool, as chat templates take them in `tools=`."""
    from transformers.utils import get_json_schema  # heavy: only when an environment has tools

    schemas = []
    for fn in tools:
        import_path(fn)
        try:
            schemas.append(get_json_schema(fn))
        except Exception as exc:  # transformers raises several unrelated types; one line each
            raise ToolError(f"tool {_label(fn)}: {exc}") from None
    names = [schema["function"]["name"] for schema in schemas]
    if len(set(names)) != len(names):
        raise ToolError(f"tool names must be unique: {', '.join(names)}")
    return schemas


def import_path(fn: Callable[..., Any]) -> tuple[str, list[str]]:
    """The `module:qualname` a worker imports the tool by, and the sys.path root it needs."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    why = None
    if not isinstance(module, str) or not isinstance(qualname, str):
        why = f"a {type(fn).__name__} has no module path"
    elif "<lambda>" in qualname:
        why = "it is a lambda"
    elif "<locals>" in qualname:
        why = "it is defined inside a function"
    elif module == "__main__":
        why = "it is defined in __main__, which a worker process cannot import"
    if why is not None:
        raise ToolError(f"tool {_label(fn)}: tools must be module-level functions ({why})")
    return f"{module}:{qualname}", _sys_path_root(str(module))


def _sys_path_root(module: str) -> list[str]:
    """The directory `module` is importable from (e.g. a test's tmp_path, a project root)."""
    file = getattr(sys.modules.get(module), "__file__", None)
    if not file:
        return []
    path = Path(file)
    if path.stem == "__init__":
        path = path.parent
    root = path.parent
    for _ in range(module.count(".")):
        root = root.parent
    return [str(root)]


def _label(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def fallback_tool_prompt(schemas: list[dict[str, Any]]) -> str:
    """System-prompt text describing the tools, for chat templates that ignore `tools=`."""
    lines = ["You can use these tools:"]
    for schema in schemas:
        fn = schema["function"]
        parameters = json.dumps(fn["parameters"])
        lines.append(f"- {fn['name']}: {fn.get('description', '')} Parameters: {parameters}")
    lines += [
        "",
        "To call a tool, write exactly:",
        '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>',
        "Write one block per call. The result comes back in the next message.",
    ]
    return "\n".join(lines)


def template_supports_tools(tokenizer: Tokenizer, schemas: list[dict[str, Any]]) -> bool:
    """Whether the chat template renders `tools=` (if not, use `fallback_tool_prompt`)."""
    messages = [{"role": "user", "content": "Hello"}]
    try:
        plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        with_tools = tokenizer.apply_chat_template(
            messages, tools=schemas, tokenize=False, add_generation_prompt=True
        )
    except Exception:  # no template, or one that fails on tools: describe them ourselves
        return False
    return bool(plain != with_tools)


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """The calls in a reply, and an error message for each malformed block, both in order."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for match in BLOCK_RE.finditer(text):
        parsed = _parse_block(match.group(1).strip())
        if isinstance(parsed, ToolCall):
            calls.append(parsed)
        else:
            errors.append(parsed)
    return calls, errors


def _parse_block(body: str) -> ToolCall | str:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"error: could not parse tool call: {exc.msg} at char {exc.pos}; {FORMAT_HINT}"
    if not isinstance(data, dict):
        return f"error: a tool call must be a JSON object; {FORMAT_HINT}"
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return f'error: the tool call has no "name"; {FORMAT_HINT}'
    arguments = data.get("arguments", data.get("parameters"))  # some models say "parameters"
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):  # OpenAI style: the arguments object as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return f'error: the "arguments" of tool call {name!r} must be a JSON object; {FORMAT_HINT}'
    return ToolCall(name, arguments)


def strip_tool_calls(text: str) -> str:
    """The reply without its tool-call blocks."""
    return BLOCK_RE.sub("", text).strip()


class SimulatedLatency:
    """A remote tool's round trip, simulated (`task.tool_latency`, for benchmarks): each call
    waits a lognormal delay with this median and spread, drawn from a seeded stream. The wait is
    an `asyncio.sleep`, so it holds no worker and no core, as a network wait would not."""

    def __init__(self, median_s: float, sigma: float, seed: int = 0) -> None:
        self.median_s, self.sigma = median_s, sigma
        self._rng = random.Random(seed)

    def draw(self) -> float:
        if self.median_s <= 0:
            return 0.0
        return self._rng.lognormvariate(math.log(self.median_s), self.sigma)


class ToolBox:
    """An environment's tools, each in its own `GuardedPool`; `run` turns every failure into text.

    `workers` is how many calls of one tool run at once: a plain tool in up to that many
    processes (started on demand), an `async def` tool as that many coroutines in one process.
    A call past `timeout_s` is cut off alone; the others go on. With `latency` (a simulation),
    every call first waits a drawn delay, outside the tool's time limit. `env` goes into the
    workers' environment (the run's sandbox isolation)."""

    def __init__(self, tools: list[Callable[..., Any]], timeout_s: float, workers: int = 2,
                 latency: SimulatedLatency | None = None, env: Mapping[str, str] | None = None) -> None:
        self.schemas = tool_schemas(tools)
        self.timeout_s = timeout_s
        self.latency = latency
        self._pools: dict[str, GuardedPool] = {}
        try:
            for schema, fn in zip(self.schemas, tools):
                spec, extra_paths = import_path(fn)
                self._pools[schema["function"]["name"]] = GuardedPool(spec, timeout_s, workers, extra_paths, env)
        except GuardedError as exc:
            self.close()
            raise ToolError(f"tool {exc}") from None
        # `run` is awaited on one event loop in training, but tests drive it from several.
        self._lock = threading.Lock()
        self.calls = 0
        self.errors = 0
        self.timeouts = 0
        self.last_error: str | None = None

    @property
    def names(self) -> list[str]:
        return list(self._pools)

    async def run(self, call: ToolCall) -> ToolResult:
        """Run one call in the tool's pool; the event loop only awaits it. Never raises."""
        pool = self._pools.get(call.name)
        if pool is None:
            return self._count(call, f"error: unknown tool {call.name!r}; available: {', '.join(self.names)}")
        if self.latency is not None:
            await asyncio.sleep(self.latency.draw())
        try:
            result = await pool.acall(call.arguments, strict=True)  # a wrong argument is the model's mistake
        except Exception as exc:  # the pool answers every failure as a CallResult; this is a last guard
            return self._count(call, f"error: {type(exc).__name__}: {exc}")
        if result.timed_out:
            return self._count(call, f"error: tool {call.name!r} timed out after {self.timeout_s:g}s",
                               timed_out=True)
        if result.unavailable:
            # The module broke after startup: a worker cannot start again. Its import error is
            # for the person reading last_error, not for the model.
            return self._count(call, f"error: tool {call.name!r} is unavailable", detail=result.message)
        if not result.ok:
            # The model gets the message; the location is for the person reading last_error.
            return self._count(call, f"error: {result.message}", detail=result.error)
        return self._count(call, str(result.value), failed=False)

    def _count(self, call: ToolCall, content: str, failed: bool = True, timed_out: bool = False,
               detail: str | None = None) -> ToolResult:
        with self._lock:
            self.calls += 1
            if failed:
                self.errors += 1
                self.last_error = f"{call.name}: {detail or content}"
            if timed_out:
                self.timeouts += 1
        return ToolResult(call, content, error=failed)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
