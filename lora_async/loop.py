"""The orchestrator: producers keep vLLM busy, the learner consumes, new versions flow back.

    producers (asyncio tasks) --GenRequest--> generator thread (vLLM, versions v_k, v_k-1 ...)
        | rewards, advantages                         ^
        v                                             | publish (adapter tensors, in memory)
    RolloutBuffer (token-bounded) --groups--> learner thread (peft) --step--> new version

Threads: the asyncio loop (this module), the engine thread (generator), the learner thread.
Every adapter of a fleet has its own producers (as many as its weight's share of
`groups_in_flight`), its own batch collector, optimizer, version counter and step count; the
learner holds the base once and steps whichever adapter's batch is ready first.
Synchronous training is this same loop with `buffer.max_staleness = 0`: the admission rule
below then lets producers start only while the learner waits for data.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rich.console import Console

from .adapters import AdapterStore
from .buffer import Group, RolloutBuffer, TrainSample, group_advantages
from .checkpoint import RunState, latest_checkpoint, load_checkpoint, save_checkpoint
from .config import AdapterSpec, TrainConfig, dump_config
from .evaluate import EvalResult, asyncio_generate, evaluate
from .generator.types import AdapterVersion, GenRequest
from .generator.validate import AdapterError
from .generator.vllm_engine import ABORTED_STALE
from .learner import Learner, StepStats
from .metrics import MetricsWriter, summary_table, truncate_metrics
from .placement import Placement, pin_current_thread, resolve
from .sync.pack import PackError
from .tasks import Task, make_task, render_prompt

TAKE_POLL_S = 1.0  # how often a waiting collector re-checks the time budget and producer health
ADMISSION_POLL_S = 0.25  # producers re-check admission at least this often
MAX_PULL_FACTOR = 4  # a step takes what it has after pulling this many batches' worth of groups
INFORMATIVE_EMA = 0.1  # smoothing of the share of groups with a reward signal (admission uses it)
ROLLOUT_TAG = "rollout"  # GenRequest.tag of training rollouts (the only requests cut short as stale)
MAX_REJECTED_IN_A_ROW = 3  # versions of one adapter refused in a row before the run stops
REJECTED_VERSION = (AdapterError, PackError)  # a refused version, not a broken engine or transport
CANARY_WARN_NATS = 0.5  # mean |generator - learner| logprob on the probe that means "not applied"


class TrainingError(RuntimeError):
    """A run that cannot continue (engine died, reward setup failed); the message says why."""


def may_start(learner_busy: bool, queued_groups: int, groups_per_step: int, max_staleness: int) -> bool:
    """Admission of a new group on the newest version v.

    A group started now will be trained at about version v + busy + queued // groups_per_step;
    start it only if that lag stays within max_staleness. With max_staleness = 0 producers
    run only while the learner waits for data: synchronous training from the same loop.
    """
    return int(learner_busy) + queued_groups // groups_per_step <= max_staleness


def producer_quota(weights: dict[str, float], groups_in_flight: int) -> dict[str, int]:
    """Producers per adapter: groups in flight shared by weight, at least one each."""
    total = sum(weights.values())
    return {name: max(1, round(groups_in_flight * w / total)) for name, w in weights.items()}


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

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class AdapterRun:
    """One adapter's share of a run: task, position, versions, counters."""

    spec: AdapterSpec
    task: Task
    step: int = 0
    next_problem: int = 0
    published: int = -1
    busy: bool = False  # the learner is training or publishing this adapter
    in_flight: int = 0
    carry: list[Group] = field(default_factory=list)
    pulled_rewards: list[float] = field(default_factory=list)  # every group taken for this step
    informative_rate: float = 1.0  # running share of groups with a reward signal
    counters: Counters = field(default_factory=Counters)
    last_reward: float | None = None
    warned_flat: bool = False
    marks: dict[str, float] = field(default_factory=dict)
    trained: asyncio.Event = field(default_factory=asyncio.Event)
    rejected_in_a_row: int = 0
    publishing: asyncio.Task | None = None  # the newest version's hand-off (and metrics line)

    @property
    def name(self) -> str:
        return self.spec.name

    def groups_consumed_per_step(self, groups_per_step: int) -> int:
        """Groups a step takes from the buffer: groups_per_step, plus the flat ones it skips."""
        return math.ceil(groups_per_step / max(self.informative_rate, 1 / MAX_PULL_FACTOR))


