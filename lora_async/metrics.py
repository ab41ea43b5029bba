"""Run metrics: `OUT/metrics.jsonl` (one line per learner step, plus eval and canary lines),
the experiment trackers of `run.report_to` (`trackers/`: TensorBoard by default), and what the
console shows while a run trains (`progress.run_console`).

On a terminal the console shows a rich progress bar that follows whichever limit will end the
run (steps, or the time budget when that comes first). Elsewhere (nohup, CI, a log file) it
prints a one-line step summary at most every `run.log_interval_s`, and every status line stays
one line. The JSONL file is the source
of truth; on resume it is cut back to the checkpointed step, so lines are never duplicated.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .league import league_line
from .progress import Stage
from .timing import IDLE_CAUSES

if TYPE_CHECKING:
    from .config import RunConfig
    from .trackers import Trackers

STEP_KEYS = (
    "step", "adapter", "version", "wall_s", "reward_mean", "reward_std", "samples",
    "tokens_generated", "tokens_trained", "policy_lag_mean", "policy_lag_max", "dropped_stale",
    "ratio_mean", "ratio_max", "clip_frac", "loss", "grad_norm", "sync_ms", "gen_idle_frac",
    "learner_idle_frac", "logprob_mismatch", "skipped_nonfinite", "reward_errors",
    # where the step's time went (timing.py); `<kind>_wait_s_p50/_p95` only where calls happened
    "step_s", "gen_compute_s", "gen_idle_s", "gen_idle_admission_s", "gen_idle_reward_s", "gen_idle_tool_s",
    "gen_idle_env_s", "gen_idle_other_s", "learner_s", "learner_wait_s",
)
# Summary keys `where_the_time_went` shows (in a fleet, per-call ones are prefixed "<adapter>.").
TIME_KEY = re.compile(r"(^|\.)(training_s|gen_compute_s|gen_idle(_[a-z]+)?_s|learner_(compute|wait|other)_s"
                      r"|(reward|tool|env)_wait_(s_p50|s_p95|calls))$")


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


# ---------------------------------------------------------------- the summary


def summary_table(summary: dict[str, Any]) -> Table:
    """The summary's figures, one per row (those `where_the_time_went` shows are left to it)."""
    table = Table(title="lora-async run summary", show_header=False)
    for key, value in summary.items():
        if key == "mode_decisions":
            table.add_row(key, decisions_line(value))
        elif key.endswith("league") and isinstance(value, dict):
            table.add_row(key, league_line(value))
        elif not TIME_KEY.search(key):
            table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    return table


def decisions_line(decisions: list[dict[str, Any]]) -> str:
    """A run's mode decisions in one line: "measured at step 1: async k2, confirmed at step 2: ..."."""
    return ", ".join(f"{d.get('mode_kind')} at step {d.get('mode_decided_at_step', 0)}: {d.get('mode')}"
                     + (f" k{d.get('mode_staleness')}" if d.get("mode") == "async" else "") for d in decisions) or "-"


def where_the_time_went(summary: dict[str, Any]) -> str | None:
    """The summary's time split as a short block: seconds and share of the training time for the
    generator (compute, idle by cause) and the learner (compute, waiting for data, the rest),
    then each kind of call's p50/p95. None for a summary without it (training never began)."""
    training = summary.get("training_s")
    if not training:
        return None

    def line(label: str, seconds: float) -> str:
        return f"  {label:<26}{seconds:>9.1f} s {100 * seconds / training:>5.1f}%"

    lines = [f"where the time went ({training:.1f} s of training)",
             line("generator compute", summary["gen_compute_s"]), line("generator idle", summary["gen_idle_s"])]
    lines += [line(f"  {cause}", summary[f"gen_idle_{cause}_s"]) for cause in IDLE_CAUSES]
    lines += [line("learner compute", summary["learner_compute_s"]),
              line("learner waiting for data", summary["learner_wait_s"]),
              line("learner other", summary["learner_other_s"])]
    for key, calls in summary.items():
        found = re.fullmatch(r"(.*?)(reward|tool|env)_wait_calls", key)
        if found is not None:
            who, kind = found.groups()
            p50, p95 = summary[f"{who}{kind}_wait_s_p50"], summary[f"{who}{kind}_wait_s_p95"]
            lines.append(f"  {who}{kind} calls: {calls}, wait p50 {duration(p50)}, p95 {duration(p95)}")
    return "\n".join(lines)


def duration(seconds: float) -> str:
    """A call's duration as people read it: 12.5 ms, 3.2 s."""
    return f"{1000 * seconds:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


# ---------------------------------------------------------------- the writer


class MetricsWriter:
    """One JSONL line per step (and per eval/canary), the trackers, and the console view."""

    def __init__(self, out_dir: Path, adapters: list[str], run: "RunConfig", console: Console,
                 trackers: "Trackers | None" = None) -> None:
        self.path = out_dir / "metrics.jsonl"
        self.console = console
        self.limits = run
        self._file = open(self.path, "a", buffering=1)
        self.trackers = trackers
        self._adapters = list(adapters)
        self._accuracy: dict[str, tuple[float, int]] = {}  # per adapter: the newest eval (accuracy, its step)
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
        if self.trackers is not None:
            self.trackers.step(row)
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
        evaluated = self._accuracy.get(row["adapter"])
        # the held-out figure is as old as its eval: say which step it is from
        accuracy = f"  accuracy {evaluated[0]:.2f} (step {evaluated[1]})" if evaluated is not None else ""
        _, _, limit = self._nearer_limit(row["step"], row["wall_s"])
        parts = [f"{key.removeprefix('reward/')} {value:.2f}" for key, value in row.items()
                 if key.startswith("reward/") and isinstance(value, (int, float))]
        by_function = f" ({', '.join(parts)})" if len(parts) > 1 else ""  # several functions: each one's mean
        return (f"{who}step {row['step']} ({limit}) v{row.get('version')}  "
                f"reward {row.get('reward_mean') or 0:.3f}{by_function}" + accuracy
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
            self._accuracy[row["adapter"]] = (row["accuracy"], int(row.get("step") or 0))
        if self.trackers is not None:
            self.trackers.event(row)

    def stage(self, what: str, total: int) -> Stage:
        """A wait inside the run (an eval): a row of the training bar while it is live."""
        found = Stage(what, total, self.console)
        if self._progress is None:
            return found
        return found.attach(self._progress, lambda done, _total: {"limit": f"{done:g}/{total} problems", "reward": "-",
                                                                   "tps": "-", "lag": "-"})

    def set_completed(self, adapter: str, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._tasks[adapter], completed=step, limit=f"{step}/{self.limits.max_steps} steps")

    def close(self) -> None:
        """The file and the display; the trackers stay open for the summary (`finish_trackers`)."""
        if self._progress is not None:
            self._progress.stop()
        self._file.close()

    def finish_trackers(self, summary: dict[str, Any] | None, step: int, failed: bool) -> None:
        """The summary to each tracker (None: the run ended without one), then close them."""
        if self.trackers is None:
            return
        if summary is not None:
            self.trackers.summary(summary, step)
        self.trackers.close(failed)
        self.trackers = None
