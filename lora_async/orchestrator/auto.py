"""The run's mode in force: set at the start (`start_mode`), or by an auto run once it has
measured its first steps (`observe`), and applied in one place (`apply_choice`).

The staleness window in force is `Run.window`: the buffer, every adapter's admission and the
learner step's abort all read it, and only `apply_choice` changes it. The engine was sized at
start for the widest window the run may take (`BufferConfig.window`), so widening it later
needs no new LoRA slot. Turning async on shared CPU cores also re-pins the two halves (the
learner's thread and the engine's thread, each between its steps), as a run pinned async would
have been placed from the start.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from ..mode import PROBE_STEPS, TRIAL_SKIP, TRIAL_STEPS, Choice, SyncStep, initial_choice, judge, probing, trial
from ..placement import Placement, available_cpus, pin_current_thread, shares_compute, split_placements
from ..staleness import StalenessWindow

if TYPE_CHECKING:
    from ..config import TrainConfig
    from .state import Run


def start_mode(config: "TrainConfig") -> tuple[Choice | None, str]:
    """The choice at the start (None: auto measures first) and the start line's words for it."""
    buffer = config.buffer
    choice = initial_choice(buffer.mode, buffer.max_staleness, shares_compute(config),
                            split=split_placements(config) is not None)
    return choice, (choice.describe() if choice is not None else probing(buffer.max_staleness))


def start_window(choice: Choice | None) -> StalenessWindow:
    return StalenessWindow(0 if choice is None else choice.staleness)


async def observe(run: "Run", row: dict[str, Any]) -> None:
    """An auto run's step rows: `PROBE_STEPS` sync ones, then an async trial of `TRIAL_STEPS`;
    then it keeps the faster (`mode.judge`) and is decided."""
    if run.choice is not None and not run.trying:
        return
    if run.choice is None:  # measuring sync
        run.probe_rows.append(row)
        if len(run.probe_rows) == PROBE_STEPS:
            split = split_placements(run.config) is not None
            run.trying = True
            await apply_choice(run, trial(SyncStep.of_rows(run.probe_rows), run.config.buffer.max_staleness, split,
                                          at_step=run.global_step))
        return
    run.trial_rows.append(row)
    if len(run.trial_rows) == TRIAL_STEPS:
        run.trying = False
        await apply_choice(run, judge(run.probe_rows, run.trial_rows[TRIAL_SKIP:], run.choice,
                                      at_step=run.global_step))


async def apply_choice(run: "Run", choice: Choice) -> None:
    """Put `choice` in force: the window everywhere, the cores re-pinned if it splits them; then
    say so (console, a `mode` metrics event) and wake the producers."""
    run.choice = choice
    window = StalenessWindow(choice.staleness)
    run.window = window
    run.buffer.window = window
    for adapter in run.adapters.values():
        adapter.admission.window = window
    placements = split_placements(run.config)
    if placements is not None:  # split for async; back to every core for sync
        every = Placement("cpu", frozenset(available_cpus()))  # this (event loop) thread is never pinned
        generator, learner = placements if choice.split else (every, every)
        await run.in_learner(pin_current_thread, learner)
        await asyncio.to_thread(run.generator.with_receiver, lambda _: pin_current_thread(generator))
    run.console.print(f"mode: {choice.describe()}", highlight=False)
    run.metrics.event({"kind": "mode", "wall_s": round(run.wall_s, 3), "trial": run.trying, **choice.figures()})
    await run.notify()