@dataclass
class Run:
    """Everything one training run holds. Built by `setup_run`, torn down by `finish_run`."""

    config: TrainConfig
    out_dir: Path
    console: Console
    adapters: dict[str, AdapterRun]
    tokenizer: Any
    generator: Any
    transport: Any  # sync.transports.Transport: how new versions reach the generator
    learner: Learner
    learner_pool: concurrent.futures.ThreadPoolExecutor
    buffer: RolloutBuffer
    store: AdapterStore
    placements: tuple[Placement, Placement]
    metrics: MetricsWriter | None = None
    global_step: int = 0
    wall_offset: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    fatal: BaseException | None = None
    stopping: bool = False
    stop_requested: bool = False
    admission: asyncio.Condition = field(default_factory=asyncio.Condition)
    evals: list[dict] = field(default_factory=list)
    background: set = field(default_factory=set)
    charting: bool = False

    @property
    def wall_s(self) -> float:
        return self.wall_offset + time.perf_counter() - self.started

    async def in_learner(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.learner_pool, fn, *args)

    def generate(self, request: GenRequest) -> Any:
        return asyncio_generate(self.generator)(request)

    def out_of_time(self) -> bool:
        budget = self.config.run.time_budget_s
        return self.stop_requested or (budget is not None and self.wall_s >= budget)

    def finished(self, adapter: AdapterRun | None = None) -> bool:
        """Out of time, or this adapter (or every adapter) has done its max_steps."""
        steps = self.config.run.max_steps
        if adapter is not None:
            return self.out_of_time() or adapter.step >= steps
        return self.out_of_time() or all(a.step >= steps for a in self.adapters.values())

    def request_stop(self) -> None:
        if self.stop_requested:
            raise KeyboardInterrupt
        self.stop_requested = True
        self.console.print("[yellow]stopping after this step (checkpoint follows); "
                           "signal again to abort at once[/]")

    async def notify(self) -> None:
        async with self.admission:
            self.admission.notify_all()


# ---------------------------------------------------------------- the main loop


async def train(config: TrainConfig, resume: bool = False, console: Console | None = None,
                on_step: Callable[[Run], Any] | None = None) -> dict[str, Any]:
    """Run training to max_steps / time budget / a stop signal; return the summary."""
    console = console or Console(stderr=True)
    run = await setup_run(config, resume, console)
    _install_stop_signals(run)
    tasks: list[asyncio.Task] = []
    try:
        for adapter in run.adapters.values():
            await publish_current(run, adapter)
        if config.run.eval_at_start:
            await asyncio.gather(*(eval_event(run, a, "start") for a in run.adapters.values()))
        ready: asyncio.Queue = asyncio.Queue()
        quota = producer_quota({n: a.spec.weight for n, a in run.adapters.items()},
                               config.generator.groups_in_flight)
        tasks = [asyncio.create_task(produce(run, a)) for a in run.adapters.values() for _ in range(quota[a.name])]
        tasks += [asyncio.create_task(collect_loop(run, a, ready)) for a in run.adapters.values()]
        while not run.finished() and run.fatal is None:
            try:
                adapter, groups = await asyncio.wait_for(ready.get(), TAKE_POLL_S)
            except asyncio.TimeoutError:
                continue
            await train_step(run, adapter, groups)
            adapter.trained.set()
            if on_step is not None:
                on_step(run)
    finally:
        run.stopping = True
        await run.notify()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        summary = await finish_run(run)
    if run.fatal is not None:
        raise TrainingError(str(run.fatal)) from run.fatal
    return summary


