"""The run's mode in force: set at the start (`start_mode`), decided by an auto run from what it
measures (`calibrate`, then `observe` on every step), and applied in one place
(`apply_choice`). The model and the decision rules are `lora_async/mode/`.

An auto run on shared compute goes through phases (`Auto.phase`):
- OPEN: it starts async (`opening_choice`); after `OPEN_STEPS` steps, `decide_opened` keeps
  async (at the staleness the model favours) where it is `MARGIN` times sooner to the target
  than the sync step that the step after the fill implies, and otherwise turns sync:
  `REMEASURE_STEPS` steps, the last measured, and the opening's steps correct the model as
  confirming ones would, so a choice of async then is not confirmed again. (Auto used to start with a sync step to
  measure: on the sandbox at 0 s that step took 30-37 s against pinned async's first 16-34 s,
  and the auto runs reached the target 11-37 s after pinned async; bench/RESULTS.md 22c.)
- MEASURE: sync steps; the last of `Auto.measure_steps` is the measurement, and `decide` picks;
- CONFIRM: the async steps after a choice of async: the first fills the pipeline (and its
  learner step is the first at the new thread count); after the second `Model.confirmed`
  corrects the model with what the two measured, and the choice is made again (it may go back
  to sync);
- WATCH: every step against the prediction, per sample drawn; `OFF_STEPS` in a row more than
  `OFF_BY` away and it decides again: in sync from the last steps; in async, steps faster than
  predicted, or slower but (times lag's cost) still sooner than the sync step measured, or
  than the sync step they imply (`async_beats_implied`, as the opening's steps are tested),
  keep async with a new mark, and others run `REMEASURE_STEPS` sync steps to measure again (on the
  v2 task, re-measuring every time async ran slower than predicted but faster than sync
  spent 16 of 112 steps re-measuring).

The decisions and the model behind them go into every checkpoint (`Auto.to_json`); a resumed
run starts in the chosen mode and only watches.

The staleness window in force is `Run.window`, one object (`staleness.WindowInForce`) that the
buffer, every adapter's admission and the learner step's abort hold; only `apply_choice` sets
it, once. The engine was sized at start for the widest window the run may take
(`BufferConfig.window`), so widening it later needs no new LoRA slot. Turning async on shared
CPU cores also re-pins the two halves (the learner's thread and the engine's thread, each
between its steps), as a run pinned async would have been placed from the start.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .. import lag_cost
from ..generator.types import GenRequest, GenStatus
from ..learner import probe
from ..mode import (LEARNER_SPLIT_SLOWDOWN, OFF_STEPS, OPEN_STEPS, REMEASURE_STEPS, Choice, EngineCurve, Mode,
                    StepFigures, StepRecord, async_beats_implied, async_still_sooner, candidates, decide, decide_opened,
                    initial_choice, off_prediction, opening_choice, scaled_step_s)
from ..placement import Placement, available_cpus, pin_current_thread, shares_compute, split_placements
from ..staleness import StalenessWindow, WindowInForce
from .auto_state import CONFIRM, MEASURE, OPEN, WATCH, Auto

if TYPE_CHECKING:
    from ..config import TrainConfig
    from .state import Run

CALIBRATION_PROMPT_TOKENS = 8
CALIBRATION_TOKENS = 4  # decoded per sequence at each batch size (the first step is the prompt's)
CALIBRATION_BATCHES = (1, 8, 32, 128)  # capped by the sequences the run may keep in flight
CALIBRATION_TIMEOUT_S = 120.0  # per batch: a CPU engine decodes 4 x 128 tokens in 2 s


def start_mode(config: "TrainConfig", resumed: dict[str, Any] | None = None) -> tuple[Choice | None, Auto | None, str]:
    """The choice at the start (None: auto calibrates, then opens async), the auto state (None: the mode is
    settled), and the start line's words for it. `resumed`: the checkpoint's auto state."""
    buffer = config.buffer
    choice = initial_choice(buffer.mode, buffer.max_staleness, shares_compute(config),
                            split=split_placements(config) is not None)
    if choice is not None:
        return choice, None, choice.describe()
    costs = lag_cost.load(buffer.lag_costs, config.loss.type)
    lags = candidates(buffer.max_staleness)
    sequences = max(spec.sampling.samples_per_prompt for spec in config.adapter_specs)
    auto = Auto(costs, lags, split_placements(config) is not None, config.generator.groups_in_flight * sequences)
    if resumed and resumed.get("decisions"):
        auto.restore(resumed)
        last = Choice.from_json(resumed["decisions"][-1]["choice"])
        if last.staleness <= buffer.max_staleness:
            resumed_choice = replace(last, split=last.split and auto.split, reason=f"resumed: {last.reason}",
                                     kind="resumed")
            return resumed_choice, auto, resumed_choice.describe()
        auto = Auto(costs, lags, auto.split, auto.batch_cap)  # the window shrank: measure again
    return None, auto, (f"auto: engine and learner calibration, then {OPEN_STEPS} async steps measure; async stays "
                        f"where it is sooner than the sync step they imply, at the staleness out of "
                        f"{', '.join(map(str, lags))} predicted soonest after lag's cost in steps "
                        f"({costs.describe(lags)}); otherwise {REMEASURE_STEPS} sync steps measure and it decides")


def start_window(choice: Choice | None) -> WindowInForce:
    """The run's window in force at the start: the choice's, or 0 while an auto run calibrates."""
    return WindowInForce(StalenessWindow(0) if choice is None else choice.window)


async def begin(run: "Run") -> None:
    """Before training: a resumed auto run puts its choice back in force; one that has not
    decided calibrates the engine and the learner, and opens async."""
    if run.auto is not None:
        run.auto.aborted_seen = sum(a.counters.aborted_stale for a in run.adapters.values())
    if run.choice is not None and run.choice.kind == "resumed":
        await apply_choice(run, run.choice)
        return
    await calibrate(run)
    if run.auto is not None and run.choice is None:
        await settle(run, opening_choice(run.auto.lags, run.auto.split), phase=OPEN)


async def calibrate(run: "Run") -> None:
    """An auto run that has not decided: the engine's decode throughput at a few batch sizes, on
    every core and (where async would split them) on the generator's share. Seconds, before
    training's clock starts."""
    auto = run.auto
    if auto is None or auto.curve is not None or run.choice is not None:
        return
    adapter = next(iter(run.adapters.values()))
    # a few tokens of a task prompt: the curve is about decoding, and a long prompt's prefill
    # (one per sequence) would cost more than the decoding measured
    prompt = (await adapter.source.probe_prompt(run.tokenizer) or list(run.tokenizer("Count to ten:")["input_ids"]))
    prompt = prompt[:CALIBRATION_PROMPT_TOKENS]
    batches = sorted({min(b, auto.batch_cap) for b in CALIBRATION_BATCHES})
    began = time.perf_counter()

    async def rate(batch: int) -> float:
        stats = run.generator.stats
        busy = stats.busy_s
        request = GenRequest(prompt, adapter.name, n=batch, max_tokens=CALIBRATION_TOKENS,
                             min_tokens=CALIBRATION_TOKENS, seed=run.config.run.seed, tag="calibrate")
        result = await asyncio.wait_for(run.generate(request), CALIBRATION_TIMEOUT_S)
        if result.status is not GenStatus.OK:
            raise RuntimeError(f"{result.status.value}: {result.error}")
        tokens = sum(len(s.token_ids) for s in result.samples)
        return tokens / max(stats.busy_s - busy, 1e-6)

    split: tuple[tuple[int, float], ...] = ()
    placements = split_placements(run.config)
    every_core = Placement("cpu", frozenset(available_cpus()))
    try:
        await rate(1)  # warm-up
        every = tuple([(b, round(await rate(b), 2)) for b in batches])
        if auto.split and placements is not None:
            await asyncio.to_thread(run.generator.with_receiver, lambda _: pin_current_thread(placements[0]))
            split = tuple([(b, round(await rate(b), 2)) for b in batches[-2:]])
    except (asyncio.TimeoutError, RuntimeError) as exc:  # the model then assumes no gain from batching
        run.console.print(f"[yellow]auto: the engine's calibration failed ({exc or 'timed out'}); predicting "
                          "without its batch curve[/]")
        every, split = (), ()
    finally:
        if auto.split and placements is not None:
            await asyncio.to_thread(run.generator.with_receiver, lambda _: pin_current_thread(every_core))
    auto.curve = EngineCurve(every, split, round(time.perf_counter() - began, 2))
    run.console.print(f"auto: engine {auto.curve.describe()}", highlight=False)
    learner = await calibrate_learner(run, every_core, placements[1] if placements is not None else None)
    run.metrics.event({"kind": "calibrate", **{f"engine_b{b}_tok_s": r for b, r in every},
                       **{f"engine_share_b{b}_tok_s": r for b, r in split}, "seconds": auto.curve.seconds,
                       **learner})


