"""`lora-async plot`: runs side by side against wall-clock (reward, held-out accuracy, policy lag,
sync time; for environments reward, held-out success, tool-call rate and turns), one labelled
line per run (and per adapter in a fleet). Headless matplotlib."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from .metrics import read_metrics

PANELS = (
    ("reward_mean", "reward (policy)"),
    ("accuracy", "held-out accuracy (greedy)"),
    ("policy_lag_mean", "policy lag (versions)"),
    ("sync_ms", "adapter sync (ms)"),
)
# Environment runs (their step rows count episodes). A key in both step and eval rows is drawn
# for both: the training rollouts as a line, the held-out episodes as dots.
ENV_PANELS = (
    ("reward_mean", "reward (policy)"),
    ("accuracy", "held-out success (greedy episodes)"),
    ("tool_call_rate", "episodes calling a tool (line: rollouts, dots: held-out)"),
    ("turns_mean", "turns per episode (line: rollouts, dots: held-out)"),
)


class PlotError(ValueError):
    """A run directory that cannot be plotted (missing, empty)."""


def load_run(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Rows of a run grouped by series label: `<run>` or `<run>/<adapter>` for fleets."""
    path = Path(run_dir) / "metrics.jsonl"
    if not Path(run_dir).is_dir():
        raise PlotError(f"{run_dir}: no such run directory")
    if not path.is_file():
        raise PlotError(f"{run_dir}: no metrics.jsonl (not a lora-async run, or it has not logged a step)")
    rows = read_metrics(path)
    if not any("kind" not in r or r.get("kind") == "eval" for r in rows):
        raise PlotError(f"{run_dir}: metrics.jsonl has no steps yet")
    adapters = sorted({r.get("adapter", "main") for r in rows})
    name = Path(run_dir).name
    return {name if len(adapters) == 1 else f"{name}/{a}": [r for r in rows if r.get("adapter", "main") == a]
            for a in adapters}


SEED_SUFFIX = re.compile(r"-s\d+$")  # `--group-seeds`: runs named NAME-s0, NAME-s1 ... are one system


def legend_styles(names: list[str], group_seeds: bool) -> dict[str, tuple[str | None, int | None]]:
    """Per series: (legend label or None, colour index or None for matplotlib's next). With
    `group_seeds`, NAME-s0, NAME-s1 ... share NAME's colour and its one legend entry."""
    if not group_seeds:
        return {name: (name, None) for name in names}
    systems = list(dict.fromkeys(SEED_SUFFIX.sub("", name) for name in names))
    styles: dict[str, tuple[str | None, int | None]] = {}
    labelled: set[str] = set()
    for name in names:
        system = SEED_SUFFIX.sub("", name)
        styles[name] = (None if system in labelled else system, systems.index(system))
        labelled.add(system)
    return styles


def plot_runs(run_dirs: list[Path], out: Path, title: str | None = None, group_seeds: bool = False) -> Path:
    """One line per run; with `group_seeds`, runs named NAME-sK share NAME's colour and legend entry."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[dict[str, Any]]] = {}
    for run_dir in run_dirs:
        for label, rows in load_run(run_dir).items():
            series[label if label not in series else f"{label} ({run_dir})"] = rows
    palette = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = legend_styles(list(series), group_seeds)
    episodic = any("episodes" in r for rows in series.values() for r in rows if "kind" not in r)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for ax, (key, label) in zip(axes.flat, ENV_PANELS if episodic else PANELS):
        for name, rows in series.items():
            steps = [(r["wall_s"], r[key]) for r in rows if "kind" not in r and r.get(key) is not None]
            evals = [(r["wall_s"], r[key]) for r in rows if r.get("kind") == "eval" and r.get(key) is not None]
            legend, colour = styles[name]
            color = None if colour is None else palette[colour % len(palette)]
            if steps:
                xs, ys = zip(*sorted(steps))
                color = ax.plot(xs, ys, label=legend, color=color, alpha=0.8 if group_seeds else 1.0)[0].get_color()
            if evals:
                xs, ys = zip(*sorted(evals))
                ax.plot(xs, ys, marker="o", markersize=3, color=color, linestyle=":" if steps else "-",
                        label=None if steps else legend)
        ax.set_title(label)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("wall-clock (s)")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if not handles:
        handles, labels = axes.flat[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), frameon=False)
    fig.suptitle(title or "lora-async runs")
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, out)  # a live viewer never sees half a PNG
    return out
