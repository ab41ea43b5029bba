"""The orchestrator: producers keep vLLM busy, the learner consumes, new versions flow back.

    producers (asyncio tasks) --GenRequest--> generator thread (vLLM, versions v_k, v_k-1 ...)
        | rewards, advantages                         ^
        v                                             | publish (adapter tensors, in memory)
    RolloutBuffer (token-bounded) --groups--> learner thread (peft) --step--> new version

Threads: the asyncio loop (this module), the engine thread (generator), the learner thread.
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
from .config import TrainConfig, dump_config
from .evaluate import EvalResult, asyncio_generate, evaluate
from .generator.types import GenRequest
from .learner import Learner, StepStats
from .metrics import MetricsWriter, summary_table, truncate_metrics
from .placement import Placement, pin_current_thread, resolve
from .tasks import Task, make_task, render_prompt

TAKE_POLL_S = 1.0
ADMISSION_POLL_S = 0.25  # producers re-check admission at least this often  # how often a waiting learner re-checks the time budget and producer health
MAX_PULL_FACTOR = 4  # a step takes what it has after pulling this many batches' worth of groups
INFORMATIVE_EMA = 0.1  # smoothing of the share of groups with a reward signal (admission uses it)
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


@dataclass
class Counters:
    groups_started: int = 0
    groups_failed: int = 0
    zero_adv_groups: int = 0
    tokens_generated: int = 0
    skipped_nonfinite: int = 0
    canary_warnings: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class Run:
    """Everything one training run holds. Built by `setup_run`, torn down by `close_run`."""

    config: TrainConfig
    out_dir: Path
    console: Console
    adapter: str
    task: Task
    tokenizer: Any
    generator: Any
    learner: Learner
    learner_pool: concurrent.futures.ThreadPoolExecutor
    buffer: RolloutBuffer
    metrics: MetricsWriter
    store: AdapterStore
    placements: tuple[Placement, Placement]
    step: int = 0
    next_problem: int = 0
    published: int = -1
    learner_busy: bool = False
    in_flight: int = 0
    wall_offset: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    counters: Counters = field(default_factory=Counters)
    carry: list[Group] = field(default_factory=list)
    fatal: BaseException | None = None
    stopping: bool = False
    admission: asyncio.Condition = field(default_factory=asyncio.Condition)
    evals: list[dict] = field(default_factory=list)
    background: set = field(default_factory=set)
    last_reward: float | None = None
    pulled_rewards: list[float] = field(default_factory=list)  # every group taken for this step
    stop_requested: bool = False
    warned_flat: bool = False
    informative_rate: float = 1.0  # running share of groups with a reward signal

    def groups_consumed_per_step(self) -> int:
        """Groups a step takes from the buffer: groups_per_step, plus the flat ones it skips."""
        per_step = self.config.learner.groups_per_step
        return math.ceil(per_step / max(self.informative_rate, 1 / MAX_PULL_FACTOR))

    @property
    def wall_s(self) -> float:
        return self.wall_offset + time.perf_counter() - self.started

    async def in_learner(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.learner_pool, fn, *args)

    def generate(self, request: GenRequest) -> Any:
        return asyncio_generate(self.generator)(request)

    def out_of_budget(self) -> bool:
        budget = self.config.run.time_budget_s
        return (self.stop_requested or self.step >= self.config.run.max_steps
                or (budget is not None and self.wall_s >= budget))

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
    producers: list[asyncio.Task] = []
    try:
        await publish(run)
        if config.run.eval_at_start:
            await eval_event(run, "start")
        producers = [asyncio.create_task(produce(run)) for _ in range(config.generator.groups_in_flight)]
        while not run.out_of_budget():
            marks = _marks(run)
            groups = await collect_batch(run)
            if groups is None:  # out of time while waiting, or a producer failed
                break
            run.learner_busy = True
            stats: StepStats = await run.in_learner(run.learner.train_step, run.adapter, _samples(groups))
            sync = await publish(run) if stats.updated else None
            run.learner_busy = False
            await run.notify()
            run.step += 1
            run.counters.skipped_nonfinite += int(stats.skipped_nonfinite)
            run.metrics.step(step_row(run, groups, stats, sync, marks))
            await after_step(run, stats)
            if on_step is not None:
                on_step(run)
        if run.fatal is not None:
            raise TrainingError(str(run.fatal)) from run.fatal
    finally:
        run.stopping = True
        await run.notify()
        for task in producers:
            task.cancel()
        await asyncio.gather(*producers, return_exceptions=True)
        summary = await finish_run(run)
    return summary


async def collect_batch(run: Run) -> list[Group] | None:
    """`groups_per_step` informative groups (rewards not all equal), fitting the micro-batch cap."""
    cfg = run.config.learner
    groups, run.carry = run.carry, []
    run.pulled_rewards = [s.reward for g in groups for s in g.samples]
    pulled = 0
    keep_all = run.config.loss.kl_coef > 0
    while len(groups) < cfg.groups_per_step:
        if run.fatal is not None or run.out_of_budget():
            return None
        dropped = run.buffer.counters.dropped_stale
        try:
            group = await asyncio.wait_for(run.buffer.take(run.adapter, run.published), TAKE_POLL_S)
        except asyncio.TimeoutError:
            if run.buffer.counters.dropped_stale != dropped:
                await run.notify()  # stale groups left the queue: producers may start again
            continue
        await run.notify()
        pulled += 1
        run.pulled_rewards.extend(group.rewards)
        run.informative_rate += INFORMATIVE_EMA * (float(group.informative or keep_all) - run.informative_rate)
        if not group.informative and not keep_all:
            run.counters.zero_adv_groups += 1
        elif groups and run.learner.micro_batches_needed(_samples(groups + [group])) > cfg.micro_batches_per_step:
            run.carry.append(group)
            break
        else:
            groups.append(group)
        if pulled >= MAX_PULL_FACTOR * cfg.groups_per_step:
            # Rewards saturated (or flat): step with what there is, even nothing, so the run
            # keeps its step budget and the metrics show it, instead of waiting forever.
            if not groups and not run.warned_flat:
                run.warned_flat = True
                run.console.print(f"[yellow]no reward signal in the last {pulled} groups (every sample of "
                                  f"a group scored the same, e.g. {group.rewards[0]}): steps make no update[/]")
            break
    return groups


async def produce(run: Run) -> None:
    """One producer: start a group when admitted, score it, put it in the buffer. Forever.

    An unexpected error ends the run with that error (a silent dead producer would hang it).
    """
    try:
        await _produce(run)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        run.console.print_exception(show_locals=False)
        run.fatal = TrainingError(f"a rollout producer failed: {type(exc).__name__}: {exc}")


async def _produce(run: Run) -> None:
    cfg = run.config
    while not run.stopping:
        async with run.admission:
            # Re-checked on every notify, and every ADMISSION_POLL_S as a safety net: the buffer
            # drops stale groups inside `take`, which changes the queue without a notify.
            while not (run.stopping or may_start(
                    run.learner_busy, run.in_flight + run.buffer.groups() + len(run.carry),
                    run.groups_consumed_per_step(), cfg.buffer.max_staleness)):
                try:
                    await asyncio.wait_for(run.admission.wait(), ADMISSION_POLL_S)
                except asyncio.TimeoutError:
                    pass
        if run.stopping:
            return
        index = run.next_problem
        run.next_problem += 1
        run.in_flight += 1
        run.counters.groups_started += 1
        try:
            group = await make_group(run, index)
            if group is not None:
                await run.buffer.put(group)
        finally:
            run.in_flight -= 1
            await run.notify()


async def make_group(run: Run, index: int) -> Group | None:
    gen = run.config.generator
    problem = run.task.train_problem(index)
    prompt_ids = render_prompt(run.tokenizer, problem.prompt, run.task.system_prompt)
    request = GenRequest(prompt_ids, run.adapter, n=gen.samples_per_prompt, max_tokens=gen.max_new_tokens,
                         temperature=gen.temperature, top_p=gen.top_p)
    result = await run.generate(request)
    if not result.ok:
        run.counters.groups_failed += 1
        if result.error and "engine failed" in result.error:
            run.fatal = TrainingError(f"the vLLM engine died: {result.error}")
        return None
    texts = run.tokenizer.batch_decode([s.token_ids for s in result.samples], skip_special_tokens=True)
    rewards = await asyncio.to_thread(run.task.rewards, problem, texts)
    advantages = group_advantages(rewards)
    run.counters.tokens_generated += sum(len(s.token_ids) for s in result.samples)
    samples = [
        TrainSample(run.adapter, result.version, prompt_ids, s.token_ids, s.logprobs, r, a, s.finish_reason)
        for s, r, a in zip(result.samples, rewards, advantages)
    ]
    return Group(run.adapter, result.version, index, samples)


async def publish(run: Run) -> dict[str, float]:
    """Hand the learner's current adapter to the generator (tensors only, in memory)."""
    version = await run.in_learner(run.learner.adapter_version, run.adapter)
    handed = time.perf_counter()
    stats = await asyncio.to_thread(run.generator.publish, version)
    run.published = version.version
    await run.notify()
    total_ms = (time.perf_counter() - handed) * 1000
    return {"sync_ms": stats.ms, "sync_total_ms": total_ms, "sync_bytes": stats.bytes}


