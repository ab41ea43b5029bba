"""`lora-async plot`: runs side by side against wall-clock (reward, held-out accuracy, policy lag,
sync time; for environments reward, held-out success, tool-call rate and turns), one labelled
line per run (and per adapter in a fleet). Below them, the share of tokens the loss clipped or
masked, one line style per lag bucket (`lag_figures.py`); for games against past versions, the
league's Elo rating and the held-out win rate against each opponent; then, for each run whose step
rows say where the time went, a stacked panel: the generator's compute and idle time by cause, as shares of
each step's interval. Headless matplotlib."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from .lag_figures import BUCKET_NAMES
from .metrics import read_metrics
from .timing import IDLE_CAUSES

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


# The panel by lag (runs whose step rows have `lag*/clip_frac`, lag_figures.py): the share of each
# bucket's tokens the loss clipped or masked; a run's colour, a line style per bucket.
LAG_STYLES = ("-", "--", "-.", ":")
LAG_PANEL_HEIGHT = 2.6  # inches

# The league row (games against past versions, `league.py`): the adapter's Elo rating from the
# league's games, and the held-out win rate against each held-out opponent (a line style each).
WIN_KEY = re.compile(r"^vs_(.+)/win$")
LEAGUE_PANEL_HEIGHT = 2.6  # inches

# The stacked time panel, bottom to top: compute, then idle by cause (the row's keys, a label).
TIME_PARTS = (("gen_compute_s", "compute"), *((f"gen_idle_{c}_s", f"idle: {c}") for c in IDLE_CAUSES))
TIME_COLOURS = ("#2a9d8f", "#e76f51", "#f4a261", "#e9c46a", "#8ab17d", "#b0b0b0")
TIME_PANEL_HEIGHT = 2.6  # inches per row of time panels (two panels a row)


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


def time_shares(rows: list[dict[str, Any]]) -> tuple[list[float], dict[str, list[float]]]:
    """A series' step rows that say where the time went: their wall-clock, and each part's share
    of its step's interval (per step, the shares sum to 1). Empty for older runs."""
    split = sorted((r for r in rows if "kind" not in r and r.get("step_s") and r.get("gen_compute_s") is not None),
                   key=lambda r: r["wall_s"])
    return ([r["wall_s"] for r in split],
            {key: [(r.get(key) or 0.0) / r["step_s"] for r in split] for key, _ in TIME_PARTS})


