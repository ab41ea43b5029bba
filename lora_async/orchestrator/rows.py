"""The rows a run writes: each step's metrics line and `summary.json`, built from the run's state
(`metrics.MetricsWriter` writes them; it knows nothing of the orchestrator). A step's time and
size are typed first (`step_record`, a `mode.StepRecord`: what auto reads), and its line gives
them under their keys.

Both say where the time went (`timing.py`): the generator's compute against its idle time and
what it waited on, the learner's compute against its wait for data, and the reward, tool and
environment calls' p50/p95.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from ..buffer import Group
from ..lag_figures import run_averages
from ..metrics import read_metrics
from ..mode import StepRecord
from ..timing import GeneratorSplit, IdleSplit, call_figures, call_waits
from .state import AdapterRun, Run, StepMarks

if TYPE_CHECKING:
    from ..learner import StepStats  # the learner package imports peft: only for the annotation


def step_record(run: Run, adapter: AdapterRun, groups: list[Group], stats: StepStats, until: StepMarks) -> StepRecord:
    """The step's time and size, over the interval from the adapter's marks to `until`. The
    reward, tool and environment calls recorded since the adapter's previous step are taken for it."""
    marks = adapter.marks
    samples = sum(len(g.samples) for g in groups)
    return StepRecord(step_s=round(max(until.wall - marks.wall, 1e-9), 4), learner_s=stats.seconds,
                      generator=generator_split(marks, until), calls=call_waits(adapter.waits.take()),
                      engine_batch=engine_running_mean(run, marks),
                      engine_steps=run.generator.stats.steps - marks.engine_steps, samples=samples,
                      samples_pulled=len(adapter.pulled_rewards) or samples, groups=len(groups),
                      tokens_trained=stats.tokens_trained, padded_tokens=stats.padded_tokens)


def step_row(run: Run, adapter: AdapterRun, groups: list[Group], stats: StepStats, step: StepRecord,
             until: StepMarks) -> dict[str, Any]:
    """The step's metrics line, over the interval from the adapter's marks to `until`, with the
    step's figures (`step_record`). The sync figures are filled in once the version is registered."""
    samples = [s for g in groups for s in g.samples]
    # The policy's reward: every group taken for this step, including those with no signal
    # (all samples equal) that were not trained on.
    rewards = adapter.pulled_rewards or [s.reward for s in samples]
    batch_rewards = [s.reward for s in samples]
    lags = [s.policy_lag for s in samples]
    marks = adapter.marks
    elapsed = max(until.wall - marks.wall, 1e-9)
    gen_busy = until.busy_s - marks.busy_s
    ls = stats.loss_stats
    counters = adapter.counters
    return {
        "step": adapter.step, "global_step": run.global_step, "adapter": adapter.name, "version": stats.version,
        "wall_s": round(run.wall_s, 3),
        "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        # each reward function's mean over the completions it scored (`reward/<name>`)
        **{f"reward/{name}": statistics.fmean(values) for name, values in adapter.pulled_parts.items() if values},
        "batch_reward_mean": statistics.fmean(batch_rewards) if batch_rewards else 0.0,
        "samples": step.samples, "samples_pulled": step.samples_pulled,
        "groups": step.groups, "flat_groups_trained": sum(not g.informative for g in groups),
        "tokens_generated": counters.tokens_generated - marks.tokens,
        "tokens_generated_total": sum(a.counters.tokens_generated for a in run.adapters.values()),
        "tokens_trained": step.tokens_trained, "padded_tokens": step.padded_tokens,
        "micro_batches": stats.micro_batches,
        "policy_lag_mean": statistics.fmean(lags) if lags else 0.0, "policy_lag_max": max(lags) if lags else 0,
        "dropped_stale": run.buffer.counters.per_adapter_dropped.get(adapter.name, 0),
        "admitted_stale": run.buffer.counters.admitted_stale,
        "stale_tokens_corrected": run.buffer.counters.stale_tokens_corrected,
        "zero_adv_groups": counters.zero_adv_groups,
        "ratio_mean": ls.ratio_mean, "ratio_max": ls.ratio_max if ls.tokens else 1.0,
        "ratio_min": ls.ratio_min if ls.tokens else 1.0, "clip_frac": ls.clip_frac, "kl": ls.kl,
        "loss": stats.loss, "grad_norm": stats.grad_norm, "updated": stats.updated,
        "ess_frac": ls.ess_frac, "lr_scale": stats.lr_scale,
        **ls.lag_figures(),  # lag0/tokens, lag0/clip_frac, ... (lag_figures.py)
        "sync_ms": 0.0, "sync_wait_ms": 0.0, "learner_s": step.learner_s,
        "learner_cpu_s": round(stats.cpu_s, 4),  # the process's, over the learner's step (StepStats.cpu_s)
        "learner_wait_s": round(run.learner_clock.waited_s, 4),
        "step_s": step.step_s, **step.generator.figures(), **call_figures(step.calls),
        "gen_idle_frac": max(0.0, 1.0 - gen_busy / elapsed),
        "engine_running_mean": step.engine_batch, "engine_steps": step.engine_steps,
        "learner_idle_frac": max(0.0, 1.0 - stats.seconds / elapsed),
        "logprob_mismatch": ls.logprob_mismatch, "logprob_mismatch_onpolicy": ls.onpolicy_mismatch,
        "skipped_nonfinite": counters.skipped_nonfinite,
        "rejected_versions": counters.rejected_versions,
        "aborted_stale_groups": counters.aborted_stale, "reward_errors": adapter.source.stats.errors,
        **episode_figures(adapter),
        **(league.figures() if (league := adapter.source.league) is not None else {}),
        **run.generator.stats.replica_figures(),
    }