async def calibrate_learner(run: "Run", every_core: Placement, share: Placement | None) -> dict[str, float]:
    """Where async would split the cores: the learner's seconds per token on every core and on
    its share (`learner/probe.py`), whose ratio the model then takes for the split's cost to
    the learner. A data-parallel learner keeps the assumed cost."""
    from ..learner.learner import Learner  # torch is loaded already (the probe's)

    auto, learner = run.auto, run.learner
    assert auto is not None
    if not auto.split or share is None or not isinstance(learner, Learner):
        return {}
    try:
        every = await run.in_learner(probe.seconds_per_token, learner, every_core, run.config.run.seed)
        on_share = await run.in_learner(probe.seconds_per_token, learner, share, run.config.run.seed)
    except RuntimeError as exc:
        run.console.print(f"[yellow]auto: the learner's calibration failed ({exc}); assuming its step takes "
                          f"{LEARNER_SPLIT_SLOWDOWN}x as long on its share of the cores[/]")
        return {}
    finally:
        await run.in_learner(pin_current_thread, every_core)
    auto.learner_split = round(max(1.0, on_share / every), 3)
    run.console.print(f"auto: learner {1000 * every:.2f} ms/token on every core, {1000 * on_share:.2f} on its "
                      f"share ({auto.learner_split:.2f}x)", highlight=False)
    return {"learner_ms_per_token": round(1000 * every, 3), "learner_share_ms_per_token": round(1000 * on_share, 3),
            "learner_split_cost": auto.learner_split}


