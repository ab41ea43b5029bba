"""Run metrics: `OUT/metrics.jsonl` (one line per learner step, plus eval and canary lines),
TensorBoard, and what the console shows while a run trains.

On a terminal the console shows a rich progress bar that follows whichever limit will end the
run (steps, or the time budget when that comes first). Elsewhere (nohup, CI, a log file) it
prints a one-line step summary at most every `run.log_interval_s`. The JSONL file is the source
of truth; on resume it is cut back to the checkpointed step, so lines are never duplicated.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

if TYPE_CHECKING:
    from .buffer import Group
    from .config import RunConfig
    from .learner import StepStats
    from .orchestrator.state import AdapterRun, Run

STEP_KEYS = (
    "step", "adapter", "version", "wall_s", "reward_mean", "reward_std", "samples",
    "tokens_generated", "tokens_trained", "policy_lag_mean", "policy_lag_max", "dropped_stale",
    "ratio_mean", "ratio_max", "clip_frac", "loss", "grad_norm", "sync_ms", "gen_idle_frac",
    "learner_idle_frac", "logprob_mismatch", "skipped_nonfinite", "reward_errors",
)


def _clean(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def truncate_metrics(path: Path, last_steps: dict[str, int]) -> int:
    """Keep only lines up to each adapter's checkpointed step. Returns the lines kept."""
    if not path.is_file():
        return 0
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        if int(row.get("step", 0)) <= last_steps.get(row.get("adapter", ""), 0):
            kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)
    return len(kept)


def read_metrics(path: Path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


# ---------------------------------------------------------------- what a step line holds


def step_marks(run: "Run", adapter: "AdapterRun") -> dict[str, float]:
    """Where the clocks stand when an adapter's step begins (its line reports the differences)."""
    stats = run.generator.stats
    return {"wall": time.perf_counter(), "busy": stats.busy_s, "tokens": adapter.counters.tokens_generated,
            "engine_steps": stats.steps, "engine_running": stats.running}


def step_row(run: "Run", adapter: "AdapterRun", groups: list["Group"], stats: "StepStats") -> dict[str, Any]:
    """The step's metrics line (the sync figures are filled in once the version is registered)."""
    samples = [s for g in groups for s in g.samples]
    # The policy's reward: every group taken for this step, including those with no signal
    # (all samples equal) that were not trained on.
    rewards = adapter.pulled_rewards or [s.reward for s in samples]
    batch_rewards = [s.reward for s in samples]
    lags = [s.policy_lag for s in samples]
    marks = adapter.marks
    elapsed = max(time.perf_counter() - marks["wall"], 1e-9)
    gen_busy = run.generator.stats.busy_s - marks["busy"]
    ls = stats.loss_stats
    return {
        "step": adapter.step, "global_step": run.global_step, "adapter": adapter.name, "version": stats.version,
        "wall_s": round(run.wall_s, 3),
        "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "batch_reward_mean": statistics.fmean(batch_rewards) if batch_rewards else 0.0,
        "samples": len(samples), "groups": len(groups), "flat_groups_trained": sum(not g.informative for g in groups),
        "tokens_generated": adapter.counters.tokens_generated - int(marks["tokens"]),
        "tokens_generated_total": sum(a.counters.tokens_generated for a in run.adapters.values()),
        "tokens_trained": stats.tokens_trained, "padded_tokens": stats.padded_tokens,
        "micro_batches": stats.micro_batches,
        "policy_lag_mean": statistics.fmean(lags) if lags else 0.0, "policy_lag_max": max(lags) if lags else 0,
        "dropped_stale": run.buffer.counters.per_adapter_dropped.get(adapter.name, 0),
        "admitted_stale": run.buffer.counters.admitted_stale, "zero_adv_groups": adapter.counters.zero_adv_groups,
        "ratio_mean": ls.ratio_mean, "ratio_max": ls.ratio_max if ls.tokens else 1.0,
        "ratio_min": ls.ratio_min if ls.tokens else 1.0, "clip_frac": ls.clip_frac, "kl": ls.kl,
        "loss": stats.loss, "grad_norm": stats.grad_norm, "updated": stats.updated,
        "sync_ms": 0.0, "sync_wait_ms": 0.0, "learner_s": stats.seconds,
        "gen_idle_frac": max(0.0, 1.0 - gen_busy / elapsed),
        "engine_running_mean": engine_running_mean(run, marks),
        "learner_idle_frac": max(0.0, 1.0 - stats.seconds / elapsed),
        "logprob_mismatch": ls.logprob_mismatch, "logprob_mismatch_onpolicy": ls.onpolicy_mismatch,
        "skipped_nonfinite": adapter.counters.skipped_nonfinite,
        "rejected_versions": adapter.counters.rejected_versions,
        "aborted_stale_groups": adapter.counters.aborted_stale, "reward_errors": adapter.task.stats.errors,
        **episode_figures(adapter),
        **replica_figures(run),
    }


def replica_figures(run: "Run") -> dict[str, Any]:
    """A generator with replicas (Ray): the run's totals so far, per replica where it says so.
    Empty for one engine."""
    return run.generator.stats.replica_figures()


def engine_running_mean(run: "Run", marks: dict[str, float]) -> float | None:
    """Requests in flight per engine step since the step began (None where not counted)."""
    stats = run.generator.stats
    steps = stats.steps - marks.get("engine_steps", stats.steps)
    return (stats.running - marks["engine_running"]) / steps if steps else None


def episode_figures(adapter: "AdapterRun") -> dict[str, Any]:
    """Environment tasks: the episodes of every group taken for this step (trained or skipped as
    flat: the policy's figures, like `reward_mean`) and the run's fault counters. Empty for
    single-turn tasks."""
    rows = adapter.pulled_episodes
    c = adapter.counters
    if not rows:
        return {"episodes": 0} if c.episodes else {}

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in rows)

    return {"episodes": len(rows), "success_rate": mean("success"), "turns_mean": mean("turns"),
            "turns_max": max(r["turns"] for r in rows), "tool_calls_mean": mean("tool_calls"),
            "tool_call_rate": statistics.fmean(float(r["tool_calls"] > 0) for r in rows),
            "episode_tokens_mean": mean("tokens"), "episode_tokens_max": max(r["tokens"] for r in rows),
            "version_span_mean": mean("version_span"), "version_span_max": max(r["version_span"] for r in rows),
            "resumed_turns": sum(r["resumed_turns"] for r in rows),
            "tokens_reprefilled": sum(r["tokens_reprefilled"] for r in rows),
            "env_errors": c.env_errors, "tool_errors": c.tool_errors, "truncated_episodes": c.truncated_episodes,
            "resumed_turns_total": c.resumed_turns, "tokens_reprefilled_total": c.tokens_reprefilled}


