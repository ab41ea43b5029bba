"""Sync or async, and at what staleness: the choice `buffer.mode = "auto"` makes, and why.

Asynchrony pays where a half would otherwise wait (a tool, a reward, an environment, a device
of its own), and on a CPU engine also through batching: async keeps more requests in flight,
and the engine's throughput grows with its batch. It costs twice: on shared cores each half
computes on a share of them, and a sample k versions old teaches less (`lag_cost.py`).

Where the learner has a device of its own (another GPU, remote generators), an auto run is
async from the start. Where the two halves share compute, it decides from what it measures:
1. **the engine and the learner, in seconds** (`EngineCurve`, at start-up): decode throughput at
   a few batch sizes on every core, and on the generator's share where an async run would split
   them,
   and the learner's speed per token on every core and on its share (`learner/probe.py`);
2. **the first step, run sync** (`StepFigures`): the learner's compute, the generator's compute,
   the waits on rewards, tools and environments, the engine's batch;
3. **a prediction for each staleness k in {0, 1, 2, 4}** (up to `buffer.max_staleness`;
   `Model.step_s`), each weighed by k's steps-to-target ratio r(k); the one with the least
   predicted time to target (`step x r(k)`) is chosen (`decide`), async only if `MARGIN` times
   better than sync;
4. **the first async steps confirm it** (`Model.confirmed`): the one that fills the pipeline
   and re-pins the threads, and the one after. The learner's cost per token and the engine's
   rate on their shares, each the better of the two steps (the first learner step at a new
   thread count and the fill's burst of prompts measured 1.5-2.5x a steady step), replace the
   assumed ones, and the choice is made again on the corrected model. It falls back to sync
   there only if sync is then predicted sooner (no margin: staying costs nothing, switching
   back a step).
Then it keeps checking: a step `OFF_BY` away from its prediction, per sample drawn
(`scaled_step_s`: a task being solved draws more groups per step), `OFF_STEPS` times in a row
(a tool got slower, generations got longer) makes it decide again: from the last sync steps
if it is sync, after `REMEASURE_STEPS` sync steps if it is async.

The model of an async step at staleness k, with the shared cores split between the halves
(the learner trains step n while the generator makes step n+1's groups, up to k + 1 steps'
worth of groups in flight, whose waits overlap each other and the learner):

    gen(k)   = sync's generator compute x useful share x rate(sync batch) / rate_share(batch x (k+1))
    async(k) = max(learner x learner share cost, gen(k), (gen(k) + waits) / (k + 1)) + other

where the halves cannot be split (one GPU for both) their compute adds up and only waits hide:

    async(k) = max(learner + gen(k), (gen(k) + waits) / (k + 1)) + other

"useful share" is the part of sync's generator compute that went to groups it trained: sync
aborts the groups still generating when a step starts, async keeps them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from enum import Enum
from typing import Any

from .lag_cost import LagCosts

CANDIDATES = (0, 1, 2, 4)  # the staleness values auto weighs (capped by buffer.max_staleness)
MARGIN = 1.05  # async must be predicted this many times sooner to the target than sync
OFF_BY = 0.25  # a step this far from its prediction ...
OFF_STEPS = 3  # ... this many times in a row: decide again
REMEASURE_STEPS = 2  # an async run that decides again runs sync this long; the last one measures
# Where the learner's calibration did not run (`learner/probe.py`): a learner step on one of two
# cores took a median 1.7x its time on both (bench/RESULTS.md section 7).
LEARNER_SPLIT_SLOWDOWN = 1.7
ABORTED_SHARE = 0.5  # a group aborted mid-generation had made about half its tokens


class Mode(str, Enum):
    SYNC = "sync"
    ASYNC = "async"


@dataclass(frozen=True)
class StepFigures:
    """What auto reads of a step row (`orchestrator.rows.step_row`), by name: a renamed key fails
    here, loudly, instead of reading as zero."""

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
    learner_cpu_s: float = 0.0  # the process's CPU seconds over the learner's step (all threads)

    @classmethod
    def of_row(cls, row: dict[str, Any], aborted_groups: int = 0) -> "StepFigures":
        waits = row["gen_idle_reward_s"] + row["gen_idle_tool_s"] + row["gen_idle_env_s"]
        return cls(float(row["step_s"]), float(row["learner_s"]), float(row["gen_compute_s"]), float(waits),
                   row["engine_running_mean"], float(row["engine_steps"]), int(row["samples"]), int(row["groups"]),
                   int(row["samples_pulled"]), aborted_groups, int(row["tokens_trained"]) + int(row["padded_tokens"]),
                   float(row["learner_cpu_s"]))

    @classmethod
    def mean(cls, steps: list["StepFigures"]) -> "StepFigures":
        n = len(steps)
        batches = [s.engine_batch for s in steps if s.engine_batch is not None]
        def mean(name: str) -> float:
            return sum(getattr(s, name) for s in steps) / n

        return cls(mean("step_s"), mean("learner_s"), mean("gen_compute_s"), mean("wait_s"),
                   sum(batches) / len(batches) if batches else None, mean("engine_steps"), round(mean("samples")),
                   round(mean("groups")), round(mean("samples_pulled")), round(mean("aborted_groups")),
                   round(mean("learner_tokens")), mean("learner_cpu_s"))

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
        """Interpolated in log(batch); flat past the measured batches. A split batch beyond the
        split points takes the every-core curve times the split's measured ratio."""
        points = self.split if on_share and self.split else self.every
        rate = _interpolate(points, batch)
        if on_share and self.split and batch > self.split[-1][0]:
            rate = _interpolate(self.every, batch) * self.split[-1][1] / _interpolate(self.every, self.split[-1][0])
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