async def after_step(run: Run, stats: StepStats) -> None:
    """Checkpoint, eval and canary on their schedules."""
    rc = run.config.run
    if rc.checkpoint_every and run.step % rc.checkpoint_every == 0:
        await checkpoint(run)
    if rc.eval_every and run.step % rc.eval_every == 0:
        task = asyncio.create_task(eval_event(run, "periodic"))
        run.background.add(task)
        task.add_done_callback(run.background.discard)
    if rc.canary_every and stats.updated and stats.version % rc.canary_every == 0:
        await canary(run)


async def checkpoint(run: Run) -> None:
    # Groups in flight or buffered are not saved: their prompts are skipped on resume, and the
    # task stream continues from the next undrawn problem.
    state = RunState(run.step, {run.adapter: run.next_problem}, run.wall_s, run.counters.as_dict())
    await run.in_learner(save_checkpoint, run.out_dir, state, run.learner)
    await save_adapter(run, final=False)


async def save_adapter(run: Run, final: bool) -> None:
    learner = run.learner
    version = run.learner.version(run.adapter)
    info = {"step": run.step, "wall_s": round(run.wall_s, 2), "reward_mean": run.last_reward}
    tensors = await run.in_learner(learner.adapter_tensors, run.adapter)
    await asyncio.to_thread(run.store.save, run.adapter, version, tensors, learner.peft_config(run.adapter),
                            info, final)