async def observe(run: "Run", record: StepRecord) -> None:
    """Every step of an auto run: measure, confirm or watch (the module docstring)."""
    auto = run.auto
    if auto is None:
        return
    aborted = sum(a.counters.aborted_stale for a in run.adapters.values())
    step = StepFigures.of_step(record, aborted - auto.aborted_seen)
    auto.aborted_seen = aborted
    auto.recent = (auto.recent + [step])[-OFF_STEPS:]
    at = run.global_step
    if auto.phase == OPEN and run.choice is not None:
        auto.confirming.append(step)
        if len(auto.confirming) < OPEN_STEPS:
            return
        # decide_opened reads the model's split, curve and learner, not its sync step
        choice = decide_opened(auto.confirming, run.choice, auto.first_model(step), auto.costs, auto.lags, at)
        assert choice.sync is not None
        auto.model = auto.first_model(choice.sync)  # the implied sync step, until one is measured
        if choice.synchronous:  # the first sync step still trains groups the async ones made
            auto.measure_steps, auto.measured, auto.opening_steps = REMEASURE_STEPS, 0, list(auto.confirming)
        await settle(run, choice, phase=MEASURE if choice.synchronous else WATCH)
        return
    if auto.phase == MEASURE:
        auto.measured += 1
        if auto.measured >= auto.measure_steps:
            auto.model = auto.measure(step)
            if auto.opening_steps:  # the opening's async steps already confirm (module docstring)
                auto.model = auto.model.confirmed(auto.opening_steps)
            # the first measurement (after the opening) or a later one (after a check)
            kind = "re-decided" if auto.decisions and auto.decisions[-1]["mode_kind"] != "measure" else "measured"
            await settle(run, decide(auto.model, auto.lags, auto.costs, kind, at), confirm=not auto.opening_steps)
            auto.opening_steps = []
        return
    assert run.choice is not None and auto.model is not None
    if auto.phase == CONFIRM:
        auto.confirming.append(step)
        if len(auto.confirming) < 2:  # the pipeline fills and the threads settle on their cores
            return
        auto.model = auto.model.confirmed(auto.confirming)
        choice = decide(auto.model, auto.lags, auto.costs, "confirmed", at, margin=1.0)
        if choice.synchronous:
            choice = replace(choice, reason=f"async step measured: {choice.reason}", kind="reverted")
        await settle(run, choice, confirm=False)
        return
    scaled = scaled_step_s(step, run.choice)
    auto.off_streak = auto.off_streak + 1 if off_prediction(run.choice.predicted_step_s, scaled) else 0
    if auto.off_streak < OFF_STEPS:
        return
    auto.off_streak = 0
    predicted = run.choice.predicted_step_s or 0.0
    measured = sum(scaled_step_s(s, run.choice) for s in auto.recent) / len(auto.recent)
    why = f"{OFF_STEPS} steps took {measured:.1f}s (per the measured step's samples) against the predicted {predicted:.1f}s"
    if run.choice.synchronous:  # the last sync steps are a measurement
        auto.model = auto.measure(StepFigures.mean(auto.recent))
        await settle(run, decide(auto.model, auto.lags, auto.costs, "re-decided", at), confirm=True, why=why)
        return
    kept = async_still_sooner(run.choice, measured, auto.costs)
    if kept is not None:  # faster than predicted, or slower and still sooner than sync: the mark moves
        await apply_choice(run, replace(run.choice, kind="kept", decided_at_step=at, predicted_step_s=measured,
                                        reason=f"{why}: {kept}, async kept"))
        return
    implied = async_beats_implied(auto.recent, run.choice, auto.model, auto.costs)
    if implied is not None:  # the steps themselves still beat sync: the mark and the sync to beat move to them
        sync, kept = implied
        await apply_choice(run, replace(run.choice, kind="kept", decided_at_step=at, sync=sync,
                                        predicted_step_s=measured,
                                        reason=f"{why}: {kept}, async kept"))
        return
    auto.phase, auto.measure_steps, auto.measured = MEASURE, REMEASURE_STEPS, 0
    await apply_choice(run, Choice(Mode.SYNC, 0, False, f"{why}: {REMEASURE_STEPS} sync steps to measure again",
                                   "re-measure", at))


