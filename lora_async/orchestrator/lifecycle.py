"""Setting a run up and tearing it down.

`setup_run` builds the parts (`Parts`: the real ones from the config by default, fakes in
tests), restores a checkpoint on `--resume`, and opens the metrics. `finish_run` does the end of
the shutdown order written in `loop.train`: pending publishes, checkpoint and final adapters
(or, after a failure, a checkpoint of what was learned), then every part closed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Protocol

from rich.console import Console

from ..adapters import AdapterStore
from ..buffer import RolloutBuffer
from ..checkpoint import RunState, checkpoint_auto, latest_checkpoint, load_checkpoint, load_frozen
from ..config import TrainConfig, dump_config
from ..errors import TrainingError
from ..generator import RunGenerator
from ..learner.protocol import LearnerAPI
from ..metrics import MetricsWriter, read_metrics, summary_table, truncate_metrics, where_the_time_went
from ..placement import Placement, pin_current_thread
from ..sync.transports import Transport
from ..tasks import make_source
from ..timing import TimeBoard
from ..tokenizer import Tokenizer
from ..league import league_line
from ..trackers import Trackers, run_info
from .admission import Admission
from .auto import start_mode, start_window
from .periodic import checkpoint, evaluate_all, save_adapter
from .rows import run_summary
from .state import AdapterRun, Counters, Run


class Parts(Protocol):
    """What a run is built from. `LocalParts` builds the real ones; tests pass fakes."""

    learner_placement: Placement

    def describe(self) -> str: ...
    def tokenizer(self) -> Tokenizer: ...
    def generator(self) -> RunGenerator: ...
    def transport(self, generator: RunGenerator) -> Transport: ...
    def learner(self) -> LearnerAPI:
        """Called on the learner's own thread (pinned to `learner_placement`)."""


class LocalParts:
    """The real parts: the model resolved (the embedded one built on first use), the generator
    the config names, its transport, and a peft learner (data-parallel over `learner.devices`
    when it names several), each on its placement."""

    def __init__(self, config: TrainConfig, console: Console, out_dir: Path) -> None:
        from ..learner import served_base
        from ..models import resolve_model
        from ..placement import PlacementError, place_run

        self.config, self.out_dir = config, out_dir
        try:
            self.generator_placement, self.rank_placements = place_run(config)
        except PlacementError as exc:
            raise TrainingError(str(exc)) from None
        self.learner_placement = self.rank_placements[0]  # rank 0 runs on the learner thread
        self.model_dir = resolve_model(config.model.name, console)
        self.base_dir, self.base_recipe = served_base.generator_base(config, self.model_dir,
                                                                     self.learner_placement.device, console)
        served_base.record(out_dir, config.model.name, self.base_dir, self.base_recipe)
        self.where = config.generator.describe_where(self.generator_placement.describe(), config.ray.address)

    def describe(self) -> str:
        config = self.config
        ranks = self.rank_placements
        learner = (ranks[0].describe() if len(ranks) == 1 else
                   f"{len(ranks)} data-parallel ranks ({'; '.join(r.describe() for r in ranks)})")
        lines = [f"model {config.model.name} ({self.model_dir}); adapters {', '.join(config.adapter_names)}",
                 f"generator on {self.where}, learner on {learner}"]
        quantization = config.model.quantization
        if quantization != "none":
            served = (f"{self.base_recipe.describe()} ({self.base_dir})" if self.base_recipe is not None
                      else 'the original checkpoint (generator.base = "original")')
            lines.append(f"learner base: {quantization} (bitsandbytes); the generator serves {served}")
        return "\n".join(lines)

    def tokenizer(self) -> Tokenizer:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_dir)

    def generator(self) -> RunGenerator:
        from ..envs.games import kept_versions
        from ..generator import make_generator
        from ..learner.served_base import BaseBuilder

        recipe = self.base_recipe
        return make_generator(self.config, self.base_dir, self.generator_placement,
                              None if recipe is None else BaseBuilder(recipe), kept=kept_versions(self.config))

    def transport(self, generator: RunGenerator) -> Transport:
        from ..sync.factory import make_transport

        return make_transport(self.config, generator, self.learner_placement.device, self.out_dir)

    def learner(self) -> LearnerAPI:
        from ..learner import Learner
        from ..learner.parallel import ParallelLearner

        config, specs = self.config, self.config.adapter_specs
        adapters = {s.name: (s.lora, s.lr) for s in specs}
        temperatures = {s.name: s.sampling.temperature for s in specs}
        if len(self.rank_placements) > 1:
            return ParallelLearner(self.model_dir, adapters, config.learner, config.loss, self.rank_placements,
                                   temperatures, config.run.seed, config.model.quantization)
        return Learner(self.model_dir, adapters, config.learner, config.loss, self.learner_placement,
                       temperatures, config.run.seed, config.model.quantization)