def run_summary(run: "Run") -> dict[str, Any]:
    """`OUT/summary.json`: the run's totals (per adapter, prefixed by its name in a fleet)."""
    summary: dict[str, Any] = {"steps": run.global_step, "wall_s": round(run.wall_s, 1),
                               "samples_in": run.buffer.counters.samples_in,
                               "dropped_stale": run.buffer.counters.dropped_stale, "output_dir": str(run.out_dir)}
    for name, adapter in run.adapters.items():
        prefix = "" if len(run.adapters) == 1 else f"{name}."
        counters = adapter.counters
        summary.update({f"{prefix}version": run.learner.version(name),
                        f"{prefix}zero_adv_groups": counters.zero_adv_groups,
                        f"{prefix}tokens_generated": counters.tokens_generated,
                        f"{prefix}skipped_nonfinite": counters.skipped_nonfinite,
                        f"{prefix}rejected_versions": counters.rejected_versions,
                        f"{prefix}aborted_stale_groups": counters.aborted_stale,
                        f"{prefix}reward_errors": adapter.task.stats.errors})
        if counters.episodes:
            summary.update({f"{prefix}{key}": getattr(counters, key) for key in (
                "episodes", "env_errors", "truncated_episodes", "tool_calls", "tool_errors", "resumed_turns",
                "tokens_reprefilled")})
        for row in (r for r in run.evals if r["adapter"] == name):
            summary[f"{prefix}accuracy_{row['when']}"] = row["accuracy"]
    summary.update(replica_figures(run))
    if run.error is not None:
        summary["error"] = str(run.error)
    return summary


def summary_table(summary: dict[str, Any]) -> Table:
    table = Table(title="lora-async run summary", show_header=False)
    for key, value in summary.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    return table


# ---------------------------------------------------------------- the writer


