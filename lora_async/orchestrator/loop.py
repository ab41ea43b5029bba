"""The training loop: producers keep vLLM busy, the learner consumes, new versions flow back.

    producers (rollouts.py) --GenRequest--> generator (vLLM, versions v_k, v_k-1 ...)
        | rewards, advantages                       ^
        v                                           | publish.py (a Delivery per version)
    RolloutBuffer (token-bounded) --batches.py--> learner thread (peft) --train_step--> new version

Threads: the asyncio loop (this package), the generator's engine thread, the learner thread.
Every adapter of a fleet has its own producers, batch collector, optimizer, version counter
and step count; the learner holds the base once and steps whichever adapter's batch is ready
first. Synchronous training is this same loop with a staleness window of 0 (`Run.window`):
admission then lets producers start only while the learner waits for data. An auto run starts
so, and after its first steps may widen the window (`auto.py`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import psutil
from rich.console import Console

from ..buffer import Group
from ..config import TrainConfig
from ..errors import TrainingError
from ..progress import run_console
from .auto import begin, observe
from .batches import start_collectors
from .lifecycle import Parts, StopSwitch, finish_run, install_stop_signals, setup_run, stop_workers
from .periodic import after_step, evaluate_all, save_snapshot
from .publish import held_back, publish_and_record, publish_initial
from .rollouts import ROLLOUT_TAG, start_producers
from .rows import step_record, step_row
from .state import AdapterRun, Run, samples_of

READY_POLL_S = 1.0  # how often the idle main loop re-checks the limits and the run's state
MOSTLY_DROPPED = 0.5  # a step whose loss clipped or masked this share of its tokens is shown, once


async def train(config: TrainConfig, resume: bool = False, console: Console | None = None,
                on_step: Callable[[Run], object] | None = None, parts: Parts | None = None,
                stop: StopSwitch | None = None) -> dict[str, Any]:
    """Run training until a limit, a stop signal or a failure; return the summary.

    The shutdown order, whatever ended the run:
    1. the main loop leaves: every adapter did `run.max_steps`, the time budget is spent, a
       signal (or `stop`, pulled from another thread) asked to stop after the current step, or
       `Run.fail` recorded an error;
    2. producers, collectors and the time board's sampler are cancelled (groups still generating
       or buffered are dropped; on resume their prompts are skipped);
    3. pending publishes finish, so every step has its metrics line (`finish_run`);
    4. background evals and the chart are cancelled;
    5. a checkpoint and the final adapters (and the end eval), or after a failure a checkpoint of
       what was learned;
    6. metrics, transport, generator, tasks and the learner thread close, in that order;
    7. a failure is raised as `TrainingError` (after the summary is written).
    """
    run = await setup_run(config, resume, console or run_console(), parts)
    install_stop_signals(run, stop)
    workers: list[asyncio.Task] = []
    try:
        await publish_initial(run)
        if config.run.eval_at_start:
            await evaluate_all(run, "start")
        await begin(run)  # auto: the engine's curve (or a resumed run's choice back in force)
        # What a user waited for before training began (imports, model build, engine start, the
        # first hand-off, the start eval, auto's calibration); the training clock starts now.
        run.metrics.event({"kind": "start", "startup_s": round(time.time() - psutil.Process().create_time(), 2),
                           "resumed": resume})
        run.start_clock()
        ready: asyncio.Queue[tuple[AdapterRun, list[Group]]] = asyncio.Queue()
        run.began = run.marks()
        run.learner_clock.start()
        # the board's sampler runs beside the producers, and is cancelled with them
        workers = start_producers(run) + start_collectors(run, ready) + [asyncio.create_task(run.board.sample())]
        while not run.finished():
            try:
                adapter, groups = await asyncio.wait_for(ready.get(), READY_POLL_S)
            except asyncio.TimeoutError:
                continue
            run.learner_clock.batch_ready()
            try:
                await train_step(run, adapter, groups)
            except Exception as exc:  # the learner failed (a dead rank, out of memory): the run fails,
                run.fail(exc)  # keeping a checkpoint of what was learned, not a "final" adapter
                break
            adapter.trained.set()
            if on_step is not None:
                on_step(run)
            run.learner_clock.step_done()
    finally:
        if run.began is not None:
            run.ended = run.marks()
        await stop_workers(run, workers)
        summary = await finish_run(run)
    if run.error is not None:
        raise TrainingError(str(run.error)) from run.error
    return summary


async def train_step(run: Run, adapter: AdapterRun, groups: list[Group]) -> None:
    """One learner step of one adapter. The new version is handed over in the background, so the
    learner never waits for the engine; the step's metrics line follows its registration."""
    never_worked = adapter.source.stats.never_worked()
    if adapter.step == 0 and never_worked is not None:  # a reward (or an environment) that fails on every call
        run.fail(TrainingError(f"{adapter.name}: every reward call of the first step failed; "
                               f"the first error: {never_worked}"))
        return
    # Groups still generating on versions this step makes too old could only be dropped as
    # stale: stop them now, so the engine (and, on shared cores, the learner) gets the time.
    oldest_useful = run.window.oldest(run.learner.version(adapter.name) + 1)
    run.generator.abort_older(adapter.name, oldest_useful, ROLLOUT_TAG)
    adapter.admission.step_began()
    stats = await run.in_learner(run.learner.train_step, adapter.name, samples_of(groups))
    version = await run.in_learner(run.learner.adapter_version, adapter.name) if stats.updated else None
    adapter.admission.step_ended()
    await run.notify()
    adapter.step += 1
    run.global_step += 1
    adapter.counters.skipped_nonfinite += int(stats.skipped_nonfinite)
    run.learner_clock.trained(stats.seconds)
    ended = run.marks(adapter)  # this step's row ends where the next one's begins
    step = step_record(run, adapter, groups, stats, ended)
    row = step_row(run, adapter, groups, stats, step, ended)
    warn_dropped(run, adapter, row)
    await observe(run, step)  # auto: measure, confirm, or check the step against the prediction
    adapter.last_reward = row["reward_mean"]
    adapter.marks = ended
    if version is not None and snapshot_due(run, adapter):
        save_snapshot(run, adapter, version, row["wall_s"])
    adapter.publishing = asyncio.create_task(publish_and_record(run, adapter, held_back(run, adapter, version), row,
                                                                adapter.publishing))
    await after_step(run, adapter)


def warn_dropped(run: Run, adapter: AdapterRun, row: dict) -> None:
    """Say once when the loss dropped most of a step's tokens (clipped or masked): the step
    learned from few of its samples, because the sampler and the learner disagree (a dtype or a
    quantisation apart) or the samples are far behind."""
    if adapter.warned_dropped or row["clip_frac"] < MOSTLY_DROPPED:
        return
    adapter.warned_dropped = True
    run.console.print(f"[yellow]{adapter.name}: loss.type = {run.config.loss.type} dropped {row['clip_frac']:.0%} of "
                      f"step {adapter.step}'s tokens (logprob mismatch {row['logprob_mismatch']:.3g} nats/token, "
                      f"policy lag {row['policy_lag_mean']:.1f}): the generator's logprobs are far from "
                      "the learner's; see docs/modes-and-losses.md, 'Losses and stale samples'[/]")


def snapshot_due(run: Run, adapter: AdapterRun) -> bool:
    every = run.config.run.save_every
    return bool(every) and adapter.step % every == 0