async def train_step(run: Run, adapter: AdapterRun, groups: list[Group]) -> None:
    """One learner step of one adapter. The new version is handed over in the background, so
    the learner never waits for the engine to reach a step boundary; the step's metrics line is
    written once the version is registered (with its sync time)."""
    adapter.busy = True
    # Groups still generating on versions this step makes too old could only be dropped as
    # stale: stop them now, so the engine (and, on shared cores, the learner) gets the time.
    if hasattr(run.generator, "abort_older"):
        run.generator.abort_older(adapter.name, run.learner.version(adapter.name) + 1
                                  - run.config.buffer.max_staleness, ROLLOUT_TAG)
    stats: StepStats = await run.in_learner(run.learner.train_step, adapter.name, _samples(groups))
    version = await run.in_learner(run.learner.adapter_version, adapter.name) if stats.updated else None
    adapter.busy = False
    await run.notify()
    adapter.step += 1
    run.global_step += 1
    adapter.counters.skipped_nonfinite += int(stats.skipped_nonfinite)
    row = step_row(run, adapter, groups, stats)
    adapter.marks = _marks(run, adapter)
    previous = adapter.publishing
    adapter.publishing = asyncio.create_task(publish_and_record(run, adapter, version, row, previous))
    rc = run.config.run
    if rc.checkpoint_every and adapter.step % rc.checkpoint_every == 0:
        await checkpoint(run)
    if rc.eval_every and adapter.step % rc.eval_every == 0:
        _background(run, eval_event(run, adapter, "periodic", after=adapter.publishing))
    if rc.chart_every and run.global_step % rc.chart_every == 0 and not run.charting:
        _background(run, redraw_chart(run))


async def redraw_chart(run: Run) -> None:
    """The live view: OUT/chart.png, redrawn every few steps (a failure only warns)."""
    from .plot import plot_runs

    run.charting = True
    try:
        await asyncio.to_thread(plot_runs, [run.out_dir], run.out_dir / "chart.png", str(run.out_dir))
    except Exception as exc:
        run.console.print(f"[yellow]chart not redrawn: {exc}[/]")
    finally:
        run.charting = False


async def publish_and_record(run: Run, adapter: AdapterRun, version: AdapterVersion | None,
                             row: dict[str, Any], previous: asyncio.Task | None) -> None:
    """Register a new version (in order), then write its step's metrics line and canary."""
    if previous is not None:
        await previous
    if version is not None:
        try:
            stats = await asyncio.to_thread(run.transport.publish, version)
        except REJECTED_VERSION as exc:
            # This version is refused (corrupted transfer, bad values); the live ones keep serving
            # and the next step publishes a newer one. Repeated refusals mean something systematic.
            adapter.counters.rejected_versions += 1
            adapter.rejected_in_a_row += 1
            row.update(sync_error=str(exc)[:300])
            run.console.print(f"[red]{adapter.name}@v{version.version} rejected, "
                              f"v{adapter.published} keeps serving: {exc}[/]")
            if adapter.rejected_in_a_row >= MAX_REJECTED_IN_A_ROW:
                run.fatal = run.fatal or TrainingError(
                    f"{adapter.name}: {adapter.rejected_in_a_row} versions in a row rejected; last: {exc}")
        except Exception as exc:
            run.fatal = run.fatal or TrainingError(f"publishing {adapter.name}@v{version.version} failed: {exc}")
            raise
        else:
            adapter.published = version.version
            adapter.rejected_in_a_row = 0
            await run.notify()
            row.update(sync_ms=stats.ms, sync_wait_ms=stats.wait_ms, sync_bytes=stats.bytes,
                       sync_transport=stats.transport)
    assert run.metrics is not None
    run.metrics.step(row)
    canary_every = run.config.run.canary_every
    if version is not None and canary_every and version.version % canary_every == 0:
        await canary(run, adapter, version)


async def collect_loop(run: Run, adapter: AdapterRun, ready: asyncio.Queue) -> None:
    """Hand the learner one batch of this adapter at a time, until its steps are done."""
    adapter.marks = _marks(run, adapter)
    while not run.finished(adapter) and run.fatal is None:
        groups = await collect_batch(run, adapter)
        if groups is None:
            return
        adapter.trained.clear()
        await ready.put((adapter, groups))
        await adapter.trained.wait()