async def setup_run(config: TrainConfig, resume: bool, console: Console, parts: Parts | None = None) -> Run:
    out_dir = Path(config.run.output_dir)
    checkpoint_path = latest_checkpoint(out_dir) if resume else None
    if resume and checkpoint_path is None:
        console.print(f"[yellow]--resume: no checkpoint in {out_dir}; starting fresh[/]")
    if checkpoint_path is None and (out_dir / "metrics.jsonl").exists():
        raise TrainingError(f"{out_dir} already holds a run; use --resume to continue it or choose "
                            "another run.output_dir")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(dump_config(config))
    if parts is None:
        parts = await asyncio.to_thread(LocalParts, config, console, out_dir)
    console.print(parts.describe())
    choice, auto, mode_line = start_mode(config, checkpoint_auto(checkpoint_path) if checkpoint_path else None)
    console.print(f"mode: {mode_line}", highlight=False)
    window = start_window(choice)
    board = TimeBoard()  # the run's: each adapter's waits report to it
    adapters = {spec.name: AdapterRun(spec, make_source(spec, config, config.run.seed), Admission(window),
                                      waits=board.waits())
                for spec in config.adapter_specs}
    for adapter in adapters.values():
        console.print(f"{adapter.name}: {adapter.source.describe()}", highlight=False)
    tokenizer = await asyncio.to_thread(parts.tokenizer)
    pool = concurrent.futures.ThreadPoolExecutor(1, "lora-async-learner", pin_current_thread,
                                                 (parts.learner_placement,))
    # One after the other: vLLM switches torch's process-wide default dtype while it builds its
    # model, which would leak into a learner built at the same time.
    generator = await asyncio.to_thread(parts.generator)
    learner: LearnerAPI | None = None
    try:
        transport = await asyncio.to_thread(parts.transport, generator)
        console.print(f"sync: {transport.name}")
        learner = await asyncio.get_running_loop().run_in_executor(pool, parts.learner)
        state = None
        if checkpoint_path is not None:  # the learner's state now; the metrics file before it is opened
            state = await asyncio.get_running_loop().run_in_executor(pool, load_checkpoint, checkpoint_path, learner)
            restore_leagues(adapters, state, console)
            kept = truncate_metrics(out_dir / "metrics.jsonl", state.steps)
            versions = ", ".join(f"{n} v{learner.version(n)}" for n in adapters)
            console.print(f"resumed from {checkpoint_path.name}: step {state.step} ({versions}), "
                          f"{kept} metric lines kept")
    except BaseException:
        generator.close()
        if learner is not None:
            pool.submit(learner.close)
        pool.shutdown(wait=False)
        raise
    trackers = Trackers(config.run.report_to, run_info(out_dir, config.run.tracker_project,
                                                       config.model_dump(mode="json"), list(adapters)),
                        resumed=checkpoint_path is not None, say=console.print)
    if checkpoint_path is not None:  # what a tracker lost to the kill, up to the checkpoint, from the kept lines
        trackers.replay(read_metrics(out_dir / "metrics.jsonl"))
    run = Run(config=config, out_dir=out_dir, console=console, adapters=adapters, tokenizer=tokenizer,
              generator=generator, transport=transport, learner=learner, learner_pool=pool,
              buffer=RolloutBuffer(config.buffer.max_tokens, window, config.buffer.stale_policy),
              store=AdapterStore(out_dir),
              metrics=MetricsWriter(out_dir, list(adapters), config.run, console, trackers),
              window=window, choice=choice, auto=auto, board=board)
    if state is not None:
        restore(run, state)
        if checkpoint_path is not None:  # a game's kept opponents, published again first
            run.restored_frozen, unread = load_frozen(checkpoint_path)
            for line in unread:
                console.print(f"[red]a kept opponent could not be read ({line}); the run goes on without it[/]")
    for adapter in adapters.values():
        run.metrics.set_completed(adapter.name, adapter.step)
    return run