@dataclass(frozen=True)
class Model:
    """A measured sync step and the engine's curve: the predicted step at each staleness."""

    sync: StepFigures
    split: bool  # an async run would split the shared cores between the halves
    batch_cap: int  # the most sequences the run keeps in flight (groups_in_flight x samples per group)
    curve: EngineCurve | None = None
    learner_share_cost: float = LEARNER_SPLIT_SLOWDOWN  # learner step on its share / on every core
    gen_correction: float = 1.0  # measured async generator compute / predicted (a confirming step)

    def async_batch(self, staleness: int) -> float | None:
        if self.sync.engine_batch is None:
            return None
        return min(self.batch_cap, self.sync.engine_batch * (staleness + 1))

    def gen_s(self, staleness: int) -> float:
        """The generator's compute per async step at `staleness`."""
        compute = self.sync.gen_compute_s * self.sync.useful_share * self.gen_correction
        batch = self.async_batch(staleness)
        if self.curve is None or batch is None or self.sync.engine_batch is None:
            return compute
        return compute * self.curve.rate(self.sync.engine_batch, False) / self.curve.rate(batch, self.split)

    def step_s(self, staleness: int) -> float:
        sync = self.sync
        if staleness == 0:
            return sync.step_s
        gen = self.gen_s(staleness)
        overlap = (gen + sync.wait_s) / (staleness + 1)
        if not self.split:
            return max(sync.learner_s + gen, overlap) + sync.other_s
        return max(sync.learner_s * self.learner_share_cost, gen, overlap) + sync.other_s

    def confirmed(self, steps: list[StepFigures]) -> "Model":
        """The model corrected by the first async steps (the one that filled the pipeline and
        the one after): the learner's measured cost on its share, and the engine's measured
        rate at the batch it ran against sync's (from the engine's own counts, so a step still
        filling its pipeline reads right). Each from the better of the steps: what slows one
        (the first learner step on a new thread count, the fill's burst of prompts) passes,
        and measured 1.5-2.5x the steady cost on the demo."""
        share_cost = 1.0
        if self.split and self.sync.learner_s > 0:
            share_cost = max(1.0, min(_per_token(step) for step in steps) / _per_token(self.sync))
        corrections = [c for c in (self._gen_correction(step) for step in steps) if c is not None]
        return replace(self, learner_share_cost=share_cost,
                       gen_correction=min(corrections) if corrections else self.gen_correction)

    def _gen_correction(self, step: StepFigures) -> float | None:
        sync_rate, async_rate = self.sync.engine_rate, step.engine_rate
        if not sync_rate or not async_rate or self.sync.engine_batch is None or step.engine_batch is None:
            return None
        # the curve's error at the batches the two steps ran (the async one may not have
        # reached the batch the model expects: that is the model's assumption, not the curve's)
        assumed = (self.curve.rate(self.sync.engine_batch, False) / self.curve.rate(step.engine_batch, self.split)
                   if self.curve is not None else 1.0)
        return (sync_rate / async_rate) / assumed


