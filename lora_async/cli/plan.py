"""`lora-async plan CONFIG`: the run's memory per device before anything loads; and the same
check `lora-async train` makes first (`memory_gate`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console

from .common import CONFIG_HELP, SET_HELP, fail, load_or_exit, warn

if TYPE_CHECKING:
    from ..config import TrainConfig
    from ..plan import Machine

PLAN_HINT = "`lora-async plan` shows the table; --force starts anyway"


def plan_command(
    config: Optional[Path] = typer.Argument(None, help=CONFIG_HELP),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    gpus: Optional[int] = typer.Option(None, "--gpus", min=0, max=64,
                                       help="Plan for a machine with this many GPUs (with --gpu-memory-gb)."),
    gpu_memory_gb: Optional[float] = typer.Option(None, "--gpu-memory-gb", min=1.0, max=4096.0,
                                                  help="Memory of each hypothetical GPU, in GiB."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Memory per device (learner, generator, framework) and whether the run fits; exit 2 if not."""
    cfg = load_or_exit(config, set_)
    from ..plan import PlanUnavailable, load_shape, plan_run
    from ..plan.knobs import find_knobs
    from ..plan.report import as_json as plan_json, render, verdict

    machine = machine_for(gpus, gpu_memory_gb)
    try:
        shape = load_shape(cfg.model.name)
        plan = plan_run(cfg, machine, shape)
    except PlanUnavailable as exc:
        fail(f"cannot plan: {exc}", code=1)
    knobs = [] if plan.fits else find_knobs(cfg, machine, shape, plan)
    if as_json:
        print(json.dumps(plan_json(plan, knobs)))
    else:
        render(plan, knobs, Console())
    if not plan.fits:
        Console(stderr=True).print(verdict(plan, knobs), highlight=False, soft_wrap=True)
        raise typer.Exit(2)


def machine_for(gpus: Optional[int], gpu_memory_gb: Optional[float]) -> "Machine":
    from ..plan import Machine

    if (gpus is None) != (gpu_memory_gb is None):
        fail("--gpus and --gpu-memory-gb go together (a hypothetical machine needs both)")
    if gpus is None:
        return Machine.this()
    return Machine.with_gpus(gpus, gpu_memory_gb or 0.0)


def memory_gate(cfg: "TrainConfig", force: bool) -> None:
    """`train`'s check before anything loads: refuse in one line (exit 2) a run the plan says
    cannot fit, unless `force` (`plan.gate.memory_gate`)."""
    from ..plan.gate import PlanRefused, memory_gate as gate

    try:
        gate(cfg, force, warn, PLAN_HINT)
    except PlanRefused as exc:
        fail(str(exc), code=2)
