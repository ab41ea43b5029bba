"""Run metrics: `OUT/metrics.jsonl` (one line per learner step), TensorBoard, rich progress.

The JSONL file is the source of truth; on resume it is cut back to the checkpointed step, so
lines are appended, never duplicated.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

STEP_KEYS = (
    "step", "adapter", "version", "wall_s", "reward_mean", "reward_std", "samples",
    "tokens_generated", "tokens_trained", "policy_lag_mean", "policy_lag_max", "dropped_stale",
    "ratio_mean", "ratio_max", "clip_frac", "loss", "grad_norm", "sync_ms", "gen_idle_frac",
    "learner_idle_frac", "logprob_mismatch", "skipped_nonfinite", "reward_errors",
)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


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


class MetricsWriter:
    """One progress row per adapter; one JSONL line per step (and per eval/canary)."""

    def __init__(self, out_dir: Path, adapters: list[str], total_steps: int, show_progress: bool,
                 console: Console) -> None:
        self.path = out_dir / "metrics.jsonl"
        self.console = console
        self._file = open(self.path, "a", buffering=1)
        self._tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(out_dir / "tb"))
        except Exception as exc:  # tensorboard missing: keep the JSONL, say so once
            console.print(f"[yellow]TensorBoard disabled: {exc}[/]")
        self._progress: Progress | None = None
        self._tasks: dict[str, Any] = {}
        self._adapters = list(adapters)
        if show_progress:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("reward {task.fields[reward]}"), TextColumn("{task.fields[tps]} tok/s"),
                TextColumn("lag {task.fields[lag]}"), TimeElapsedColumn(), console=console,
                transient=False,
            )
            self._progress.start()
            for name in adapters:
                self._tasks[name] = self._progress.add_task(name, total=total_steps, reward="-", tps="-", lag="-")
        self._started = time.perf_counter()

    def step(self, row: dict[str, Any]) -> None:
        row = {k: _clean(v) for k, v in row.items()}
        self._file.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    tag = f"{row.get('adapter', 'main')}/{key}"
                    self._tb.add_scalar(tag, value, int(row["step"]))
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        tps = row.get("tokens_generated_total", 0) / elapsed
        if self._progress is not None:
            self._progress.update(
                self._tasks[row["adapter"]], completed=row["step"],
                reward=f"{row.get('reward_mean') or 0:.2f}", tps=f"{tps:.0f}",
                lag=f"{row.get('policy_lag_mean') or 0:.1f}",
            )
        else:
            who = f"{row['adapter']:<12}" if len(self._adapters) > 1 else ""
            self.console.print(
                f"{who}step {row['step']:>4}  v{row.get('version')}  reward {row.get('reward_mean') or 0:.3f}"
                f"  loss {row.get('loss') or 0:+.4f}  lag {row.get('policy_lag_mean') or 0:.1f}"
                f"  sync {row.get('sync_ms') or 0:.1f}ms  {tps:.0f} tok/s",
                highlight=False,
            )

    def event(self, row: dict[str, Any]) -> None:
        """A non-step line (eval, canary): same file, with a `kind` key."""
        row = {k: _clean(v) for k, v in row.items()}
        self._file.write(json.dumps(row) + "\n")
        if self._tb is not None and "step" in row:
            for key, value in row.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    self._tb.add_scalar(f"{row.get('kind', 'event')}/{key}", value, int(row["step"]))

    def set_completed(self, adapter: str, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._tasks[adapter], completed=step)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        self._file.close()


def summary_table(summary: dict[str, Any]) -> Table:
    table = Table(title="lora-async run summary", show_header=False)
    for key, value in summary.items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        table.add_row(key, str(value))
    return table