def restore(run: Run, state: RunState) -> None:
    """Continue a run where its checkpoint left off: steps, wall clock, counters, task position."""
    run.global_step, run.wall_offset = state.step, state.wall_s
    for name, adapter in run.adapters.items():
        adapter.step = state.steps.get(name, 0)
        adapter.next_problem = state.next_problem.get(name, 0)
        adapter.counters = Counters.from_dict(state.counters.get(name, {}))


def restore_leagues(adapters: dict[str, AdapterRun], state: RunState, console: Console) -> None:
    """Each game's league as the checkpoint left it: the same pool, the same ratings (said)."""
    for name, adapter in adapters.items():
        saved, league = (state.leagues or {}).get(name), adapter.source.league
        if league is not None and saved is not None:
            try:
                league.restore(saved)
            except ValueError as exc:
                raise TrainingError(str(exc)) from None
            console.print(f"{name}: league as checkpointed: {league_line(league.summary())}", highlight=False)


class StopSwitch:
    """A stop request from another thread, which asks exactly what a signal asks: the first
    stops after the current step with a checkpoint, a second aborts at once. The Python API
    uses it when the run has its own thread (a notebook's event loop is already running): the
    caller's thread gets Ctrl-C and pulls the switch. A request before the run starts waits
    for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._target: tuple[asyncio.AbstractEventLoop, Callable[[], None]] | None = None
        self._pending = 0

    def attach(self, run: Run) -> None:
        """Called on the run's event loop once the run exists."""
        with self._lock:
            self._target, pending, self._pending = (asyncio.get_running_loop(), run.request_stop), self._pending, 0
        for _ in range(pending):
            run.request_stop()

    def request(self) -> None:
        with self._lock:
            if self._target is None:
                self._pending += 1
                return
            loop, request_stop = self._target
        loop.call_soon_threadsafe(request_stop)


def install_stop_signals(run: Run, stop: StopSwitch | None = None) -> None:
    """SIGINT/SIGTERM (or `stop`) stop after the current step with a checkpoint; a second one aborts."""
    if stop is not None:
        stop.attach(run)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, run.request_stop)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            return


async def stop_workers(run: Run, workers: list[asyncio.Task]) -> None:
    """Producers, collectors and the time board's sampler end: generation in flight is abandoned
    (not saved)."""
    run.check_limits()
    await run.notify()
    for task in workers:
        task.cancel()
    await asyncio.gather(*workers, return_exceptions=True)


async def finish_run(run: Run) -> dict[str, Any]:
    try:
        pending = [a.publishing for a in run.adapters.values() if a.publishing is not None]
        await asyncio.gather(*pending, return_exceptions=True)  # failures already failed the run
        for task in list(run.background):
            task.cancel()
        await asyncio.gather(*run.background, return_exceptions=True)
        if run.error is None:
            await checkpoint(run)
            for adapter in run.adapters.values():
                await save_adapter(run, adapter, final=True)
            if run.config.run.eval_at_end:
                await evaluate_all(run, "end")
        elif run.global_step > 0:  # keep what was learned before the failure
            await checkpoint(run)
    except BaseException:
        run.metrics.finish_trackers(None, run.global_step, failed=True)
        raise
    finally:
        run.metrics.close()
        run.transport.close()
        run.generator.close()
        for adapter in run.adapters.values():
            adapter.source.close()
        run.learner_pool.submit(run.learner.close)  # on the learner's thread, after whatever it was doing
        run.learner_pool.shutdown(wait=True)
    summary = run_summary(run)
    (run.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    await asyncio.to_thread(run.metrics.finish_trackers, summary, run.global_step, run.error is not None)
    run.console.print(summary_table(summary))
    split = where_the_time_went(summary)
    if split is not None:
        run.console.print(split, highlight=False)
    for name, adapter in run.adapters.items():
        ends = {row["when"]: row for row in run.evals if row["adapter"] == name}
        if "start" in ends and "end" in ends:
            run.console.print(f"[bold]{name}: held-out greedy accuracy {ends['start']['accuracy']:.2f} -> "
                              f"{ends['end']['accuracy']:.2f}[/] (n={ends['end']['n']}, {adapter.step} steps, "
                              f"{run.wall_s:.0f} s)")
    return summary
