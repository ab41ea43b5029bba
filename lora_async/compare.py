"""`lora-async compare RUN_DIR...`: runs side by side, as one table and one chart.

A run is a directory with `metrics.jsonl` (a `train` run, or one of a bench's runs); a directory
without one stands for the runs directly under it (a bench's output). Each adapter of a run is
one column: the config settings that differ between the runs, the held-out accuracy (final and
best, from the run's eval rows, or the bench's scored snapshots), steps, the training-clock time
and step at which each accuracy target was first reached, tokens/s, and where the time went
(from `summary.json`). `plot_compare` draws every held-out curve against step and against
training-clock time.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from .errors import UserError
from .metrics import read_metrics

TARGETS = (0.5, 0.7, 0.8)  # held-out accuracy marks the table times
SKIP_KEYS = ("run.output_dir",)  # differ by construction
SHARES = (("gen_compute_s", "generator busy"), ("gen_idle_s", "generator idle"),
          ("learner_compute_s", "learner busy"), ("learner_wait_s", "learner waiting for data"))


class CompareError(UserError):
    """Nothing to compare (one line, exit code 2)."""


@dataclass
class Column:
    """One adapter of one run: its figures and held-out curve."""

    label: str
    run_dir: Path
    config: dict[str, str]
    steps: int = 0
    wall_s: float = 0.0
    tokens_generated: int = 0
    tokens_trained: int = 0
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # (step, wall_s, accuracy)
    shares: dict[str, float] = field(default_factory=dict)

    @property
    def final(self) -> float | None:
        return self.curve[-1][2] if self.curve else None

    @property
    def best(self) -> tuple[float, int] | None:
        if not self.curve:
            return None
        step, _, accuracy = max(self.curve, key=lambda point: (point[2], -point[0]))
        return accuracy, step

    def reached(self, target: float) -> tuple[float, int] | None:
        """(training-clock s, step) of the first eval at or above `target`."""
        return next(((wall, step) for step, wall, accuracy in self.curve if accuracy >= target), None)


def find_runs(paths: list[Path]) -> list[Path]:
    runs = []
    for path in paths:
        if (path / "metrics.jsonl").is_file():
            runs.append(path)
            continue
        inside = sorted(p for p in path.iterdir() if (p / "metrics.jsonl").is_file()) if path.is_dir() else []
        if not inside:
            raise CompareError(f"compare: {path} is not a run directory (no metrics.jsonl in it or directly under it)")
        runs += inside
    return runs


def flat(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
    return out


def labels(runs: list[Path]) -> list[str]:
    """The shortest trailing parts of the paths that tell the runs apart."""
    for depth in range(1, 6):
        names = ["/".join(run.resolve().parts[-depth:]) for run in runs]
        if len(set(names)) == len(names):
            return names
    return [str(run) for run in runs]


def read_run(run_dir: Path, label: str) -> list[Column]:
    config_file = run_dir / "config.json"
    config = flat(json.loads(config_file.read_text())) if config_file.is_file() else {}
    summary_file = run_dir / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    rows = read_metrics(run_dir / "metrics.jsonl")
    adapters = list(dict.fromkeys(r.get("adapter", "main") for r in rows if "kind" not in r and "step" in r))
    training = summary.get("training_s") or 0.0
    shares = {name: summary[key] / training for key, name in SHARES if training and summary.get(key) is not None}
    columns = []
    for adapter in adapters or ["main"]:
        steps = [r for r in rows if "kind" not in r and "step" in r and r.get("adapter", "main") == adapter]
        evals = sorted((r for r in rows if r.get("kind") == "eval" and r.get("adapter", "main") == adapter
                        and r.get("accuracy") is not None), key=lambda r: (r.get("wall_s") or 0, r.get("step") or 0))
        column = Column(f"{label}/{adapter}" if len(adapters) > 1 else label, run_dir, config, shares=shares)
        if steps:
            column.steps = max(int(r["step"]) for r in steps)
            column.wall_s = max(float(r.get("wall_s") or 0) for r in steps)
            column.tokens_generated = max(int(r.get("tokens_generated_total") or 0) for r in steps)
            column.tokens_trained = sum(int(r.get("tokens_trained") or 0) for r in steps)
        # an accuracy is timed when its weights were trained (the step's row), not when it was
        # scored: a run's end eval comes after its training clock stops
        trained_at = {int(r["step"]): float(r.get("wall_s") or 0) for r in steps}
        column.curve = [(step, trained_at.get(step, float(r.get("wall_s") or 0)), float(r["accuracy"]))
                        for r in evals for step in [int(r.get("step") or 0)]]
        columns.append(column)
    return columns


def read_runs(paths: list[Path]) -> list[Column]:
    runs = find_runs(paths)
    return [column for run, label in zip(runs, labels(runs)) for column in read_run(run, label)]


def differing(columns: list[Column]) -> list[str]:
    keys = sorted({k for c in columns for k in c.config} - set(SKIP_KEYS))
    return [k for k in keys if len({c.config.get(k) for c in columns}) > 1]


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:.{digits}f}"


def figures(column: Column, targets: tuple[float, ...]) -> dict[str, Any]:
    """The column's figures as plain values (`--json`)."""
    best = column.best
    return {"run": column.label, "run_dir": str(column.run_dir), "steps": column.steps, "wall_s": column.wall_s,
            "accuracy_final": column.final, "accuracy_best": best[0] if best else None,
            "accuracy_best_step": best[1] if best else None,
            **{f"time_to_{t}_s": (column.reached(t) or (None, None))[0] for t in targets},
            **{f"step_to_{t}": (column.reached(t) or (None, None))[1] for t in targets},
            "tokens_generated_per_s": column.tokens_generated / column.wall_s if column.wall_s else None,
            "tokens_trained_per_s": column.tokens_trained / column.wall_s if column.wall_s else None,
            **{f"share_{name.replace(' ', '_')}": share for name, share in column.shares.items()}}