class MetricsWriter:
    """One JSONL line per step (and per eval/canary), TensorBoard, and the console view."""

    def __init__(self, out_dir: Path, adapters: list[str], run: "RunConfig", console: Console) -> None:
        self.path = out_dir / "metrics.jsonl"
        self.console = console
        self.limits = run
        self._file = open(self.path, "a", buffering=1)
        self._tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(out_dir / "tb"))
        except Exception as exc:  # tensorboard missing: keep the JSONL, say so once
            console.print(f"[yellow]TensorBoard disabled: {exc}[/]")
        self._adapters = list(adapters)
        self._accuracy: dict[str, float] = {}
        self._last_line = -math.inf
        self._started = time.perf_counter()
        self._progress: Progress | None = None
        self._tasks: dict[str, Any] = {}
        if run.progress and console.is_terminal:  # a bar draws nothing without a terminal
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[limit]}"),
                TextColumn("reward {task.fields[reward]}"), TextColumn("{task.fields[tps]} tok/s"),
                TextColumn("lag {task.fields[lag]}"), TimeElapsedColumn(), console=console, transient=False)
            self._progress.start()
            for name in adapters:
                self._tasks[name] = self._progress.add_task(name, total=run.max_steps, reward="-", tps="-", lag="-",
                                                            limit=f"0/{run.max_steps} steps")

    def step(self, row: dict[str, Any]) -> None:
        row = {k: _clean(v) for k, v in row.items()}
        self._file.write(json.dumps(row) + "\n")
        self._scalars(row.get("adapter", "main"), row)
        tps = row.get("tokens_generated_total", 0) / max(time.perf_counter() - self._started, 1e-9)
        if self._progress is not None:
            done, total, limit = self._nearer_limit(row["step"], row["wall_s"])
            self._progress.update(self._tasks[row["adapter"]], completed=done, total=total, limit=limit,
                                  reward=f"{row.get('reward_mean') or 0:.2f}", tps=f"{tps:.0f}",
                                  lag=f"{row.get('policy_lag_mean') or 0:.1f}")
            return
        now = time.perf_counter()
        last = row["step"] >= self.limits.max_steps
        if now - self._last_line >= self.limits.log_interval_s or last:
            self._last_line = now
            self.console.print(self._line(row, tps), highlight=False, soft_wrap=True)

    def _line(self, row: dict[str, Any], tps: float) -> str:
        """The one-line step summary for logs."""
        who = f"{row['adapter']} " if len(self._adapters) > 1 else ""
        accuracy = self._accuracy.get(row["adapter"])
        _, _, limit = self._nearer_limit(row["step"], row["wall_s"])
        return (f"{who}step {row['step']} ({limit}) v{row.get('version')}  "
                f"reward {row.get('reward_mean') or 0:.3f}"
                + (f"  accuracy {accuracy:.2f}" if accuracy is not None else "")
                + f"  {tps:.0f} tok/s  lag {row.get('policy_lag_mean') or 0:.1f}"
                f"  sync {row.get('sync_ms') or 0:.1f} ms")

    def _nearer_limit(self, step: int, wall_s: float) -> tuple[float, float, str]:
        """(completed, total, text) of whichever limit will end the run first at this pace."""
        steps, budget = self.limits.max_steps, self.limits.time_budget_s
        if budget is not None and step > 0 and (steps - step) * wall_s / step > budget - wall_s:
            return min(wall_s, budget), budget, f"{wall_s:.0f}/{budget:.0f} s"
        return step, steps, f"{step}/{steps} steps"

    def event(self, row: dict[str, Any]) -> None:
        """A non-step line (eval, canary): same file, with a `kind` key."""
        row = {k: _clean(v) for k, v in row.items()}
        self._file.write(json.dumps(row) + "\n")
        if row.get("kind") == "eval" and row.get("accuracy") is not None:
            self._accuracy[row["adapter"]] = row["accuracy"]
        self._scalars(row.get("kind", "event"), row)

    def _scalars(self, prefix: str, row: dict[str, Any]) -> None:
        if self._tb is None or "step" not in row:
            return
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                self._tb.add_scalar(f"{prefix}/{key}", value, int(row["step"]))

    def set_completed(self, adapter: str, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._tasks[adapter], completed=step, limit=f"{step}/{self.limits.max_steps} steps")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        self._file.close()
