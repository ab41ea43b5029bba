"""The check `train` makes before anything loads: refuse a run the memory plan says cannot fit."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..errors import UserError

if TYPE_CHECKING:
    from ..config import TrainConfig


class PlanRefused(UserError):
    """The plan says the run cannot fit (one line: the verdict and the settings that would fit)."""


def memory_gate(cfg: "TrainConfig", force: bool, warn: Callable[[str], None], hint: str,
                forced_by: str = "--force") -> None:
    """Raise `PlanRefused` (its line ends with `hint`: how to see the table, how to start anyway)
    for a run the plan says cannot fit, unless `force`, which only warns. Silent when it fits; a
    model whose config.json is not on disk (a hub id not downloaded yet) is a warning, not a
    refusal. `forced_by` names the setting that forced it, in the warning."""
    from .estimate import plan_run
    from .knobs import find_knobs
    from .machine import Machine
    from .report import verdict
    from .shapes import NothingToPlan, PlanUnavailable, load_shape

    try:
        machine = Machine.this()
        shape = load_shape(cfg.model.name)
        plan = plan_run(cfg, machine, shape)
    except NothingToPlan:
        return  # the run's own checks say what is wrong, in their one line
    except PlanUnavailable as exc:
        warn(f"memory plan skipped: {exc}")
        return
    if plan.fits:
        return
    line = f"{verdict(plan, find_knobs(cfg, machine, shape, plan))} ({hint})"
    if not force:
        raise PlanRefused(line)
    warn(f"{line}; starting anyway ({forced_by})")
