"""The choice (`Choice`): sync, or async at a staleness, how it came about and why; the rules
that make it (`decide`, `initial_choice`, `opening_choice`, `decide_opened`) and that check it
step by step (`off_prediction`, `scaled_step_s`, `async_still_sooner`, `async_beats_implied`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from enum import Enum
from typing import Any

from ..lag_cost import LagCosts
from ..staleness import StalenessWindow
from .measured import StepFigures
from .predict import Model, Prediction, implied_sync, predict

CANDIDATES = (0, 1, 2, 4)  # the staleness values auto weighs (capped by buffer.max_staleness)
MARGIN = 1.05  # async must be predicted this many times sooner to the target than sync
OFF_BY = 0.25  # a step this far from its prediction ...
OFF_STEPS = 3  # ... this many times in a row: decide again
# An auto run opens async at this staleness (or max_staleness where lower): the generator a step
# or two ahead, and room on either side for the model to move it
OPEN_STALENESS = 2
OPEN_STEPS = 2  # the one that fills the pipeline, and one more
REMEASURE_STEPS = 2  # an async run that decides again runs sync this long; the last one measures


class Mode(str, Enum):
    SYNC = "sync"
    ASYNC = "async"


@dataclass(frozen=True)
class Choice:
    """A run's mode: sync, or async at `staleness` (with the shared cores split between the two
    halves when `split`); `kind` says how it came about, `reason` why, in words."""

    mode: Mode
    staleness: int
    split: bool
    reason: str
    # pinned | opened | measure | measured | confirmed | reverted | re-measure | re-decided | kept | resumed
    kind: str = "pinned"
    decided_at_step: int = 0
    predicted_step_s: float | None = None  # what the steps in this mode should take (the monitor's mark)
    predictions: tuple[Prediction, ...] = ()
    sync: StepFigures | None = None

    def __post_init__(self) -> None:
        if (self.mode is Mode.SYNC) != self.window.synchronous:
            raise ValueError(f"a {self.mode.value} choice at staleness {self.staleness}: sync is staleness 0")

    @property
    def window(self) -> StalenessWindow:
        """The staleness window this choice puts in force."""
        return StalenessWindow(self.staleness)

    @property
    def synchronous(self) -> bool:
        return self.window.synchronous

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
                      "sync": StepFigures.from_json(data["sync"]) if data.get("sync") else None})


def candidates(max_staleness: int) -> list[int]:
    return sorted({k for k in (*CANDIDATES, max_staleness) if k <= max_staleness})


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
    (`shared` False), or None: an auto run on shared compute calibrates, then opens async
(`opening_choice`). `split`: a pinned
    async run's placement gave each half its own cores."""
    if StalenessWindow.widest(mode, max_staleness).synchronous:
        return Choice(Mode.SYNC, 0, False, "pinned by buffer.mode" if mode == "sync" else "buffer.max_staleness = 0")
    if mode == "async":
        return Choice(Mode.ASYNC, max_staleness, split, "pinned by buffer.mode")
    if not shared:
        return Choice(Mode.ASYNC, max_staleness, False, "the learner has a device of its own (nothing is shared)")
    return None


def opening_choice(lags: list[int], split: bool) -> Choice:
    """Where an auto run on shared compute starts: async, at `OPEN_STALENESS` or the largest
    staleness allowed below it; its first steps then decide (`decide_opened`)."""
    k = max(k for k in lags if k <= max(OPEN_STALENESS, min(k for k in lags if k > 0)))
    return Choice(Mode.ASYNC, k, split, f"opens async at k{k}; its first {OPEN_STEPS} steps say whether sync could "
                  "be sooner", "opening", 0)


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


def implied_by(steps: list[StepFigures], staleness: int, model: Model) -> StepFigures:
    """The sync step that async steps at `staleness` imply (`implied_sync`), at the batch sync
    would run: the model's own assumption, inverted (async at k keeps k + 1 times sync's batch
    in flight)."""
    mean = StepFigures.mean(steps)
    batch = mean.engine_batch / (staleness + 1) if mean.engine_batch is not None else None
    return implied_sync(mean, model.split, model.curve, model.learner_share_cost, batch)


def async_beats_implied(steps: list[StepFigures], choice: Choice, model: Model,
                        costs: LagCosts) -> tuple[StepFigures, str] | None:
    """Async steps that drifted from their prediction, tested as the opening tests its steps:
    the sync step they imply and why async, times lag's cost, still reaches the target `MARGIN`
    times sooner, or None (then only sync steps can tell). Both sides are at the samples these
    steps drew, so the reason gives their own step time, not the one scaled for the check."""
    implied = implied_by(steps, choice.staleness, model)
    step_s = StepFigures.mean(steps).step_s
    took = step_s * costs.at(choice.staleness)
    if took * MARGIN > implied.step_s:
        return None
    return implied, (f"at {step_s:.1f}s a step as drawn, x{costs.at(choice.staleness):.2f} for lag still "
                     f"{implied.step_s / took:.2f}x sooner than the sync step they imply ({implied.step_s:.1f}s)")


def decide_opened(steps: list[StepFigures], opened: Choice, model: Model, costs: LagCosts, lags: list[int],
                  at: int) -> Choice:
    """After the async steps an auto run opened with (`steps`, at `opened.staleness`; `model`
    gives the split, the batch cap, the curve and the learner's cost on its share; its `sync`
    is not read): async stays, at the staleness the model's ratios favour, where it reaches
    the target `MARGIN` times sooner than the sync step they imply; otherwise sync steps
    measure what sync costs (`kind` "measure"). The first step filled the pipeline (any mode
    pays that once), so the steps after it decide, with the calls that any of them made."""
    k0 = opened.staleness
    # the calls any of them waited on (a step whose groups were scored in the step before made none)
    mean = replace(StepFigures.mean(steps[1:] or steps), call_wait_s=StepFigures.mean(steps).call_wait_s)
    implied = implied_by([mean], k0, model)
    took = (f"async at k{k0} took {mean.step_s:.1f}s a step after the fill (x{costs.at(k0):.2f} for lag); "
            f"the sync step it implies: {implied.step_s:.1f}s")
    if mean.step_s * costs.at(k0) * MARGIN > implied.step_s:
        return Choice(Mode.SYNC, 0, False, f"{took}: {REMEASURE_STEPS} sync steps measure", "measure", at,
                      implied.step_s, (), implied)
    # the other staleness values from the model's ratios to k0, anchored at what k0 measured
    ratios = replace(model, sync=implied)
    anchor = mean.step_s / ratios.step_s(k0) if ratios.step_s(k0) > 0 else 1.0
    predictions = (Prediction(0, implied.step_s, costs.at(0)),
                   *(Prediction(k, ratios.step_s(k) * anchor, costs.at(k)) for k in lags if k > 0))
    best = min(predictions[1:], key=lambda p: (p.to_target, p.staleness))
    table = ", ".join(f"k{p.staleness} {p.step_s:.1f}s x{p.lag_cost:.2f}" for p in predictions[1:])
    return Choice(Mode.ASYNC, best.staleness, opened.split,
                  f"{took}: async {implied.step_s / best.to_target:.2f}x sooner; predicted {table}: k{best.staleness}",
                  "opened", at, best.step_s, predictions, implied)