async def eval_event(run: Run, when: str) -> EvalResult:
    problems = run.task.heldout()
    result = await evaluate(run.generate, run.tokenizer, run.task, problems, run.adapter,
                            run.config.eval_max_tokens)
    row = {"kind": "eval", "when": when, "step": run.step, "version": result.version,
           "wall_s": round(run.wall_s, 3), "accuracy": result.accuracy, "n": result.n}
    run.evals.append(row)
    run.metrics.event(row)
    return result


async def canary(run: Run) -> None:
    """Invariant 7: what vLLM serves under version k is what the learner trained as version k."""
    probe = run.task.heldout()[:1] or [run.task.train_problem(0)]
    prompt_ids = render_prompt(run.tokenizer, probe[0].prompt, run.task.system_prompt)
    result = await run.generate(GenRequest(prompt_ids, run.adapter, n=1, max_tokens=16,
                                           temperature=run.config.generator.temperature))
    if not result.ok or not result.samples or not result.samples[0].token_ids:
        return
    if result.version != run.learner.version(run.adapter):
        return  # the learner moved on meanwhile; the next canary will compare
    sample = result.samples[0]
    probe_sample = TrainSample(run.adapter, result.version, prompt_ids, sample.token_ids, sample.logprobs, 0.0)
    learner_lp = (await run.in_learner(run.learner.logprobs, run.adapter, [probe_sample]))[0]
    diff = statistics.fmean(abs(a - b) for a, b in zip(learner_lp, sample.logprobs))
    run.metrics.event({"kind": "canary", "step": run.step, "version": result.version,
                       "canary_mismatch": diff, "tokens": len(sample.token_ids)})
    if diff > CANARY_WARN_NATS:
        run.counters.canary_warnings += 1
        run.console.print(f"[red]canary: generator and learner disagree by {diff:.2f} nats/token on "
                          f"v{result.version}: the served adapter may not be what was trained[/]")


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

    from .generator.vllm_engine import EngineSpec, VllmGenerator
    from .models import resolve_model

    out_dir = Path(config.run.output_dir)
    checkpoint_path = latest_checkpoint(out_dir) if resume else None
    if resume and checkpoint_path is None:
        console.print(f"[yellow]--resume: no checkpoint in {out_dir}; starting fresh[/]")
    if not resume and (out_dir / "metrics.jsonl").exists():
        raise TrainingError(f"{out_dir} already holds a run; use --resume to continue it or choose "
                            "another run.output_dir")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(dump_config(config))
    model_dir = resolve_model(config.model.name, console)
    gen_place, learn_place = resolve(config.generator.device, config.generator.cpus, config.learner.device,
                                     config.learner.cpus, concurrent=config.buffer.max_staleness > 0)
    console.print(f"model {config.model.name} ({model_dir})\n"
                  f"generator on {gen_place.describe()}, learner on {learn_place.describe()}, "
                  f"max_staleness {config.buffer.max_staleness}")
    task = make_task(config.task, config.run.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    spec = EngineSpec(
        model_dir=model_dir, adapters=tuple(config.adapter_names), max_staleness=config.buffer.max_staleness,
        max_lora_rank=config.max_lora_rank, dtype=config.model.dtype,
        memory_fraction=config.generator.memory_fraction, kv_cache_gb=config.generator.kv_cache_gb,
        max_model_len=config.generator.max_model_len, seed=config.run.seed,
        fast_cpu_lora=config.generator.fast_cpu_lora, engine_log=config.run.engine_log,
    )
    pool = concurrent.futures.ThreadPoolExecutor(1, "lora-async-learner", pin_current_thread, (learn_place,))
    loop = asyncio.get_running_loop()

    def build_learner() -> Learner:
        adapters = {config.adapter.name: (config.lora, config.learner.lr)}
        return Learner(model_dir, adapters, config.learner, config.loss, learn_place,
                       config.generator.temperature, config.run.seed)

    # One after the other: vLLM switches torch's process-wide default dtype while it builds
    # its model, which would leak into a learner built at the same time.
    generator = await asyncio.to_thread(VllmGenerator, spec, gen_place)
    learner = await loop.run_in_executor(pool, build_learner)
    run = Run(config=config, out_dir=out_dir, console=console, adapter=config.adapter.name, task=task,
              tokenizer=tokenizer, generator=generator, learner=learner, learner_pool=pool,
              buffer=RolloutBuffer(config.buffer.max_tokens, config.buffer.max_staleness,
                                   config.buffer.stale_policy),
              metrics=None, store=AdapterStore(out_dir), placements=(gen_place, learn_place))  # type: ignore[arg-type]
    if checkpoint_path is not None:
        state = await run.in_learner(load_checkpoint, checkpoint_path, learner)
        run.step = state.step
        run.next_problem = state.next_problem[run.adapter]
        run.wall_offset = state.wall_s
        run.counters = Counters(**{k: v for k, v in state.counters.items() if k in Counters.__dataclass_fields__})
        kept = truncate_metrics(out_dir / "metrics.jsonl", state.step)
        console.print(f"resumed from {checkpoint_path.name}: step {state.step}, "
                      f"version {learner.version(run.adapter)}, {kept} metric lines kept")
    run.metrics = MetricsWriter(out_dir, config.run.max_steps, config.run.progress, console)
    run.metrics.set_completed(run.step)
    return run


async def finish_run(run: Run) -> dict[str, Any]:
    try:
        for task in list(run.background):
            task.cancel()
        if run.fatal is None:
            await checkpoint(run)
            await save_adapter(run, final=True)
            if run.config.run.eval_at_end:
                await eval_event(run, "end")
        elif run.step > 0:  # keep what was learned before the failure
            await checkpoint(run)
    finally:
        run.metrics.close()
        run.generator.close()
        run.task.close()
        run.learner_pool.shutdown(wait=True)
    summary = {
        "steps": run.step,
        "version": run.learner.version(run.adapter),
        "wall_s": round(run.wall_s, 1),
        "samples_in": run.buffer.counters.samples_in,
        "dropped_stale": run.buffer.counters.dropped_stale,
        "zero_adv_groups": run.counters.zero_adv_groups,
        "tokens_generated": run.counters.tokens_generated,
        "skipped_nonfinite": run.counters.skipped_nonfinite,
        "reward_errors": run.task.stats.errors,
        "output_dir": str(run.out_dir),
    }
    for row in run.evals:
        summary[f"accuracy_{row['when']}"] = row["accuracy"]
    if run.fatal is not None:
        summary["error"] = str(run.fatal)
    (run.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    run.console.print(summary_table(summary))
    ends = {row["when"]: row for row in run.evals}
    if "start" in ends and "end" in ends:
        run.console.print(f"[bold]held-out greedy accuracy: {ends['start']['accuracy']:.2f} -> "
                          f"{ends['end']['accuracy']:.2f}[/] (n={ends['end']['n']}, "
                          f"{run.step} steps, {run.wall_s:.0f} s)")
    return summary


# ---------------------------------------------------------------- metrics rows


def _samples(groups: list[Group]) -> list[TrainSample]:
    return [s for g in groups for s in g.samples]


def _marks(run: Run) -> dict[str, float]:
    return {"wall": time.perf_counter(), "busy": run.generator.stats["busy_s"],
            "tokens": run.counters.tokens_generated}


def step_row(run: Run, groups: list[Group], stats: StepStats, sync: dict | None,
             marks: dict[str, float]) -> dict[str, Any]:
    samples = _samples(groups)
    # The policy's reward: every group taken for this step, including those with no signal
    # (all samples equal) that were not trained on.
    rewards = run.pulled_rewards or [s.reward for s in samples]
    batch_rewards = [s.reward for s in samples]
    lags = [s.policy_lag for s in samples]
    elapsed = max(time.perf_counter() - marks["wall"], 1e-9)
    gen_busy = run.generator.stats["busy_s"] - marks["busy"]
    ls = stats.loss_stats
    reward_mean = statistics.fmean(rewards) if rewards else 0.0
    run.last_reward = reward_mean
    return {
        "step": run.step,
        "adapter": run.adapter,
        "version": stats.version,
        "wall_s": round(run.wall_s, 3),
        "reward_mean": reward_mean,
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "batch_reward_mean": statistics.fmean(batch_rewards) if batch_rewards else 0.0,
        "samples": len(samples),
        "groups": len(groups),
        "tokens_generated": run.counters.tokens_generated - int(marks["tokens"]),
        "tokens_generated_total": run.counters.tokens_generated,
        "tokens_trained": stats.tokens_trained,
        "padded_tokens": stats.padded_tokens,
        "micro_batches": stats.micro_batches,
        "policy_lag_mean": statistics.fmean(lags) if lags else 0.0,
        "policy_lag_max": max(lags) if lags else 0,
        "dropped_stale": run.buffer.counters.dropped_stale,
        "admitted_stale": run.buffer.counters.admitted_stale,
        "zero_adv_groups": run.counters.zero_adv_groups,
        "ratio_mean": ls.ratio_mean,
        "ratio_max": ls.ratio_max if ls.tokens else 1.0,
        "ratio_min": ls.ratio_min if ls.tokens else 1.0,
        "clip_frac": ls.clip_frac,
        "kl": ls.kl,
        "loss": stats.loss,
        "grad_norm": stats.grad_norm,
        "updated": stats.updated,
        "sync_ms": sync["sync_ms"] if sync else 0.0,
        "sync_total_ms": sync["sync_total_ms"] if sync else 0.0,
        "learner_s": stats.seconds,
        "gen_idle_frac": max(0.0, 1.0 - gen_busy / elapsed),
        "learner_idle_frac": max(0.0, 1.0 - stats.seconds / elapsed),
        "logprob_mismatch": ls.logprob_mismatch,
        "logprob_mismatch_onpolicy": ls.onpolicy_mismatch,
        "skipped_nonfinite": run.counters.skipped_nonfinite,
        "reward_errors": run.task.stats.errors,
    }
