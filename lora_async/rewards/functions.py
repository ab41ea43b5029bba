"""One reward function, of any form, scoring one group: what it is given and what it returns.

Three forms of user function (`module:function`), all run in a `GuardedPool`:
- **per sample**: `def score(completion, answer, **kwargs) -> float`, called once per completion
  with `prompt`, `completion`, `answer` and every other field of the record; the completions
  of a group are scored at once, each in a worker of the pool;
- **batched, TRL's convention**: a function whose signature names `completions` is called once
  per group with lists: `prompts`, `completions` (strings for text prompts, `[{"role":
  "assistant", "content": ...}]` for chat prompts, as TRL passes them), `completion_ids`,
  `answer` and every other field of the record, one entry per completion. It returns one float
  per completion, or None where it does not score that completion;
- **async**: either form written `async def`; its calls run concurrently on an event loop in
  one worker.

A call that raises, times out or returns something else than a number scores 0 for what it
should have scored, and the error is kept (naming the function) for the caller to count.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

from ..errors import UserError
from ..guarded import CallResult, GuardedError, GuardedPool
from .builtin import builtin_reward
from .code import SPEC as CODE_TESTS_SPEC

Messages = list[dict[str, str]]  # a chat: {"role", "content"} each
Prompt = str | Messages  # the problem's prompt: text, or a chat
BATCH_MARK = "completions"  # a parameter of this name makes a function batched (TRL's convention)


class RewardError(UserError, ValueError):
    """A reward specification that cannot be used (unknown name, import failure)."""


@dataclass(frozen=True)
class Batch:
    """One group to score: its problem's prompt, answer and record fields, and its completions."""

    prompt: Prompt
    answer: str
    completions: list[str]
    completion_ids: list[list[int]] = field(default_factory=list)
    fields: Mapping[str, Any] = field(default_factory=dict)  # the record's other fields

    @property
    def chat(self) -> bool:
        return isinstance(self.prompt, list)

    def sample_kwargs(self, i: int) -> dict[str, Any]:
        """Keywords of a per-sample call. The record's fields go first, so a field named like a
        role (`completion`) cannot shadow it."""
        return {**self.fields, "prompt": self.prompt, "completion": self.completions[i], "answer": self.answer}

    def batch_kwargs(self) -> dict[str, Any]:
        """Keywords of a batched call: TRL's names, every column one entry per completion."""
        n = len(self.completions)
        completions: list[Any] = ([[{"role": "assistant", "content": c}] for c in self.completions] if self.chat
                                  else list(self.completions))
        ids = [list(x) for x in self.completion_ids] if self.completion_ids else [[] for _ in range(n)]
        return {**{k: [v] * n for k, v in self.fields.items()}, "prompts": [self.prompt] * n,
                "completions": completions, "completion_ids": ids, "answer": [self.answer] * n}


@dataclass(frozen=True)
class Call:
    """One call's figures: what the caller waited (queue included), and the call itself."""

    wait_s: float
    started: float | None = None  # wall clock, as the worker saw it
    ended: float | None = None

    @property
    def run_s(self) -> float | None:
        return None if self.started is None or self.ended is None else self.ended - self.started


@dataclass
class FunctionScores:
    """What one function made of a group: a value per completion (None: not scored by it), and
    an error per completion (None: fine)."""

    values: list[float | None]
    errors: list[str | None]
    calls: list[Call] = field(default_factory=list)
    timeouts: int = 0


class RewardFunction(Protocol):
    name: str  # its metric name: `reward/<name>`
    spec: str  # as configured: "numeric", "my_rewards:correct"

    def describe(self, fields: Sequence[str]) -> str:
        """One startup line: which of the per-sample `fields` the function gets."""

    async def score(self, batch: Batch) -> FunctionScores: ...

    def close(self) -> None: ...


def checked(spec: str, value: Any) -> tuple[float | None, str | None]:
    """A returned value as a score, or the error it is (None is "not scored", not an error)."""
    if value is None:
        return None, None
    if not isinstance(value, (int, float)):  # bool is an int: `return answer in completion` counts
        return None, f"{spec}: returned {str(value)[:80]!r}, not a number"
    if not math.isfinite(value):
        return None, f"{spec}: returned {value}"
    return float(value), None


