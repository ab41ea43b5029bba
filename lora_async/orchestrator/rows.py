"""The rows a run writes: each step's metrics line and `summary.json`, built from the run's state
(`metrics.MetricsWriter` writes them; it knows nothing of the orchestrator)."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

from ..buffer import Group
from .state import AdapterRun, Run, StepMarks

if TYPE_CHECKING:
    from ..learner import StepStats  # the learner package imports peft: only for the annotation


def step_row(run: Run, adapter: AdapterRun, groups: list[Group], stats: StepStats) -> dict[str, Any]:
    """The step's metrics line (the sync figures are filled in once the version is registered)."""
    samples = [s for g in groups for s in g.samples]
    # The policy's reward: every group taken for this step, including those with no signal
    # (all samples equal) that were not trained on.
    rewards = adapter.pulled_rewards or [s.reward for s in samples]
    batch_rewards = [s.reward for s in samples]
    lags = [s.policy_lag for s in samples]
    marks = adapter.marks
    elapsed = max(time.perf_counter() - marks.wall, 1e-9)
    gen_busy = run.generator.stats.busy_s - marks.busy_s
    ls = stats.loss_stats
    counters = adapter.counters
    return {
        "step": adapter.step, "global_step": run.global_step, "adapter": adapter.name, "version": stats.version,
        "wall_s": round(run.wall_s, 3),
        "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "batch_reward_mean": statistics.fmean(batch_rewards) if batch_rewards else 0.0,
        "samples": len(samples), "groups": len(groups), "flat_groups_trained": sum(not g.informative for g in groups),
        "tokens_generated": counters.tokens_generated - marks.tokens,
        "tokens_generated_total": sum(a.counters.tokens_generated for a in run.adapters.values()),
        "tokens_trained": stats.tokens_trained, "padded_tokens": stats.padded_tokens,
        "micro_batches": stats.micro_batches,
        "policy_lag_mean": statistics.fmean(lags) if lags else 0.0, "policy_lag_max": max(lags) if lags else 0,
        "dropped_stale": run.buffer.counters.per_adapter_dropped.get(adapter.name, 0),
        "admitted_stale": run.buffer.counters.admitted_stale, "zero_adv_groups": counters.zero_adv_groups,
        "ratio_mean": ls.ratio_mean, "ratio_max": ls.ratio_max if ls.tokens else 1.0,
        "ratio_min": ls.ratio_min if ls.tokens else 1.0, "clip_frac": ls.clip_frac, "kl": ls.kl,
        "loss": stats.loss, "grad_norm": stats.grad_norm, "updated": stats.updated,
        "sync_ms": 0.0, "sync_wait_ms": 0.0, "learner_s": stats.seconds,
        "gen_idle_frac": max(0.0, 1.0 - gen_busy / elapsed),
        "engine_running_mean": engine_running_mean(run, marks),
        "learner_idle_frac": max(0.0, 1.0 - stats.seconds / elapsed),
        "logprob_mismatch": ls.logprob_mismatch, "logprob_mismatch_onpolicy": ls.onpolicy_mismatch,
        "skipped_nonfinite": counters.skipped_nonfinite,
        "rejected_versions": counters.rejected_versions,
        "aborted_stale_groups": counters.aborted_stale, "reward_errors": adapter.source.stats.errors,
        **episode_figures(adapter),
        **run.generator.stats.replica_figures(),
    }


def engine_running_mean(run: Run, marks: StepMarks) -> float | None:
    """Requests in flight per engine step since the step began (None where not counted)."""
    stats = run.generator.stats
    steps = stats.steps - marks.engine_steps
    return (stats.running - marks.engine_running) / steps if steps else None


def episode_figures(adapter: AdapterRun) -> dict[str, Any]:
    """Environment tasks: the episodes of every group taken for this step (trained or skipped as
    flat: the policy's figures, like `reward_mean`) and the run's totals. Empty for single-turn
    tasks."""
    pulled, totals = adapter.pulled_episodes, adapter.counters.episode_stats
    if not pulled.episodes:
        return {"episodes": 0} if totals.episodes else {}
    return {**pulled.step_figures(), **totals.total_figures()}


def run_summary(run: Run) -> dict[str, Any]:
    """`OUT/summary.json`: the run's totals (per adapter, prefixed by its name in a fleet)."""
    summary: dict[str, Any] = {"steps": run.global_step, "wall_s": round(run.wall_s, 1),
                               "samples_in": run.buffer.counters.samples_in,
                               "dropped_stale": run.buffer.counters.dropped_stale, "output_dir": str(run.out_dir)}
    for name, adapter in run.adapters.items():
        prefix = "" if len(run.adapters) == 1 else f"{name}."
        counters = adapter.counters
        totals = {"version": run.learner.version(name), "zero_adv_groups": counters.zero_adv_groups,
                  "tokens_generated": counters.tokens_generated, "skipped_nonfinite": counters.skipped_nonfinite,
                  "rejected_versions": counters.rejected_versions, "aborted_stale_groups": counters.aborted_stale,
                  "reward_errors": adapter.source.stats.errors}
        if counters.episode_stats.episodes:
            totals.update(counters.episode_stats.summary_figures())
        summary.update({f"{prefix}{key}": value for key, value in totals.items()})
        for row in (r for r in run.evals if r["adapter"] == name):
            summary[f"{prefix}accuracy_{row['when']}"] = row["accuracy"]
    summary.update(run.generator.stats.replica_figures())
    if run.error is not None:
        summary["error"] = str(run.error)
    return summary