def generator_split(since: StepMarks, until: StepMarks) -> GeneratorSplit:
    """Where the generator's time went between two marks: computing (the engine's busy time,
    exact; capped at the interval, which an engine step straddling a mark can overshoot) or
    idle, the idle time split by what waited while no request was in flight (the board's
    samples, fitted to it: the parts sum to `gen_idle_s`)."""
    interval = max(until.wall - since.wall, 0.0)
    compute = min(max(until.busy_s - since.busy_s, 0.0), interval)
    split = until.idle.minus(since.idle).fitted(interval - compute)
    return GeneratorSplit(round(compute, 4), round(interval - compute, 4),
                          IdleSplit(*(round(seconds, 4) for seconds in split.parts().values())))


def time_totals(run: Run) -> dict[str, float]:
    """The run's time split, from training's start to its end (this session's, after a resume):
    the generator's, and the learner's compute, wait for data, and the rest (step bookkeeping,
    checkpoints, the stretch after the last step). Empty if training never began."""
    if run.began is None or run.ended is None:
        return {}
    training = max(run.ended.wall - run.began.wall, 0.0)
    clock = run.learner_clock
    return {"training_s": round(training, 3), **generator_split(run.began, run.ended).figures(),
            "learner_compute_s": round(clock.compute_s, 4), "learner_wait_s": round(clock.wait_s, 4),
            "learner_other_s": round(max(0.0, training - clock.compute_s - clock.wait_s), 4)}


def engine_running_mean(run: Run, marks: StepMarks) -> float | None:
    """Sequences in flight per engine step since the step began (None where not counted)."""
    stats = run.generator.stats
    steps = stats.steps - marks.engine_steps
    return (stats.running - marks.engine_running) / steps if steps else None


def episode_figures(adapter: AdapterRun) -> dict[str, Any]:
    """Environment tasks: the episodes of every group taken for this step (trained or skipped as
    flat: the policy's figures, like `reward_mean`) and the run's totals. Single-turn tasks: the
    completions continued on a newer version (partial rollouts) once there are any, under the
    keys episodes report their continued turns with; otherwise nothing."""
    pulled, totals = adapter.pulled_episodes, adapter.counters.episode_stats
    if pulled.episodes:
        return {**pulled.step_figures(), **totals.total_figures()}
    figures: dict[str, Any] = {"episodes": 0} if totals.episodes else {}
    if totals.resumed_turns:
        figures.update(pulled.resumed_figures(), **totals.resumed_total_figures())
    return figures


def lag_averages(run: Run, adapter: str) -> dict[str, float | int]:
    """The adapter's figures by lag over every step of the run, resumed sessions included (the
    metrics file is the source of truth)."""
    path = run.out_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = (r for r in read_metrics(path) if "kind" not in r and r.get("adapter") == adapter)
    return {key: round(value, 6) for key, value in run_averages(rows).items()}


def run_summary(run: Run) -> dict[str, Any]:
    """`OUT/summary.json`: the run's totals (per adapter, prefixed by its name in a fleet)."""
    summary: dict[str, Any] = {"steps": run.global_step, "wall_s": round(run.wall_s, 1),
                               "samples_in": run.buffer.counters.samples_in,
                               "dropped_stale": run.buffer.counters.dropped_stale,
                               "stale_tokens_corrected": run.buffer.counters.stale_tokens_corrected,
                               "output_dir": str(run.out_dir),
                               # "done" (a limit), "requested" (Ctrl-C or SIGTERM: stopped after a step), "failed"
                               "ended": run.phase.value}
    for name, adapter in run.adapters.items():
        prefix = "" if len(run.adapters) == 1 else f"{name}."
        counters = adapter.counters
        totals: dict[str, Any] = {
            "version": run.learner.version(name), "zero_adv_groups": counters.zero_adv_groups,
            "tokens_generated": counters.tokens_generated, "skipped_nonfinite": counters.skipped_nonfinite,
            "rejected_versions": counters.rejected_versions, "aborted_stale_groups": counters.aborted_stale,
            "reward_errors": adapter.source.stats.errors}
        if counters.episode_stats.episodes:
            totals.update(counters.episode_stats.summary_figures())
        elif counters.episode_stats.resumed_turns:  # single-turn completions continued (partial rollouts)
            totals.update(counters.episode_stats.resumed_figures())
        totals.update({key: round(value, 6) for key, value in adapter.waits.run_figures().items()})
        summary.update({f"{prefix}{key}": value for key, value in totals.items()})
        for row in (r for r in run.evals if r["adapter"] == name):
            summary[f"{prefix}accuracy_{row['when']}"] = row["accuracy"]
        summary.update({f"{prefix}{key}": value for key, value in lag_averages(run, name).items()})
        if adapter.source.league is not None:  # every version it kept, with its Elo rating and results
            summary[f"{prefix}league"] = adapter.source.league.summary()
    summary.update(run.generator.stats.replica_figures())
    summary.update(time_totals(run))
    summary.update(run.choice.figures() if run.choice is not None else
                   {"mode": "sync", "mode_reason": "auto: the run ended before it had measured a step"})
    # every decision of the run (resumed sessions' too): what it chose, when, from what, and why
    summary["mode_decisions"] = ([{k: v for k, v in d.items() if k != "choice"} for d in run.auto.decisions]
                                 if run.auto is not None else
                                 [run.choice.figures()] if run.choice is not None else [])
    if run.error is not None:
        summary["error"] = str(run.error)
    return summary
