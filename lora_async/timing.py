"""Where every second goes: what the generator waits on while it is idle, and how long each
reward, tool and environment call takes.

Two figures, two mechanisms:
- **the idle split**: a run-wide `TimeBoard` counts what waits right now (per `Wait` kind, over
  all adapters) and the generation requests in flight. A sampler ticks on the event loop;
  each tick's real elapsed time, if no request was in flight, is split evenly over the kinds
  waiting then ("other" when none was). A step row takes the board's difference over its
  interval and fits it to the engine's own idle figure (`IdleSplit.fitted`).
- **per-call waits**: each adapter's `Waits` keeps the durations of its reward, tool and
  environment calls: those since the last step (for the step row's p50/p95) and a bounded
  histogram of the whole run (for the summary).

`Waits` is what rollout sources see (`RolloutContext.waits`); `NO_WAITS`, the default, records
nothing (held-out evals, tests). Nothing here imports the orchestrator, tasks, torch or vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, fields, replace
from typing import Iterator

# A tick every 50 ms catches waits of a tenth of a second and costs 20 wake-ups a second on
# the event loop (nothing next to an engine step).
SAMPLE_S = 0.05
QUANTILES = ((0.5, "p50"), (0.95, "p95"))  # the per-call figures: (q, the key's suffix)
# The run-long histogram: buckets 1% wide (quantiles good to 1%), durations under a microsecond
# counted as one; a run of millions of calls keeps a few hundred buckets.
BUCKET_RATIO = 1.01
SHORTEST_S = 1e-6


class Wait(str, enum.Enum):
    ADMISSION = "admission"  # a producer held back by admission (staleness / sync mode) or a full buffer
    REWARD = "reward"
    TOOL = "tool"
    ENV = "env"


# ------------------------------------------------------------------ the idle split


@dataclass(frozen=True)
class IdleSplit:
    """Seconds the generator had no request in flight, by what was waiting then (several kinds
    at once share the time evenly; `other`: nothing waited, e.g. a group being set up, the
    collector or the learner's bookkeeping)."""

    admission: float = 0.0
    reward: float = 0.0
    tool: float = 0.0
    env: float = 0.0
    other: float = 0.0

    @property
    def total(self) -> float:
        return sum(self.parts().values())

    def parts(self) -> dict[str, float]:
        """Cause -> seconds, in a fixed order (the Wait kinds, then "other")."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def minus(self, earlier: "IdleSplit") -> "IdleSplit":
        return IdleSplit(*(now - before for now, before in zip(self.parts().values(), earlier.parts().values())))

    def fitted(self, idle_s: float) -> "IdleSplit":
        """This split made to sum to `idle_s`, the engine's own (exact) idle time: scaled down
        where the samples found more, the rest counted as `other` where they found less (the
        engine can idle with requests in flight, e.g. between a request's end and the next)."""
        idle_s = max(0.0, idle_s)
        total = self.total
        if total > idle_s:
            scale = idle_s / total
            return IdleSplit(*(v * scale for v in self.parts().values()))
        return replace(self, other=self.other + idle_s - total)


IDLE_CAUSES = tuple(f.name for f in fields(IdleSplit))  # the `gen_idle_<cause>_s` figures, in order


@dataclass(frozen=True)
class GeneratorSplit:
    """Where the generator's time went over an interval: computing, or idle, the idle time by
    what waited (`idle`, fitted to sum to `idle_s`)."""

    compute_s: float
    idle_s: float
    idle: IdleSplit

    def figures(self) -> dict[str, float]:
        """`gen_compute_s`, `gen_idle_s` and `gen_idle_<cause>_s` (step rows and the summary)."""
        return {"gen_compute_s": self.compute_s, "gen_idle_s": self.idle_s,
                **{f"gen_idle_{cause}_s": seconds for cause, seconds in self.idle.parts().items()}}


class TimeBoard:
    """One run's board: what waits now (per kind, over every adapter), the requests in flight,
    and the sampled no-request time by cause. Counts change on the event loop and, where a
    caller does so, on other threads: they are under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[Wait, int] = {kind: 0 for kind in Wait}
        self._in_flight = 0
        self._idle: dict[Wait, float] = {kind: 0.0 for kind in Wait}
        self._other = 0.0

    def waits(self) -> "Waits":
        """A new adapter's `Waits`, reporting to this board."""
        return Waits(self)

    @contextlib.contextmanager
    def waiting(self, kind: Wait) -> Iterator[None]:
        with self._lock:
            self._waiting[kind] += 1
        try:
            yield
        finally:
            with self._lock:
                self._waiting[kind] -= 1

    def request_started(self) -> None:
        with self._lock:
            self._in_flight += 1

    def request_finished(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def tick(self, seconds: float) -> None:
        """Count `seconds` just past as the board stands now: nothing in flight is idle time,
        shared evenly by the kinds waiting (none: other)."""
        with self._lock:
            if self._in_flight > 0:
                return
            kinds = [kind for kind, count in self._waiting.items() if count > 0]
            if not kinds:
                self._other += seconds
            for kind in kinds:
                self._idle[kind] += seconds / len(kinds)

    def snapshot(self) -> IdleSplit:
        """The idle time sampled so far (a step takes the difference between two)."""
        with self._lock:
            return IdleSplit(**{kind.value: seconds for kind, seconds in self._idle.items()}, other=self._other)

    async def sample(self, every_s: float = SAMPLE_S) -> None:
        """Tick until cancelled, each tick weighted by the real time since the last (a loop
        busy elsewhere delays a tick, never loses the time)."""
        last = time.perf_counter()
        while True:
            await asyncio.sleep(every_s)
            now = time.perf_counter()
            self.tick(now - last)
            last = now


# ------------------------------------------------------------------ per-call waits


def quantile(values: list[float], q: float) -> float:
    """The q-quantile, linearly interpolated between the nearest ranks (numpy's default)."""
    ranked = sorted(values)
    at = q * (len(ranked) - 1)
    low = math.floor(at)
    high = min(low + 1, len(ranked) - 1)
    return ranked[low] + (ranked[high] - ranked[low]) * (at - low)


class CallTimes:
    """Durations of one kind of call over a whole run, as a log-scale histogram: memory stays
    bounded however long the run, and quantiles are good to a bucket's width (1%)."""

    def __init__(self) -> None:
        self.count = 0
        self._buckets: Counter[int] = Counter()

    def add(self, seconds: float) -> None:
        self.count += 1
        self._buckets[math.floor(math.log(max(seconds, SHORTEST_S), BUCKET_RATIO))] += 1

    def quantile(self, q: float) -> float:
        """The bucket holding the q-quantile's rank, at its geometric middle."""
        rank = q * (self.count - 1)
        seen = 0
        for bucket in sorted(self._buckets):
            seen += self._buckets[bucket]
            if seen > rank:
                return float(BUCKET_RATIO ** (bucket + 0.5))
        return 0.0


def call_key(kind: Wait, quantile_name: str) -> str:
    """A per-call figure's key in step rows: `<kind>_wait_s_<p50|p95>`."""
    return f"{kind.value}_wait_s_{quantile_name}"


@dataclass(frozen=True)
class CallWaits:
    """A step's calls of one kind: the p50 and p95 of their durations (exact, to a microsecond)."""

    p50: float
    p95: float

    @classmethod
    def of(cls, durations: list[float]) -> "CallWaits":
        return cls(*(round(quantile(durations, q), 6) for q, _ in QUANTILES))

    def figures(self, kind: Wait) -> dict[str, float]:
        """`<kind>_wait_s_p50`, `<kind>_wait_s_p95`."""
        return {call_key(kind, name): value for (_, name), value in zip(QUANTILES, (self.p50, self.p95))}


def call_waits(durations: dict[Wait, list[float]]) -> dict[Wait, CallWaits]:
    """The kinds with calls, each with its calls' quantiles."""
    return {kind: CallWaits.of(values) for kind, values in durations.items() if values}


def call_figures(waits: dict[Wait, CallWaits]) -> dict[str, float]:
    """`<kind>_wait_s_p50`, `<kind>_wait_s_p95` of the kinds with calls (a step row's)."""
    return {key: value for kind, kind_waits in waits.items() for key, value in kind_waits.figures(kind).items()}


class Waits:
    """What one adapter's rollouts wait on.

    `waiting` marks the wait on the run's board (the idle split) and records no call; `record`
    is one call's duration (the p50/p95 figures); `timed` does both for one call."""

    def __init__(self, board: TimeBoard | None = None) -> None:
        self._board = board
        self._lock = threading.Lock()  # a caller may record from a worker thread
        self._recent: dict[Wait, list[float]] = {kind: [] for kind in Wait}
        self._run: dict[Wait, CallTimes] = {kind: CallTimes() for kind in Wait}

    def waiting(self, kind: Wait) -> contextlib.AbstractContextManager[None]:
        return self._board.waiting(kind) if self._board is not None else contextlib.nullcontext()

    def record(self, kind: Wait, seconds: float) -> None:
        with self._lock:
            self._recent[kind].append(seconds)
            self._run[kind].add(seconds)

    def timed(self, kind: Wait) -> contextlib.AbstractContextManager[None]:
        return self._timed(kind)

    @contextlib.contextmanager
    def _timed(self, kind: Wait) -> Iterator[None]:
        began = time.perf_counter()
        with self.waiting(kind):
            try:
                yield
            finally:
                self.record(kind, time.perf_counter() - began)

    def take(self) -> dict[Wait, list[float]]:
        """The calls recorded since the last `take` (a step row's), per kind."""
        with self._lock:
            recent, self._recent = self._recent, {kind: [] for kind in Wait}
        return recent

    def run_figures(self) -> dict[str, float | int]:
        """The whole run's p50/p95 and call count per kind with calls (the summary's)."""
        with self._lock:
            kinds = {kind: times for kind, times in self._run.items() if times.count}
            figures: dict[str, float | int] = {}
            for kind, times in kinds.items():
                figures.update({call_key(kind, name): times.quantile(q) for q, name in QUANTILES})
                figures[f"{kind.value}_wait_calls"] = times.count
        return figures


class _NoWaits(Waits):
    """Records nothing and marks nothing (held-out evals, tests)."""

    def record(self, kind: Wait, seconds: float) -> None:
        pass


NO_WAITS: Waits = _NoWaits()


# ------------------------------------------------------------------ the learner's side


@dataclass
class LearnerClock:
    """The main loop's time: learner steps, and waits for the next batch (from the end of the
    previous step of any adapter, or from the start of training, to a batch being ready)."""

    last_end: float = 0.0
    waited_s: float = 0.0  # the newest wait (its step row's `learner_wait_s`)
    compute_s: float = 0.0
    wait_s: float = 0.0

    def start(self) -> None:
        """Training begins: the first batch is waited for from now."""
        self.last_end = time.perf_counter()

    def batch_ready(self) -> None:
        self.waited_s = time.perf_counter() - self.last_end
        self.wait_s += self.waited_s

    def trained(self, learner_s: float) -> None:
        """A step kept the learner busy `learner_s` seconds."""
        self.compute_s += learner_s

    def step_done(self) -> None:
        """The main loop is done with a step (its checkpoint included): the next wait starts now."""
        self.last_end = time.perf_counter()
