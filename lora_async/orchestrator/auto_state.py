"""An auto run's state (`orchestrator/auto.py` drives it): the engine's curve, the model behind
the choice in force, where it is in deciding, and every decision so far. All of it goes into
the checkpoint (`to_json`), so a resumed run neither calibrates nor measures again."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..lag_cost import LagCosts
from ..mode import LEARNER_SPLIT_SLOWDOWN, EngineCurve, Model, StepFigures

OPEN, MEASURE, CONFIRM, WATCH = "open", "measure", "confirm", "watch"


@dataclass
class Auto:
    """An auto run's measurements and where it is in deciding."""

    costs: LagCosts
    lags: list[int]
    split: bool
    batch_cap: int
    curve: EngineCurve | None = None
    learner_split: float | None = None  # the learner's step on its share / on every core (calibrated)
    model: Model | None = None
    phase: str = OPEN
    measure_steps: int = 1  # sync steps to run before deciding; the last one is measured
    measured: int = 0
    confirming: list[StepFigures] = field(default_factory=list)  # OPEN, CONFIRM: the async steps so far
    # the opening's async steps, where sync then measures: they correct the model as confirming
    # steps would (the learner on its share, the engine's rate), so async needs no confirming
    opening_steps: list[StepFigures] = field(default_factory=list)
    recent: list[StepFigures] = field(default_factory=list)  # the last OFF_STEPS steps
    off_streak: int = 0
    aborted_seen: int = 0  # the adapters' aborted-group counters at the last row
    decisions: list[dict[str, Any]] = field(default_factory=list)  # every choice's figures (summary.json)

    def measure(self, sync: StepFigures) -> Model:
        """A model from a new sync measurement; what a confirming step measured (the learner's
        cost on its share, the engine's rate) carries over."""
        return self.first_model(sync) if self.model is None else replace(self.model, sync=sync)

    def first_model(self, sync: StepFigures) -> Model:
        """A model of this run's split, batch cap, engine curve and calibrated learner, with `sync`
        as its sync step (measured, or implied by the opening's async steps)."""
        return Model(sync, self.split, self.batch_cap, self.curve, learner_share_cost=self.share_cost)

    @property
    def share_cost(self) -> float:
        """The learner's step on its share of the cores over its step on every core."""
        return self.learner_split or LEARNER_SPLIT_SLOWDOWN

    def to_json(self) -> dict[str, Any]:
        return {"phase": self.phase, "curve": asdict(self.curve) if self.curve else None,
                "learner_split": self.learner_split,
                "model": _model_json(self.model), "decisions": self.decisions}

    def restore(self, data: dict[str, Any]) -> None:
        curve = data.get("curve")
        self.curve = EngineCurve(tuple((int(b), float(r)) for b, r in curve["every"]),
                                 tuple((int(b), float(r)) for b, r in curve["split"]), curve["seconds"]) if curve else None
        model = data.get("model")
        if model is not None:
            self.model = Model(**{**model, "sync": StepFigures.from_json(model["sync"]), "curve": self.curve})
        self.learner_split = data.get("learner_split")
        # a run stopped while it opened or confirmed watches its choice (the model is saved)
        self.phase = MEASURE if data.get("phase") == MEASURE else WATCH if self.model is not None else OPEN
        self.decisions = list(data.get("decisions", []))


def _model_json(model: Model | None) -> dict[str, Any] | None:
    if model is None:
        return None
    data = asdict(model)
    data.pop("curve")
    return data