async def collect_batch(run: Run, adapter: AdapterRun) -> list[Group] | None:
    """`groups_per_step` informative groups (rewards not all equal), fitting the micro-batch cap."""
    cfg = run.config.learner
    groups, adapter.carry = adapter.carry, []
    adapter.pulled_rewards = [s.reward for g in groups for s in g.samples]
    pulled = 0
    keep_all = run.config.loss.kl_coef > 0
    while len(groups) < cfg.groups_per_step:
        if run.fatal is not None or run.finished(adapter):
            return None
        dropped = run.buffer.counters.dropped_stale
        try:
            # the lag is against the learner's version (a publish may still be on its way)
            version = run.learner.version(adapter.name)
            group = await asyncio.wait_for(run.buffer.take(adapter.name, version), TAKE_POLL_S)
        except asyncio.TimeoutError:
            if run.buffer.counters.dropped_stale != dropped:
                await run.notify()  # stale groups left the queue: producers may start again
            continue
        await run.notify()
        pulled += 1
        adapter.pulled_rewards.extend(group.rewards)
        adapter.informative_rate += INFORMATIVE_EMA * (float(group.informative or keep_all)
                                                       - adapter.informative_rate)
        if not group.informative and not keep_all:
            adapter.counters.zero_adv_groups += 1
        elif groups and run.learner.micro_batches_needed(_samples(groups + [group])) > cfg.micro_batches_per_step:
            adapter.carry.append(group)
            break
        else:
            groups.append(group)
        if pulled >= MAX_PULL_FACTOR * cfg.groups_per_step:
            # Rewards saturated (or flat): step with what there is, even nothing, so the run
            # keeps its step budget and the metrics show it, instead of waiting forever.
            if not groups and not adapter.warned_flat:
                adapter.warned_flat = True
                run.console.print(f"[yellow]{adapter.name}: no reward signal in the last {pulled} groups "
                                  f"(every sample of a group scored the same, e.g. {group.rewards[0]}): "
                                  "steps make no update[/]")
            break
    return groups


async def produce(run: Run, adapter: AdapterRun) -> None:
    """One producer of one adapter: start a group when admitted, score it, buffer it. Forever.

    An unexpected error ends the run with that error (a silent dead producer would hang it).
    """
    try:
        await _produce(run, adapter)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        run.console.print_exception(show_locals=False)
        run.fatal = TrainingError(f"a rollout producer of {adapter.name} failed: {type(exc).__name__}: {exc}")


async def _produce(run: Run, adapter: AdapterRun) -> None:
    cfg = run.config
    while not run.stopping:
        async with run.admission:
            # Re-checked on every notify, and every ADMISSION_POLL_S as a safety net: the buffer
            # drops stale groups inside `take`, which changes the queue without a notify.
            while not (run.stopping or may_start(
                    adapter.busy, adapter.in_flight + run.buffer.groups(adapter.name) + len(adapter.carry),
                    adapter.groups_consumed_per_step(cfg.learner.groups_per_step), cfg.buffer.max_staleness)):
                try:
                    await asyncio.wait_for(run.admission.wait(), ADMISSION_POLL_S)
                except asyncio.TimeoutError:
                    pass
        if run.stopping:
            return
        index = adapter.next_problem
        adapter.next_problem += 1
        adapter.in_flight += 1
        adapter.counters.groups_started += 1
        try:
            group = await make_group(run, adapter, index)
            if group is not None:
                await run.buffer.put(group)
        finally:
            adapter.in_flight -= 1
            await run.notify()


async def make_group(run: Run, adapter: AdapterRun, index: int) -> Group | None:
    spec = adapter.spec
    problem = adapter.task.train_problem(index)
    prompt_ids = render_prompt(run.tokenizer, problem.prompt, adapter.task.system_prompt)
    request = GenRequest(prompt_ids, adapter.name, n=spec.samples_per_prompt, max_tokens=spec.max_new_tokens,
                         temperature=spec.temperature, top_p=spec.top_p, tag=ROLLOUT_TAG)
    result = await run.generate(request)
    if not result.ok and (result.error or "").startswith(ABORTED_STALE):
        adapter.counters.aborted_stale += 1
        return None
    if not result.ok:
        adapter.counters.groups_failed += 1
        if result.error and "engine failed" in result.error:
            run.fatal = TrainingError(f"the vLLM engine died: {result.error}")
        return None
    texts = run.tokenizer.batch_decode([s.token_ids for s in result.samples], skip_special_tokens=True)
    rewards = await asyncio.to_thread(adapter.task.rewards, problem, texts)
    advantages = group_advantages(rewards)
    adapter.counters.tokens_generated += sum(len(s.token_ids) for s in result.samples)
    samples = [
        TrainSample(adapter.name, result.version, prompt_ids, s.token_ids, s.logprobs, r, a, s.finish_reason)
        for s, r, a in zip(result.samples, rewards, advantages)
    ]
    return Group(adapter.name, result.version, index, samples)