async def settle(run: "Run", choice: Choice, confirm: bool = False, why: str = "", phase: str | None = None) -> None:
    """Put a decision in force and move to `phase` (by default: an async choice made from sync
    steps is confirmed by the next ones where `confirm`, anything else is watched)."""
    auto = run.auto
    assert auto is not None
    if why:
        choice = replace(choice, reason=f"{why}; {choice.reason}")
    auto.phase = phase or (CONFIRM if confirm and not choice.synchronous else WATCH)
    auto.confirming = []
    await apply_choice(run, choice)


async def apply_choice(run: "Run", choice: Choice) -> None:
    """Put `choice` in force: the window everywhere, the cores re-pinned if it splits them; then
    say so (console, a `mode` metrics event, the auto run's decisions) and wake the producers."""
    repin = run.choice is None or run.choice.split != choice.split or choice.kind == "resumed"
    run.choice = choice
    run.window.current = choice.window  # the buffer and every admission hold this same object
    placements = split_placements(run.config)
    if placements is not None and repin:  # split for async; back to every core for sync
        every = Placement("cpu", frozenset(available_cpus()))  # this (event loop) thread is never pinned
        generator, learner = placements if choice.split else (every, every)
        await run.in_learner(pin_current_thread, learner)
        await asyncio.to_thread(run.generator.with_receiver, lambda _: pin_current_thread(generator))
    run.console.print(f"mode ({choice.kind}, step {choice.decided_at_step}): {choice.describe()}", highlight=False)
    figures = choice.figures()
    run.metrics.event({"kind": "mode", "step": run.global_step, "wall_s": round(run.wall_s, 3), **figures})
    if run.auto is not None:
        run.auto.off_streak = 0
        run.auto.decisions.append({"step": run.global_step, "wall_s": round(run.wall_s, 3), **figures,
                                   "choice": choice.to_json()})
    await run.notify()