def lag_series(rows: list[dict[str, Any]]) -> dict[str, tuple[list[float], list[float]]]:
    """Per lag bucket that trained tokens: (wall-clock, clip fraction) of each step that had some."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    for name in BUCKET_NAMES:
        points = sorted((r["wall_s"], r[f"{name}/clip_frac"]) for r in rows
                        if "kind" not in r and r.get(f"{name}/clip_frac") is not None)
        if points:
            xs, ys = zip(*points)
            out[name] = (list(xs), list(ys))
    return out


def draw_lag_panel(ax: Any, series: dict[str, list[dict[str, Any]]], colours: dict[str, str]) -> None:
    for name, rows in series.items():
        for bucket, (xs, ys) in lag_series(rows).items():
            ax.plot(xs, ys, linestyle=LAG_STYLES[BUCKET_NAMES.index(bucket)], color=colours.get(name),
                    label=f"{bucket}" if len(series) == 1 else f"{name} {bucket}")
    ax.set_title("tokens clipped or masked by the loss, by lag (line style: lag 0, 1, 2, 3+)")
    ax.set_xlabel("wall-clock (s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small", ncol=4, frameon=False)


def draw_league_panels(elo: Any, wins: Any, series: dict[str, list[dict[str, Any]]], colours: dict[str, str]) -> None:
    """The league's Elo per step row, and each held-out opponent's win rate per eval (a run's colour)."""
    for name, rows in series.items():
        points = [(r["wall_s"], r["league_elo"]) for r in rows if "kind" not in r and "league_elo" in r]
        if points:
            xs, ys = zip(*points)
            elo.plot(xs, ys, color=colours.get(name))
        evals = [r for r in rows if r.get("kind") == "eval"]
        opponents = sorted({m.group(1) for r in evals for key in r if (m := WIN_KEY.match(key))})
        for opponent, style in zip(opponents, LAG_STYLES * len(opponents)):
            found = [(r["wall_s"], r[f"vs_{opponent}/win"]) for r in evals if f"vs_{opponent}/win" in r]
            xs, ys = zip(*found)
            wins.plot(xs, ys, color=colours.get(name), linestyle=style, marker="o", markersize=3,
                      label=f"vs {opponent}" if name == next(iter(series)) else None)
    elo.set_title("league Elo (the adapter, from its games against kept versions)")
    wins.set_title("held-out win rate (greedy), by opponent")
    wins.legend(fontsize="small", frameon=False)
    for ax in (elo, wins):
        ax.grid(alpha=0.3)
        ax.set_xlabel("wall-clock (s)")


def draw_time_panel(ax: Any, name: str, xs: list[float], shares: dict[str, list[float]]) -> None:
    """One series' stacked panel; each step's shares fill the interval before its row (step="pre")."""
    ax.stackplot(xs, *shares.values(), labels=[label for _, label in TIME_PARTS], colors=TIME_COLOURS, step="pre")
    ax.set_ylim(0, 1)
    ax.set_title(f"generator time: {name} (share of each step)")
    ax.grid(alpha=0.3)


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
    timed = {name: split for name, rows in series.items() if (split := time_shares(rows))[0]}
    time_rows = math.ceil(len(timed) / 2)
    by_lag = {name: rows for name, rows in series.items() if lag_series(rows)}
    lag_rows = 1 if by_lag else 0
    league = {name: rows for name, rows in series.items() if any("league_elo" in r for r in rows)}
    league_rows = 1 if league else 0
    fig = plt.figure(figsize=(11, 7 + LEAGUE_PANEL_HEIGHT * league_rows + LAG_PANEL_HEIGHT * lag_rows
                              + TIME_PANEL_HEIGHT * time_rows))
    grid = fig.add_gridspec(2 + league_rows + lag_rows + time_rows, 2)
    first = fig.add_subplot(grid[0, 0])
    axes = [[first, fig.add_subplot(grid[0, 1], sharex=first)],
            [fig.add_subplot(grid[1, 0], sharex=first), fig.add_subplot(grid[1, 1], sharex=first)]]
    flat = [ax for row in axes for ax in row]
    colours: dict[str, Any] = {}  # each series' colour, as the first panel drew it
    for ax, (key, label) in zip(flat, ENV_PANELS if episodic else PANELS):
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
                color = ax.plot(xs, ys, marker="o", markersize=3, color=color, linestyle=":" if steps else "-",
                                label=None if steps else legend)[0].get_color()
            colours.setdefault(name, color)
        ax.set_title(label)
        ax.grid(alpha=0.3)
    if league:
        draw_league_panels(fig.add_subplot(grid[2, 0], sharex=first), fig.add_subplot(grid[2, 1], sharex=first),
                           league, colours)
    if by_lag:
        draw_lag_panel(fig.add_subplot(grid[2 + league_rows, :], sharex=first), by_lag, colours)
    for i, (name, (clock, parts)) in enumerate(timed.items()):
        row = 2 + league_rows + lag_rows + i // 2
        where = grid[row, :] if len(timed) == 1 else grid[row, i % 2]
        ax = fig.add_subplot(where, sharex=first)
        draw_time_panel(ax, name, clock, parts)
        ax.set_xlabel("wall-clock (s)")
    for ax in axes[1]:
        ax.set_xlabel("wall-clock (s)")
    handles, labels = flat[0].get_legend_handles_labels()
    if not handles:
        handles, labels = flat[1].get_legend_handles_labels()
    columns = min(len(labels), 4)
    fig.legend(handles, labels, loc="lower center", ncol=columns, frameon=False)
    band = 0.42 * max(1, math.ceil(len(labels) / max(columns, 1)))  # inches at the bottom for the legends
    if timed:  # the causes' legend, above the runs' (the same colours in every time panel)
        causes, names = fig.axes[-1].get_legend_handles_labels()
        fig.legend(causes, names, loc="lower center", ncol=len(names), frameon=False, fontsize="small",
                   bbox_to_anchor=(0.5, band / fig.get_figheight()))
        band += 0.38
    fig.suptitle(title or "lora-async runs")
    height = fig.get_figheight()
    fig.tight_layout(rect=(0, band / height, 1, 1 - 0.28 / height))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, out)  # a live viewer never sees half a PNG
    return out
