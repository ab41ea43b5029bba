"""The predicted async step at each staleness (`Model`), from a measured sync step and the
engine's curve, corrected by the steps that confirm it."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..lag_cost import LagCosts
from .measured import EngineCurve, StepFigures

# Where the learner's calibration did not run (`learner/probe.py`): a learner step on one of two
# cores took a median 1.7x its time on both (bench/RESULTS.md section 7).
LEARNER_SPLIT_SLOWDOWN = 1.7


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




def predict(model: Model, lags: list[int], costs: LagCosts) -> tuple[Prediction, ...]:
    return tuple(Prediction(k, model.step_s(k), costs.at(k)) for k in lags)



def implied_sync(step: StepFigures, split: bool, curve: EngineCurve | None,
                 learner_share_cost: float, batch: float | None) -> StepFigures:
    """The sync step an async step implies, with its engine at `batch`: the
    learner on every core (its step over the share's cost), the step's generation on every core
    at `batch`, waits, and the rest as measured. The waits: what the async step could not hide,
    or a median call of each kind its rollouts made (a sync step's last rollouts wait on theirs
    with nothing left to generate), the longer."""
    gen = step.gen_compute_s
    if curve is not None and step.engine_batch is not None and batch is not None:
        gen *= curve.rate(step.engine_batch, split) / curve.rate(batch, False)
    learner = step.learner_s / learner_share_cost if split else step.learner_s
    waits = max(step.wait_s, step.call_wait_s)
    return StepFigures(learner + gen + waits + step.other_s, learner, gen, waits, batch, step.engine_steps,
                       step.samples, step.groups, step.samples_pulled, 0, step.learner_tokens, step.call_wait_s)
