"""What auto measures: a step's figures as its metrics line gives them (`StepRecord`, built by
`orchestrator.rows`), the time split auto reads of them (`StepFigures`), and the engine's decode
throughput by batch (`EngineCurve`, calibrated at start-up)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..timing import CallWaits, GeneratorSplit, Wait

ABORTED_SHARE = 0.5  # a group aborted mid-generation had made about half its tokens
# keys that checkpoints of earlier versions wrote and no decision reads any more
RETIRED_KEYS = frozenset({"learner_cpu_s"})
CALLS = (Wait.REWARD, Wait.TOOL, Wait.ENV)  # what a rollout calls and waits on


@dataclass(frozen=True)
class StepRecord:
    """A step's time and size, typed, as its metrics line gives them (`orchestrator.rows` builds
    it, and the line's figures from it, rounded as they are written): what auto reads of a step,
    so a renamed figure fails the type checker instead of reading as zero."""

    step_s: float  # the step's wall clock (`step_s`)
    learner_s: float  # the learner's compute (`learner_s`)
    generator: GeneratorSplit  # the engine's busy and idle time (`gen_compute_s`, `gen_idle_*_s`)
    calls: dict[Wait, CallWaits]  # the calls the step's rollouts waited on, kinds with any (`<kind>_wait_s_*`)
    engine_batch: float | None  # sequences in flight per engine step (`engine_running_mean`; None: not counted)
    engine_steps: float  # engine steps during the step
    samples: int  # trained
    samples_pulled: int  # taken from the buffer for the step (flat groups too)
    groups: int  # trained
    tokens_trained: int
    padded_tokens: int


@dataclass(frozen=True)
class StepFigures:
    """What auto reads of a step (`StepRecord`): its time split, and the work it did."""

    step_s: float  # the step's wall clock
    learner_s: float  # the learner's compute
    gen_compute_s: float  # the engine's busy time
    wait_s: float  # the generator idle while everything in flight waited (reward, tool, env)
    engine_batch: float | None  # sequences in flight per engine step (None: not counted)
    engine_steps: float  # engine steps during the step
    samples: int  # trained
    groups: int  # trained
    samples_pulled: int  # taken from the buffer for the step (flat groups too)
    aborted_groups: int  # groups aborted mid-generation during the step
    learner_tokens: int = 0  # the tokens the learner computed on (trained and padding)
    # a median call of each kind the step's rollouts waited on (reward, tool, env), summed:
    # one of each is on a sync step's path with nothing to hide it
    call_wait_s: float = 0.0

    @classmethod
    def of_step(cls, step: StepRecord, aborted_groups: int = 0) -> "StepFigures":
        idle = step.generator.idle
        calls = sum(waits.p50 for kind, waits in step.calls.items() if kind in CALLS)
        return cls(step.step_s, step.learner_s, step.generator.compute_s, idle.reward + idle.tool + idle.env,
                   step.engine_batch, step.engine_steps, step.samples, step.groups, step.samples_pulled,
                   aborted_groups, step.tokens_trained + step.padded_tokens, calls)

    @classmethod
    def mean(cls, steps: list["StepFigures"]) -> "StepFigures":
        n = len(steps)
        batches = [s.engine_batch for s in steps if s.engine_batch is not None]
        calls = [s.call_wait_s for s in steps if s.call_wait_s > 0]  # an async step may make no calls
        def mean(name: str) -> float:
            return sum(getattr(s, name) for s in steps) / n

        return cls(mean("step_s"), mean("learner_s"), mean("gen_compute_s"), mean("wait_s"),
                   sum(batches) / len(batches) if batches else None, mean("engine_steps"), round(mean("samples")),
                   round(mean("groups")), round(mean("samples_pulled")), round(mean("aborted_groups")),
                   round(mean("learner_tokens")), sum(calls) / len(calls) if calls else 0.0)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "StepFigures":
        """From a checkpoint (`dataclasses.asdict`); keys an earlier version wrote and nothing
        reads any more are dropped, any other unknown key fails."""
        return cls(**{k: v for k, v in data.items() if k not in RETIRED_KEYS})

    @property
    def other_s(self) -> float:
        """Bookkeeping, the hand-off, starting the next groups: an async step pays it too."""
        return max(0.0, self.step_s - self.learner_s - self.gen_compute_s - self.wait_s)

    @property
    def useful_share(self) -> float:
        """The share of the generator's compute that went to groups the step took (the rest
        went to groups aborted mid-generation)."""
        if self.groups <= 0 or self.samples <= 0:
            return 1.0
        pulled_groups = self.samples_pulled * self.groups / self.samples
        return pulled_groups / (pulled_groups + ABORTED_SHARE * self.aborted_groups)

    @property
    def engine_rate(self) -> float | None:
        """Sequence-steps (about tokens) per busy second, from the engine's own counts."""
        if self.engine_batch is None or self.engine_steps <= 0 or self.gen_compute_s <= 0:
            return None
        return self.engine_batch * self.engine_steps / self.gen_compute_s


@dataclass(frozen=True)
class EngineCurve:
    """Decode throughput (tokens per busy second) by batch (sequences in flight), on every core
    and on the generator's share of them (`split`; empty where the run cannot split)."""

    every: tuple[tuple[int, float], ...]
    split: tuple[tuple[int, float], ...] = ()
    seconds: float = 0.0

    def rate(self, batch: float, on_share: bool) -> float:
        """Interpolated in log(batch); flat past the measured batches. A split batch outside the
        split points takes the every-core curve times the split's measured ratio at the nearest
        (the split is measured at the largest batches only; a small batch on the share is not as
        fast as the share's smallest measured one)."""
        points = self.split if on_share and self.split else self.every
        rate = _interpolate(points, batch)
        if on_share and self.split and not self.split[0][0] <= batch <= self.split[-1][0]:
            nearest = self.split[0] if batch < self.split[0][0] else self.split[-1]
            rate = _interpolate(self.every, batch) * nearest[1] / _interpolate(self.every, nearest[0])
        return rate

    def describe(self) -> str:
        every = ", ".join(f"{b}: {r:.0f}" for b, r in self.every)
        split = (f"; on the generator's share: " + ", ".join(f"{b}: {r:.0f}" for b, r in self.split)) if self.split else ""
        return f"tokens/s by batch {every}{split} ({self.seconds:.1f}s)"


def _interpolate(points: tuple[tuple[int, float], ...], batch: float) -> float:
    if not points:
        return 1.0
    if batch <= points[0][0]:
        return points[0][1]
    for (b0, r0), (b1, r1) in zip(points, points[1:]):
        if batch <= b1:
            t = (math.log(batch) - math.log(b0)) / (math.log(b1) - math.log(b0))
            return r0 + t * (r1 - r0)
    return points[-1][1]