def _per_token(step: StepFigures) -> float:
    """The learner's seconds per token it computed on (per step where tokens are not counted):
    steps differ in length, so their times compare only per token."""
    return step.learner_s / step.learner_tokens if step.learner_tokens > 0 else step.learner_s


@dataclass(frozen=True)
class Prediction:
    staleness: int
    step_s: float
    lag_cost: float

    @property
    def to_target(self) -> float:
        """Relative time to the target: steps (by the lag's ratio) times step time."""
        return self.step_s * self.lag_cost


@dataclass(frozen=True)
class Choice:
    """A run's mode: sync, or async at `staleness` (with the shared cores split between the two
    halves when `split`); `kind` says how it came about, `reason` why, in words."""

    mode: Mode
    staleness: int
    split: bool
    reason: str
    kind: str = "pinned"  # pinned | measured | confirmed | reverted | re-measure | re-decided | resumed
    decided_at_step: int = 0
    predicted_step_s: float | None = None  # what the steps in this mode should take (the monitor's mark)
    predictions: tuple[Prediction, ...] = ()
    sync: StepFigures | None = None

    @property
    def synchronous(self) -> bool:
        return self.mode is Mode.SYNC

    def describe(self) -> str:
        if self.synchronous:
            return f"sync: {self.reason}"
        where = "generator and learner on their own cores" if self.split else "no core split"
        return f"async (max_staleness {self.staleness}; {where}): {self.reason}"

    def figures(self) -> dict[str, Any]:
        """For `summary.json` and the `mode` metrics event: flat `mode_*` keys."""
        out: dict[str, Any] = {"mode": self.mode.value, "mode_staleness": self.staleness, "mode_split": self.split,
                               "mode_reason": self.reason, "mode_kind": self.kind,
                               "mode_decided_at_step": self.decided_at_step}
        if self.predicted_step_s is not None:
            out["mode_predicted_step_s"] = round(self.predicted_step_s, 3)
        for p in self.predictions:
            out[f"mode_k{p.staleness}_step_s"] = round(p.step_s, 3)
            out[f"mode_k{p.staleness}_lag_cost"] = p.lag_cost
        if self.sync is not None:
            out.update({f"mode_sync_{k}": round(v, 3) for k, v in asdict(self.sync).items()
                        if isinstance(v, (int, float))})
        return out

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["mode"] = self.mode.value
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Choice":
        return cls(**{**data, "mode": Mode(data["mode"]),
                      "predictions": tuple(Prediction(**p) for p in data.get("predictions", ())),
                      "sync": StepFigures(**data["sync"]) if data.get("sync") else None})


def candidates(max_staleness: int) -> list[int]:
    return sorted({k for k in (*CANDIDATES, max_staleness) if k <= max_staleness})


def predict(model: Model, lags: list[int], costs: LagCosts) -> tuple[Prediction, ...]:
    return tuple(Prediction(k, model.step_s(k), costs.at(k)) for k in lags)


