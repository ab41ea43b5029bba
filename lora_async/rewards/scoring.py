"""A task's rewards: one or several functions with weights, scoring a group concurrently.

The functions of a group run at once, and each runs its calls at once (`functions.py`). A
completion's reward is the weighted sum of the values its functions gave it, skipping those
that did not score it (None), as TRL sums them; 0 if none did. Each function's values are kept
too (`reward/<name>` in the metrics).

Failures are counted per completion in `RewardStats` (and per function, so a function that
never works stops the run after the first step even beside one that does); the group's first
error comes back in `Scores.fault` for the run to show at once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..rollout import RewardStats
from ..timing import NO_WAITS, Wait, Waits
from .functions import Batch, Call, FunctionScores, RewardFunction, make_function


@dataclass
class Scores:
    """A group's rewards: the weighted sums, each function's values, and what it cost."""

    rewards: list[float]
    parts: dict[str, list[float | None]]  # function name -> a value per completion (None: not scored)
    fault: str | None = None  # the first error of this group
    calls: list[Call] = field(default_factory=list)  # every call of every function
    wait_s: float = 0.0  # from the first call to the last score: what the group waited


def function_names(specs: Sequence[str]) -> list[str]:
    """Metric names: `my_rewards:correct` -> `correct`, `regex:...` -> `regex`; repeats get `_2`, `_3`."""
    names: list[str] = []
    for spec in specs:
        base = "regex" if spec.startswith("regex:") else spec.rpartition(":")[2].rpartition(".")[2]
        name, k = base, 2
        while name in names:
            name, k = f"{base}_{k}", k + 1
        names.append(name)
    return names


class Rewards:
    """The reward functions of one task, with their weights (1.0 each when not given)."""

    def __init__(self, functions: list[RewardFunction], weights: Sequence[float] | None, stats: RewardStats) -> None:
        self.functions, self.stats = functions, stats
        self.weights = list(weights) if weights is not None else [1.0] * len(functions)

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.functions]

    def describe(self, fields: Sequence[str]) -> str:
        lines = [f.describe(fields) for f in self.functions]
        if len(self.functions) > 1:
            lines.append("weights " + ", ".join(f"{f.name} {w:g}" for f, w in zip(self.functions, self.weights)))
        return "; ".join(lines)

    async def score(self, batch: Batch, waits: Waits = NO_WAITS) -> Scores:
        """Score one group; `waits` (a rollout's) is told the group waits on rewards, and each
        call's wait."""
        began = time.monotonic()
        with waits.waiting(Wait.REWARD):
            results: list[FunctionScores] = await asyncio.gather(*(f.score(batch) for f in self.functions))
        scores = Scores([0.0] * len(batch.completions), {}, wait_s=time.monotonic() - began)
        for fn, weight, result in zip(self.functions, self.weights, results):
            scores.parts[fn.name] = result.values
            scores.calls += result.calls
            for call in result.calls:
                waits.record(Wait.REWARD, call.wait_s)
            self.stats.timeouts += result.timeouts
            self.stats.count_function(fn.name, len(result.values), [e for e in result.errors if e])
            for i, value in enumerate(result.values):
                if value is not None:
                    scores.rewards[i] += weight * value
        for i in range(len(batch.completions)):
            errors = [e for r in results if (e := r.errors[i]) is not None]
            if errors:
                self.stats.record_error(errors[0])
                scores.fault = scores.fault or errors[0]
            self.stats.calls += 1  # after its error: a reader on another thread never sees more calls than outcomes
        return scores

    def close(self) -> None:
        for fn in self.functions:
            fn.close()


def make_rewards(specs: Sequence[str], weights: Sequence[float] | None, timeout_s: float, workers: int,
                 stats: RewardStats, env: Mapping[str, str] | None = None) -> Rewards:
    """The rewards a task's `reward` names (one spec or several); a function that cannot load
    is a `RewardError`, and the ones loaded before it are closed. `env` goes into the workers'
    environment."""
    functions: list[RewardFunction] = []
    try:
        for spec, name in zip(specs, function_names(specs)):
            functions.append(make_function(spec, timeout_s, workers, name, env))
    except Exception:
        for fn in functions:
            fn.close()
        raise
    return Rewards(functions, weights, stats)