class BuiltinFunction:
    """exact / numeric / regex, in-process."""

    def __init__(self, spec: str, fn: Callable[[str, str], float], name: str) -> None:
        self.spec, self.name, self._fn = spec, name, fn
        # A pattern says what to look for; it never reads the answer.
        self._uses = ("completion",) if spec.startswith("regex:") else ("completion", "answer")

    def describe(self, fields: Sequence[str]) -> str:
        return f"reward {self.spec} gets {', '.join(self._uses)}"

    async def score(self, batch: Batch) -> FunctionScores:
        values: list[float | None] = [self._fn(c, batch.answer) for c in batch.completions]
        return FunctionScores(values, [None] * len(values))

    def close(self) -> None:
        pass


class PooledFunction:
    """A user `module:function` in a `GuardedPool` of `workers` (see the module docstring)."""

    def __init__(self, spec: str, timeout_s: float, workers: int, name: str, env: Mapping[str, str] | None = None,
                 runs: str | None = None) -> None:
        self.spec, self.name = spec, name
        try:
            self._pool = GuardedPool(runs or spec, timeout_s, size=workers, env=env)
        except GuardedError as exc:
            raise RewardError(f"reward function {exc}") from None
        self.batched = BATCH_MARK in self._pool.params

    @property
    def is_async(self) -> bool:
        return self._pool.is_async

    def describe(self, fields: Sequence[str]) -> str:
        names = list(fields)
        form = ""
        if self.batched:  # the batched names, as the function receives them
            plural = {"prompt": "prompts", "completion": "completions"}
            names = [plural.get(n, n) for n in names]
            names.insert(names.index("completions") + 1 if "completions" in names else 0, "completion_ids")
            form = "batched, "
        if self.is_async:
            form += "async, "
        got = self._pool.accepted(names)
        line = f"reward {self.spec} ({form}{self._pool.size} at once) gets {', '.join(got) or 'nothing'} " \
               f"(of {', '.join(names)})"
        missing = [n for n in self._pool.required if n not in names]
        if missing:  # every call would fail with a TypeError; say so before the run starts
            line += f"; it also needs {', '.join(missing)}, which no field provides"
        return line

    async def score(self, batch: Batch) -> FunctionScores:
        if self.batched:
            return self._batched(batch, await self._pool.acall(batch.batch_kwargs()))
        results = await asyncio.gather(*(self._pool.acall(batch.sample_kwargs(i))
                                         for i in range(len(batch.completions))))
        scores = FunctionScores([], [], [self._call(r) for r in results], sum(r.timed_out for r in results))
        for result in results:
            value, error = checked(self.spec, result.value) if result.ok else (None, self._error(result))
            scores.values.append(0.0 if error else value)
            scores.errors.append(error)
        return scores

    def _batched(self, batch: Batch, result: CallResult) -> FunctionScores:
        n = len(batch.completions)
        scores = FunctionScores([0.0] * n, [None] * n, [self._call(result)], int(result.timed_out))
        values = result.value
        if not result.ok:
            error = self._error(result)
        elif not isinstance(values, list):
            error = (f"{self.spec}: returned {str(values)[:60]} (a {type(values).__name__}), not a list; a batched "
                     f"reward (it takes `completions`) returns one float or None per completion, {n} here")
        elif len(values) != n:
            error = (f"{self.spec}: returned {len(values)} values for {n} completions; a batched reward returns "
                     "one float or None per completion")
        else:
            for i, value in enumerate(values):
                scores.values[i], scores.errors[i] = checked(self.spec, value)
                if scores.errors[i] is not None:
                    scores.values[i] = 0.0
            return scores
        scores.errors = [error] * n
        return scores

    def _error(self, result: CallResult) -> str:
        return f"{self.spec}: {result.error}"

    @staticmethod
    def _call(result: CallResult) -> Call:
        return Call(result.wait_s, result.started, result.ended)

    def close(self) -> None:
        self._pool.close()


def make_function(spec: str, timeout_s: float, workers: int, name: str,
                  env: Mapping[str, str] | None = None) -> RewardFunction:
    """The function a spec names: a builtin by name, else a user `module:function`. `env` goes
    into the pool's workers' environment (the run's sandbox isolation)."""
    builtin = builtin_reward(spec)
    if builtin is not None:
        return BuiltinFunction(spec, builtin, name)
    if spec == "code_tests":  # runs programs: in the pool, like a user function
        return PooledFunction(spec, timeout_s, workers, name, env, runs=CODE_TESTS_SPEC)
    if ":" not in spec:
        raise RewardError(f"unknown reward {spec!r}: use exact, numeric, code_tests, regex:<pattern> or "
                          "module:function")
    return PooledFunction(spec, timeout_s, workers, name, env)
