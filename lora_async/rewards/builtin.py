"""Reward functions: builtin ones by name, and user functions run in a guarded subprocess.

A user function (`module:function`) is called with keywords: `prompt`, `completion`, `answer`
and every other field of the problem's record, each only if its signature names it (all of
them if it takes `**kwargs`), so a TRL-style `def score(completion, answer, **kwargs)` works.
It runs in a child process (`GuardedFunction`): one that raises, returns a non-number or runs
past its timeout scores 0, is counted, and never takes the training run down with it.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Protocol, Sequence

from ..guarded import GuardedError, GuardedFunction
from .problems import Problem, RewardStats

NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


class RewardError(ValueError):
    """A reward specification that cannot be used (unknown name, import failure)."""


class RewardFailed(Exception):
    """One call of a user reward failed; the message is the whole error text."""


class Reward(Protocol):
    """A reward as tasks use it: called with keywords, one float per completion."""

    def __call__(self, **fields: Any) -> float: ...

    def describe(self, fields: Sequence[str]) -> str:
        """One startup line: which of `fields` the reward gets."""

    def close(self) -> None: ...


def final_number(text: str) -> float | None:
    """The last number in the text, or None."""
    found = NUMBER_RE.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


def numeric_reward(completion: str, answer: str) -> float:
    got = final_number(completion)
    want = final_number(answer)
    return float(got is not None and want is not None and math.isclose(got, want, abs_tol=1e-9))


def exact_reward(completion: str, answer: str) -> float:
    return float(completion.strip() == answer.strip())


def regex_reward(pattern: str) -> Callable[[str, str], float]:
    compiled = re.compile(pattern)
    return lambda completion, answer: float(compiled.search(completion) is not None)


def builtin_reward(spec: str) -> Callable[[str, str], float] | None:
    if spec == "exact":
        return exact_reward
    if spec == "numeric":
        return numeric_reward
    if spec.startswith("regex:"):
        return regex_reward(spec[len("regex:"):])
    return None


class BuiltinReward:
    """exact / numeric / regex, in-process: they only compare the completion with the answer."""

    def __init__(self, spec: str, fn: Callable[[str, str], float]) -> None:
        self.spec = spec
        self._fn = fn
        # A pattern says what to look for; it never reads the answer.
        self._uses = ("completion",) if spec.startswith("regex:") else ("completion", "answer")

    def __call__(self, **fields: Any) -> float:
        return self._fn(fields["completion"], fields["answer"])

    def describe(self, fields: Sequence[str]) -> str:
        return f"reward {self.spec} gets {', '.join(self._uses)}"

    def close(self) -> None:
        pass


class UserReward:
    """`module:function` in a guarded worker subprocess, with a per-call timeout.

    A failed call raises `RewardFailed` (after counting a timeout); `safe_rewards` turns it
    into a 0 and an error record."""

    def __init__(self, spec: str, timeout_s: float, stats: RewardStats) -> None:
        self.spec = spec
        self.stats = stats
        try:
            self._fn = GuardedFunction(spec, timeout_s)
        except GuardedError as exc:
            raise RewardError(f"reward function {exc}") from None

    def __call__(self, **fields: Any) -> float:
        outcome = self._fn.call(fields)  # a mapping: a field may be called `strict`
        if outcome.timed_out:
            self.stats.timeouts += 1
        if not outcome.ok:
            raise RewardFailed(f"{self.spec}: {outcome.error}")
        value = outcome.value
        if not isinstance(value, (int, float)):  # bool is an int: `return answer in completion` counts
            raise RewardFailed(f"{self.spec}: returned {str(value)[:80]!r}, not a number")
        return float(value)

    def describe(self, fields: Sequence[str]) -> str:
        got = self._fn.accepted(fields)
        line = f"reward {self.spec} gets {', '.join(got) or 'nothing'} (of {', '.join(fields)})"
        missing = [name for name in self._fn.required if name not in fields]
        if missing:  # every call would fail with a TypeError; say so before the run starts
            line += f"; it also needs {', '.join(missing)}, which no field provides"
        return line

    def close(self) -> None:
        self._fn.close()


def make_reward(spec: str, timeout_s: float, stats: RewardStats) -> Reward:
    """The reward a spec names; call it as `fn(prompt=..., completion=..., answer=..., **fields)`."""
    builtin = builtin_reward(spec)
    if builtin is not None:
        return BuiltinReward(spec, builtin)
    if ":" not in spec:
        raise RewardError(f"unknown reward {spec!r}: use exact, numeric, regex:<pattern> or module:function")
    return UserReward(spec, timeout_s, stats)


def safe_rewards(fn: Callable[..., float], stats: RewardStats, problem: Problem,
                 completions: list[str]) -> list[float]:
    """Score completions; an exception or a non-finite score gives 0 and is counted.

    The record's extra fields go first, so a field named like a role (`completion`) cannot
    shadow it. A call is counted once it is scored (after its error, if any), so a reader on
    another thread never sees more calls than outcomes."""
    out = []
    for completion in completions:
        try:
            value = float(fn(**{**problem.fields, "prompt": problem.prompt, "completion": completion,
                                "answer": problem.answer}))
            if not math.isfinite(value):
                raise ValueError(f"reward is {value}")
        except RewardFailed as exc:
            stats.record_error(str(exc))
            value = 0.0
        except Exception as exc:
            stats.record_error(f"{type(exc).__name__}: {exc}")
            value = 0.0
        stats.calls += 1
        out.append(value)
    return out