async def publish_current(run: Run, adapter: AdapterRun) -> None:
    """Hand the learner's current adapter to the generator and wait until it is servable."""
    version = await run.in_learner(run.learner.adapter_version, adapter.name)
    await asyncio.to_thread(run.transport.publish, version)
    adapter.published = version.version
    await run.notify()


def _background(run: Run, coro: Any) -> None:
    task = asyncio.create_task(coro)
    run.background.add(task)
    task.add_done_callback(run.background.discard)


async def checkpoint(run: Run) -> None:
    # Every step up to here has its metrics line on disk before the checkpoint names it.
    await asyncio.gather(*(a.publishing for a in run.adapters.values() if a.publishing is not None),
                         return_exceptions=True)
    # Groups in flight or buffered are not saved: their prompts are skipped on resume, and the
    # task stream continues from the next undrawn problem.
    state = RunState(
        step=run.global_step,
        steps={n: a.step for n, a in run.adapters.items()},
        next_problem={n: a.next_problem for n, a in run.adapters.items()},
        wall_s=run.wall_s,
        counters={n: a.counters.as_dict() for n, a in run.adapters.items()},
    )
    await run.in_learner(save_checkpoint, run.out_dir, state, run.learner)
    for adapter in run.adapters.values():
        await save_adapter(run, adapter, final=False)


async def save_adapter(run: Run, adapter: AdapterRun, final: bool) -> None:
    learner = run.learner
    version = learner.version(adapter.name)
    info = {"step": adapter.step, "wall_s": round(run.wall_s, 2), "reward_mean": adapter.last_reward}
    tensors = await run.in_learner(learner.adapter_tensors, adapter.name)
    await asyncio.to_thread(run.store.save, adapter.name, version, tensors, learner.peft_config(adapter.name),
                            info, final)


async def eval_event(run: Run, adapter: AdapterRun, when: str,
                     after: asyncio.Task | None = None) -> EvalResult:
    if after is not None:
        await after  # evaluate the version this step produced, once it is servable
    problems = adapter.task.heldout()
    max_tokens = run.config.run.eval_max_tokens or adapter.spec.max_new_tokens
    result = await evaluate(run.generate, run.tokenizer, adapter.task, problems, adapter.name, max_tokens)
    row = {"kind": "eval", "when": when, "adapter": adapter.name, "step": adapter.step,
           "version": result.version, "wall_s": round(run.wall_s, 3), "accuracy": result.accuracy,
           "mean_reward": result.mean_reward, "n": result.n}
    run.evals.append(row)
    if run.metrics is not None:
        run.metrics.event(row)
    return result