def compare_table(columns: list[Column], targets: tuple[float, ...] = TARGETS) -> Table:
    table = Table(title="lora-async compare")
    table.add_column("", no_wrap=True)
    for column in columns:
        table.add_column(column.label, overflow="fold")
    for key in differing(columns):
        table.add_row(key, *[column.config.get(key, "-") for column in columns])
    if differing(columns):
        table.add_section()
    rows: list[tuple[str, list[str]]] = [
        ("steps", [str(c.steps) for c in columns]),
        ("training clock (s)", [_num(c.wall_s, 1) for c in columns]),
        ("held-out accuracy, final", [_num(c.final) for c in columns]),
        ("held-out accuracy, best (step)",
         [f"{b[0]:.2f} ({b[1]})" if (b := c.best) is not None else "-" for c in columns]),
    ]
    for target in targets:
        rows.append((f"to {target:g}: s (step)",
                     [f"{r[0]:.1f} ({r[1]})" if (r := c.reached(target)) is not None else "not reached"
                      if c.curve else "-" for c in columns]))
    rows += [("tokens generated / s", [_num(c.tokens_generated / c.wall_s if c.wall_s else None, 1) for c in columns]),
             ("tokens trained / s", [_num(c.tokens_trained / c.wall_s if c.wall_s else None, 1) for c in columns])]
    for _, name in SHARES:
        rows.append((f"{name} (share)", [_num(c.shares.get(name)) for c in columns]))
    for name, cells in rows:
        table.add_row(name, *cells)
    return table


def plot_compare(columns: list[Column], out: Path, title: str | None = None) -> Path:
    """Every column's held-out accuracy against step (left) and training-clock time (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = [c for c in columns if c.curve]
    if not drawn:
        raise CompareError("compare --plot: no run has held-out evals (run.eval_every, or a bench's scored snapshots)")
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for column in drawn:
        steps, walls, accuracy = zip(*column.curve)
        line, = by_step.plot(steps, accuracy, marker=".", label=column.label)
        by_time.plot(walls, accuracy, marker=".", color=line.get_color())
    by_step.set(xlabel="step", ylabel="held-out accuracy (greedy)", ylim=(-0.02, 1.02))
    by_time.set(xlabel="training clock (s)")
    for axes in (by_step, by_time):
        axes.grid(alpha=0.3)
    by_step.legend(fontsize="small")
    fig.suptitle(title or "held-out accuracy")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
