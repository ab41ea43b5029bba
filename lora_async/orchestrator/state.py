"""What a training run holds while it runs: the run, each adapter's share, the counters, and
the one way a run stops (`Run.stop_with` / `Run.fail`).

A run is RUNNING until one of these, whichever comes first:
- DONE: every adapter did `run.max_steps`, or the time budget is spent;
- REQUESTED: SIGINT/SIGTERM (the current step finishes and a checkpoint follows);
- FAILED: something the run cannot continue without (a dead engine, a failing transport,
  rewards that never work); the first error is kept and the run ends with it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import enum
import math
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable, Coroutine, TypeVar, TypeVarTuple

from rich.console import Console

from ..adapter_version import AdapterVersion
from ..buffer import Group, RolloutBuffer, TrainSample
from ..generator.types import GenRequest, GenResult, Generator, GeneratorStats, generate_async
from ..learner.protocol import LearnerAPI
from ..mode import Choice
from ..outcomes import EpisodeStats
from ..rollout import RolloutSource
from ..staleness import WindowInForce
from ..timing import IdleSplit, LearnerClock, TimeBoard, Waits
from ..tokenizer import Tokenizer
from .admission import Admission
from .auto_state import Auto

if TYPE_CHECKING:
    from ..adapters import AdapterStore
    from ..config import AdapterSpec, TrainConfig
    from ..metrics import MetricsWriter
    from ..sync.transports import Transport

T = TypeVar("T")
Args = TypeVarTuple("Args")

MAX_PULL_FACTOR = 4  # a step takes what it has after pulling this many batches' worth of groups


class Phase(enum.Enum):
    RUNNING = "running"
    DONE = "done"
    REQUESTED = "requested"
    FAILED = "failed"


@dataclass
class Counters:
    groups_started: int = 0
    groups_failed: int = 0
    zero_adv_groups: int = 0
    tokens_generated: int = 0
    skipped_nonfinite: int = 0
    canary_warnings: int = 0
    rejected_versions: int = 0  # versions the transport or the engine refused (older ones kept serving)
    aborted_stale: int = 0  # groups stopped mid-generation: they would have been too stale to train
    # environment tasks: every episode that ended (of groups trained or dropped)
    episode_stats: EpisodeStats = field(default_factory=EpisodeStats)

    def as_dict(self) -> dict[str, int]:
        """One flat dict for a checkpoint (the episode totals under their own names, as before)."""
        flat = asdict(self)
        flat.update(flat.pop("episode_stats"))
        return flat

    @classmethod
    def from_dict(cls, saved: dict[str, int]) -> "Counters":
        """From `as_dict` (keys it does not know are left out: a checkpoint of another release)."""
        own = {f.name: int(saved[f.name]) for f in fields(cls) if f.name != "episode_stats" and f.name in saved}
        return cls(**own, episode_stats=EpisodeStats.from_dict(saved))


@dataclass(frozen=True)
class StepMarks:
    """Where the clocks stand when an adapter's step begins (its metrics line reports the
    differences), or when training begins and ends (the summary's time split)."""

    wall: float = field(default_factory=time.perf_counter)
    busy_s: float = 0.0  # the generator's busy time
    tokens: int = 0  # the adapter's tokens generated
    engine_steps: float = 0.0
    engine_running: float = 0.0
    idle: IdleSplit = IdleSplit()  # the board's sampled no-request time, by cause

    @classmethod
    def now(cls, stats: GeneratorStats, tokens_generated: int, board: TimeBoard) -> "StepMarks":
        return cls(time.perf_counter(), stats.busy_s, tokens_generated, stats.steps, stats.running, board.snapshot())


@dataclass
class AdapterRun:
    """One adapter's share of a run: its rollout source, position, admission, counters."""

    spec: "AdapterSpec"
    source: RolloutSource
    admission: Admission  # its groups between admission and the learner, and the published version
    step: int = 0
    next_problem: int = 0
    carry: list[Group] = field(default_factory=list)  # taken, but did not fit the last step
    pulled_rewards: list[float] = field(default_factory=list)  # every group taken for this step
    pulled_parts: dict[str, list[float]] = field(default_factory=dict)  # ... each reward function's values
    pulled_episodes: EpisodeStats = field(default_factory=EpisodeStats)  # ... and their episodes
    informative_rate: float = 1.0  # running share of groups with a reward signal
    counters: Counters = field(default_factory=Counters)
    last_reward: float | None = None
    warned_flat: bool = False
    warned_dropped: bool = False  # a step's loss dropped most of its tokens (shown once)
    reported_fault: bool = False  # the first reward or environment fault was shown
    marks: StepMarks = field(default_factory=StepMarks)
    trained: asyncio.Event = field(default_factory=asyncio.Event)
    rejected_in_a_row: int = 0
    publishing: asyncio.Task | None = None  # the newest version's hand-off (and metrics line)
    held: collections.deque[AdapterVersion] = field(default_factory=collections.deque)  # `buffer.fixed_lag`
    waits: Waits = field(default_factory=Waits)  # its rollouts' waits (`Run.board.waits()` in a run)

    @property
    def name(self) -> str:
        return self.spec.name

    def groups_consumed_per_step(self, groups_per_step: int) -> int:
        """Groups a step takes from the buffer: groups_per_step, plus the flat ones it skips."""
        return math.ceil(groups_per_step / max(self.informative_rate, 1 / MAX_PULL_FACTOR))


@dataclass
class Run:
    """Everything one training run holds. Built by `lifecycle.setup_run`, ended by `finish_run`."""

    config: "TrainConfig"
    out_dir: Path
    console: Console
    adapters: dict[str, AdapterRun]
    tokenizer: Tokenizer
    generator: Generator
    transport: "Transport"
    learner: LearnerAPI
    learner_pool: concurrent.futures.ThreadPoolExecutor
    buffer: RolloutBuffer
    store: "AdapterStore"
    metrics: "MetricsWriter"
    window: WindowInForce  # the one the buffer and every admission hold too (`auto.apply_choice` sets it)
    choice: Choice | None = None  # sync or async, and why (None: an auto run still measuring)
    auto: Auto | None = None  # an auto run on shared compute: what it measured, where it is in deciding
    global_step: int = 0
    wall_offset: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    phase: Phase = Phase.RUNNING
    error: BaseException | None = None
    producers_wake: asyncio.Condition = field(default_factory=asyncio.Condition)  # held-back producers wait (`notify`)
    evals: list[dict] = field(default_factory=list)
    background: set[asyncio.Task] = field(default_factory=set)
    charting: bool = False
    board: TimeBoard = field(default_factory=TimeBoard)  # what waits, requests in flight, sampled idle time
    learner_clock: LearnerClock = field(default_factory=LearnerClock)
    began: StepMarks | None = None  # the clocks when training began (producers started) ...
    ended: StepMarks | None = None  # ... and when it ended (producers stopped): the summary's split
    # a game's frozen opponents kept registered, with their tensors for checkpoints (`frozen.py`)
    frozen: dict[tuple[str, int], AdapterVersion] = field(default_factory=dict)
    restored_frozen: list[AdapterVersion] = field(default_factory=list)  # a resumed run's, to publish first

    # ---- stopping
    @property
    def running(self) -> bool:
        return self.phase is Phase.RUNNING

    def fail(self, error: BaseException) -> None:
        """The one way a run fails: the first error is kept, and everything stops."""
        if self.error is None:
            self.error = error
        self.phase = Phase.FAILED

    def request_stop(self) -> None:
        """SIGINT/SIGTERM: finish this step, checkpoint, stop. A second signal aborts at once."""
        if self.phase is Phase.REQUESTED:
            raise KeyboardInterrupt
        if self.running:
            self.phase = Phase.REQUESTED
            self.console.print("[yellow]stopping after this step (checkpoint follows); "
                               "signal again to abort at once[/]")

    def check_limits(self) -> None:
        """RUNNING becomes DONE once every adapter did its steps or the time budget is spent."""
        budget = self.config.run.time_budget_s
        steps_done = all(a.step >= self.config.run.max_steps for a in self.adapters.values())
        if self.running and (steps_done or (budget is not None and self.wall_s >= budget)):
            self.phase = Phase.DONE

    def finished(self, adapter: AdapterRun | None = None) -> bool:
        """Stopping, or this adapter has done its max_steps."""
        self.check_limits()
        return not self.running or (adapter is not None and adapter.step >= self.config.run.max_steps)

    @property
    def partial_rollouts(self) -> bool:
        """Generations a learner step stops are continued on the newest version (async only: in
        sync nothing generates during a step)."""
        return self.config.buffer.partial_rollouts and not self.window.synchronous

    # ---- helpers every part uses
    def start_clock(self) -> None:
        """Training begins: `wall_s` (the time budget's clock) counts from here, on top of what
        a resumed run had trained."""
        self.started = time.perf_counter()

    @property
    def wall_s(self) -> float:
        return self.wall_offset + time.perf_counter() - self.started

    async def in_learner(self, fn: Callable[[*Args], T], *args: *Args) -> T:
        """Run `fn` on the learner's thread (the learner is not thread-safe; one thread owns it)."""
        return await asyncio.get_running_loop().run_in_executor(self.learner_pool, fn, *args)

    def generate(self, request: GenRequest) -> Awaitable[GenResult]:
        """Every request of the run (rollouts, evals, the canary) goes through here, so the board
        counts the requests in flight: while there are none, the generator is idle."""
        future = asyncio.ensure_future(generate_async(self.generator)(request))
        self.board.request_started()
        future.add_done_callback(lambda _: self.board.request_finished())
        return future

    def marks(self, adapter: AdapterRun | None = None) -> StepMarks:
        """The clocks now (an adapter's step marks, or the run's with no adapter)."""
        tokens = adapter.counters.tokens_generated if adapter is not None else 0
        return StepMarks.now(self.generator.stats, tokens, self.board)

    async def notify(self) -> None:
        """Wake the producers: admission may have changed."""
        async with self.producers_wake:
            self.producers_wake.notify_all()

    def in_background(self, coro: Coroutine[object, object, object]) -> None:
        task = asyncio.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)


def samples_of(groups: list[Group]) -> list[TrainSample]:
    return [s for g in groups for s in g.samples]