async def canary(run: Run, adapter: AdapterRun, version: AdapterVersion) -> None:
    """Invariant 7: what vLLM serves under version k is what the learner trained as version k.

    vLLM samples a probe on version k; the learner scores it with a snapshot of version k
    (the tensors that were published), so the check is exact even while the learner moves on.
    """
    probe = adapter.task.heldout()[:1] or [adapter.task.train_problem(0)]
    prompt_ids = render_prompt(run.tokenizer, probe[0].prompt, adapter.task.system_prompt)
    result = await run.generate(GenRequest(prompt_ids, adapter.name, n=1, max_tokens=16,
                                           temperature=adapter.spec.temperature))
    if not result.ok or not result.samples or not result.samples[0].token_ids:
        return
    if result.version != version.version:
        return  # a newer version was published meanwhile; the next canary will compare
    sample = result.samples[0]
    probe_sample = TrainSample(adapter.name, result.version, prompt_ids, sample.token_ids, sample.logprobs, 0.0)
    learner_lp = (await run.in_learner(run.learner.snapshot_logprobs, version, [probe_sample]))[0]
    diff = statistics.fmean(abs(a - b) for a, b in zip(learner_lp, sample.logprobs))
    assert run.metrics is not None
    run.metrics.event({"kind": "canary", "adapter": adapter.name, "step": adapter.step,
                       "version": result.version, "canary_mismatch": diff, "tokens": len(sample.token_ids)})
    if diff > CANARY_WARN_NATS:
        adapter.counters.canary_warnings += 1
        run.console.print(f"[red]canary: generator and learner disagree by {diff:.2f} nats/token on "
                          f"{adapter.name}@v{result.version}: the served adapter may not be what was trained[/]")


# ---------------------------------------------------------------- setup and teardown