def decide(model: Model, lags: list[int], costs: LagCosts, kind: str, at_step: int, margin: float = MARGIN) -> Choice:
    """The staleness with the least predicted time to the target; async only if it beats sync's
    by `margin` (`MARGIN` to turn async; 1 to stay async, where switching back costs a step)."""
    predictions = predict(model, lags, costs)
    sync = next(p for p in predictions if p.staleness == 0)
    best = min(predictions, key=lambda p: (p.to_target, p.staleness))
    waits = f"sync step {model.sync.step_s:.1f}s, waits {100 * model.sync.wait_s / max(model.sync.step_s, 1e-9):.0f}%"
    table = ", ".join(f"k{p.staleness} {p.step_s:.1f}s x{p.lag_cost:.2f}" for p in predictions if p.staleness)
    if best.staleness > 0 and best.to_target * margin <= sync.to_target:
        return Choice(Mode.ASYNC, best.staleness, model.split,
                      f"{waits}; predicted {table}: k{best.staleness} reaches the target "
                      f"{sync.to_target / best.to_target:.2f}x sooner", kind, at_step, best.step_s, predictions,
                      model.sync)
    runner_up = min((p for p in predictions if p.staleness), key=lambda p: p.to_target, default=None)
    why = (f"no staleness is predicted {margin:g}x sooner to the target (best k{runner_up.staleness}: "
           f"{sync.to_target / runner_up.to_target:.2f}x)") if runner_up else "buffer.max_staleness = 0"
    return Choice(Mode.SYNC, 0, False, f"{waits}; predicted {table}; {why}" if table else why, kind, at_step,
                  sync.step_s, predictions, model.sync)


def initial_choice(mode: str, max_staleness: int, shared: bool, split: bool) -> Choice | None:
    """The choice before any step: what the config pins (`buffer.mode` sync or async, or
    max_staleness 0), async where the learner does not share compute with the generator
    (`shared` False), or None: an auto run on shared compute measures first. `split`: a pinned
    async run's placement gave each half its own cores."""
    if mode == "sync" or max_staleness == 0:
        return Choice(Mode.SYNC, 0, False, "pinned by buffer.mode" if mode == "sync" else "buffer.max_staleness = 0")
    if mode == "async":
        return Choice(Mode.ASYNC, max_staleness, split, "pinned by buffer.mode")
    if not shared:
        return Choice(Mode.ASYNC, max_staleness, False, "the learner has a device of its own (nothing is shared)")
    return None


def off_prediction(predicted: float | None, measured: float) -> bool:
    return predicted is not None and predicted > 0 and abs(measured / predicted - 1.0) > OFF_BY


def scaled_step_s(step: StepFigures, choice: Choice) -> float:
    """A step's time with its generation scaled to the samples of the step behind `choice`'s
    prediction: a task being solved draws more groups per step (those with one reward train
    nothing), each costing the generator the same, while the learner trains as many. Steps
    compare with the prediction per sample drawn."""
    reference = choice.sync.samples_pulled if choice.sync is not None else 0
    if reference <= 0 or step.samples_pulled <= 0:
        return step.step_s
    generating = min(step.step_s, step.gen_compute_s + step.wait_s)
    return step.step_s - generating * (1.0 - reference / step.samples_pulled)


def async_still_sooner(choice: Choice, measured_s: float, costs: LagCosts) -> str | None:
    """Why async steps that took `measured_s` (scaled to the measured step's samples) keep
    async, or None: they must beat their prediction, or, times lag's cost, the sync step
    measured (staying costs nothing; going back costs sync steps to measure)."""
    if choice.predicted_step_s is not None and measured_s < choice.predicted_step_s:
        return "faster than predicted"
    if choice.sync is None or measured_s <= 0:
        return None
    to_target = measured_s * costs.at(choice.staleness)
    if to_target >= choice.sync.step_s:
        return None
    return (f"x{costs.at(choice.staleness):.2f} for lag still {choice.sync.step_s / to_target:.2f}x sooner than the "
            f"sync step measured ({choice.sync.step_s:.1f}s)")