def _install_stop_signals(run: Run) -> None:
    """SIGINT/SIGTERM stop after the current step with a checkpoint; a second one aborts."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, run.request_stop)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            return


async def setup_run(config: TrainConfig, resume: bool, console: Console) -> Run:
    from transformers import AutoTokenizer

    from .models import resolve_model
    from .sync.transports import make_transport

    out_dir = Path(config.run.output_dir)
    checkpoint_path = latest_checkpoint(out_dir) if resume else None
    if resume and checkpoint_path is None:
        console.print(f"[yellow]--resume: no checkpoint in {out_dir}; starting fresh[/]")
    if checkpoint_path is None and (out_dir / "metrics.jsonl").exists():
        raise TrainingError(f"{out_dir} already holds a run; use --resume to continue it or choose "
                            "another run.output_dir")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(dump_config(config))
    model_dir = resolve_model(config.model.name, console)
    # `auto` splits the cores only when a local engine generates while the learner trains
    local_engine = config.generator.backend == "vllm"
    gen_place, learn_place = resolve(config.generator.device, config.generator.cpus, config.learner.device,
                                     config.learner.cpus, concurrent=config.buffer.max_staleness > 0 and local_engine)
    specs = config.adapter_specs
    where = (f"vllm serve at {', '.join(config.generator.urls)}" if config.generator.backend == "server"
             else f"{gen_place.describe()}" + (" (engine in its own process)"
                                               if config.generator.engine_process == "separate" else ""))
    console.print(f"model {config.model.name} ({model_dir}); adapters {', '.join(s.name for s in specs)}\n"
                  f"generator on {where}, learner on {learn_place.describe()}, "
                  f"max_staleness {config.buffer.max_staleness}")
    adapters = {spec.name: AdapterRun(spec, make_task(spec.task, config.run.seed)) for spec in specs}
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pool = concurrent.futures.ThreadPoolExecutor(1, "lora-async-learner", pin_current_thread, (learn_place,))
    loop = asyncio.get_running_loop()

    def build_learner() -> Learner:
        return Learner(model_dir, {s.name: (s.lora, s.lr) for s in specs}, config.learner, config.loss,
                       learn_place, {s.name: s.temperature for s in specs}, config.run.seed)

    # One after the other: vLLM switches torch's process-wide default dtype while it builds
    # its model, which would leak into a learner built at the same time.
    generator = await asyncio.to_thread(make_generator, config, model_dir, tuple(adapters), gen_place, out_dir)
    try:
        transport = await asyncio.to_thread(make_transport, config.sync, config.generator, generator,
                                            learn_place.device)
    except BaseException:
        generator.close()
        raise
    console.print(f"sync: {transport.name}")
    learner = await loop.run_in_executor(pool, build_learner)
    run = Run(config=config, out_dir=out_dir, console=console, adapters=adapters, tokenizer=tokenizer,
              generator=generator, transport=transport, learner=learner, learner_pool=pool,
              buffer=RolloutBuffer(config.buffer.max_tokens, config.buffer.max_staleness,
                                   config.buffer.stale_policy),
              store=AdapterStore(out_dir), placements=(gen_place, learn_place))
    if checkpoint_path is not None:
        state = await run.in_learner(load_checkpoint, checkpoint_path, learner)
        run.global_step = state.step
        run.wall_offset = state.wall_s
        for name, adapter in adapters.items():
            adapter.step = state.steps.get(name, 0)
            adapter.next_problem = state.next_problem.get(name, 0)
            saved = state.counters.get(name, {})
            adapter.counters = Counters(**{k: v for k, v in saved.items() if k in Counters.__dataclass_fields__})
        kept = truncate_metrics(out_dir / "metrics.jsonl", state.steps)
        versions = ", ".join(f"{n} v{learner.version(n)}" for n in adapters)
        console.print(f"resumed from {checkpoint_path.name}: step {state.step} ({versions}), "
                      f"{kept} metric lines kept")
    run.metrics = MetricsWriter(out_dir, list(adapters), config.run.max_steps, config.run.progress, console)
    for adapter in adapters.values():
        run.metrics.set_completed(adapter.name, adapter.step)
    return run


def make_generator(config: TrainConfig, model_dir: Path, adapters: tuple[str, ...], placement: Placement,
                   out_dir: Path) -> Any:
    """The generator `generator.backend` names: an engine of our own, or remote servers."""
    gen = config.generator
    if gen.backend == "server":
        from .generator.server import ServerGenerator
        from .sync.http import ServerSync

        sync = ServerSync(gen.urls, config.sync.dir or out_dir / "sync", gen.api_key, config.sync.timeout_s,
                          config.sync.retry_budget_s)
        return ServerGenerator(sync, model_dir, config.buffer.max_staleness, config.max_lora_rank,
                               gen.request_timeout_s)
    from .generator.vllm_engine import EngineSpec, VllmGenerator

    spec = EngineSpec(
        model_dir=model_dir, adapters=adapters, max_staleness=config.buffer.max_staleness,
        max_lora_rank=config.max_lora_rank, dtype=config.model.dtype,
        memory_fraction=gen.memory_fraction, kv_cache_gb=gen.kv_cache_gb,
        max_model_len=gen.max_model_len, seed=config.run.seed,
        fast_cpu_lora=gen.fast_cpu_lora, engine_log=config.run.engine_log,
        separate_process=gen.engine_process == "separate",
    )
    return VllmGenerator(spec, placement)


async def finish_run(run: Run) -> dict[str, Any]:
    try:
        pending = [a.publishing for a in run.adapters.values() if a.publishing is not None]
        await asyncio.gather(*pending, return_exceptions=True)  # failures already set run.fatal
        for task in list(run.background):
            task.cancel()
        if run.fatal is None:
            await checkpoint(run)
            for adapter in run.adapters.values():
                await save_adapter(run, adapter, final=True)
            if run.config.run.eval_at_end:
                await asyncio.gather(*(eval_event(run, a, "end") for a in run.adapters.values()))
        elif run.global_step > 0:  # keep what was learned before the failure
            await checkpoint(run)
    finally:
        if run.metrics is not None:
            run.metrics.close()
        if run.transport is not None:
            run.transport.close()
        run.generator.close()
        for adapter in run.adapters.values():
            adapter.task.close()
        run.learner_pool.shutdown(wait=True)
    summary: dict[str, Any] = {
        "steps": run.global_step,
        "wall_s": round(run.wall_s, 1),
        "samples_in": run.buffer.counters.samples_in,
        "dropped_stale": run.buffer.counters.dropped_stale,
        "output_dir": str(run.out_dir),
    }
    for name, adapter in run.adapters.items():
        prefix = "" if len(run.adapters) == 1 else f"{name}."
        summary[f"{prefix}version"] = run.learner.version(name)
        summary[f"{prefix}zero_adv_groups"] = adapter.counters.zero_adv_groups
        summary[f"{prefix}tokens_generated"] = adapter.counters.tokens_generated
        summary[f"{prefix}skipped_nonfinite"] = adapter.counters.skipped_nonfinite
        summary[f"{prefix}rejected_versions"] = adapter.counters.rejected_versions
        summary[f"{prefix}aborted_stale_groups"] = adapter.counters.aborted_stale
        summary[f"{prefix}reward_errors"] = adapter.task.stats.errors
        for row in (r for r in run.evals if r["adapter"] == name):
            summary[f"{prefix}accuracy_{row['when']}"] = row["accuracy"]
    if run.fatal is not None:
        summary["error"] = str(run.fatal)
    (run.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    run.console.print(summary_table(summary))
    for name in run.adapters:
        ends = {row["when"]: row for row in run.evals if row["adapter"] == name}
        if "start" in ends and "end" in ends:
            run.console.print(f"[bold]{name}: held-out greedy accuracy {ends['start']['accuracy']:.2f} -> "
                              f"{ends['end']['accuracy']:.2f}[/] (n={ends['end']['n']}, "
                              f"{run.adapters[name].step} steps, {run.wall_s:.0f} s)")
    return summary


# ---------------------------------------------------------------- metrics rows


def _samples(groups: list[Group]) -> list[TrainSample]:
    return [s for g in groups for s in g.samples]


def _marks(run: Run, adapter: AdapterRun) -> dict[str, float]:
    return {"wall": time.perf_counter(), "busy": run.generator.stats["busy_s"],
            "tokens": adapter.counters.tokens_generated}


def step_row(run: Run, adapter: AdapterRun, groups: list[Group], stats: StepStats) -> dict[str, Any]:
    """The step's metrics line; the sync figures are filled in once the version is registered."""
    samples = _samples(groups)
    # The policy's reward: every group taken for this step, including those with no signal
    # (all samples equal) that were not trained on.
    rewards = adapter.pulled_rewards or [s.reward for s in samples]
    batch_rewards = [s.reward for s in samples]
    lags = [s.policy_lag for s in samples]
    marks = adapter.marks
    elapsed = max(time.perf_counter() - marks["wall"], 1e-9)
    gen_busy = run.generator.stats["busy_s"] - marks["busy"]
    ls = stats.loss_stats
    adapter.last_reward = statistics.fmean(rewards) if rewards else 0.0
    return {
        "step": adapter.step,
        "global_step": run.global_step,
        "adapter": adapter.name,
        "version": stats.version,
        "wall_s": round(run.wall_s, 3),
        "reward_mean": adapter.last_reward,
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "batch_reward_mean": statistics.fmean(batch_rewards) if batch_rewards else 0.0,
        "samples": len(samples),
        "groups": len(groups),
        "tokens_generated": adapter.counters.tokens_generated - int(marks["tokens"]),
        "tokens_generated_total": sum(a.counters.tokens_generated for a in run.adapters.values()),
        "tokens_trained": stats.tokens_trained,
        "padded_tokens": stats.padded_tokens,
        "micro_batches": stats.micro_batches,
        "policy_lag_mean": statistics.fmean(lags) if lags else 0.0,
        "policy_lag_max": max(lags) if lags else 0,
        "dropped_stale": run.buffer.counters.per_adapter_dropped.get(adapter.name, 0),
        "admitted_stale": run.buffer.counters.admitted_stale,
        "zero_adv_groups": adapter.counters.zero_adv_groups,
        "ratio_mean": ls.ratio_mean,
        "ratio_max": ls.ratio_max if ls.tokens else 1.0,
        "ratio_min": ls.ratio_min if ls.tokens else 1.0,
        "clip_frac": ls.clip_frac,
        "kl": ls.kl,
        "loss": stats.loss,
        "grad_norm": stats.grad_norm,
        "updated": stats.updated,
        "sync_ms": 0.0,
        "sync_wait_ms": 0.0,
        "learner_s": stats.seconds,
        "gen_idle_frac": max(0.0, 1.0 - gen_busy / elapsed),
        "learner_idle_frac": max(0.0, 1.0 - stats.seconds / elapsed),
        "logprob_mismatch": ls.logprob_mismatch,
        "logprob_mismatch_onpolicy": ls.onpolicy_mismatch,
        "skipped_nonfinite": adapter.counters.skipped_nonfinite,
        "rejected_versions": adapter.counters.rejected_versions,
        "aborted_stale_groups": adapter.counters.aborted_stale,
        "reward_errors": adapter.task.stats.errors,
    }
