"""The report of `lora-async bench staleness` (`staleness.py` trains and scores the arms): per
arm, the steps and training time to the target, its peak, whether it collapsed (an eval more
than `COLLAPSE_DROP` below its own best so far, within twice its steps to the target) and its
figures by lag; per (loss, k), the medians over seeds, the steps over k = 0's (of the medians,
and seed by seed); the markdown tables and the chart."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Hashable, Protocol, Sequence

from ..lag_figures import BUCKET_NAMES
from ..metrics import read_metrics


class Arm(Hashable, Protocol):
    """What the report reads of one run (`staleness.Arm`): its loss, lag, seed and name."""

    @property
    def loss(self) -> str: ...
    @property
    def lag(self) -> int: ...
    @property
    def seed(self) -> int: ...
    @property
    def name(self) -> str: ...

COLLAPSE_DROP = 0.2  # an eval this far below the arm's best so far is a collapse


def arm_figures(run_dir: Path, target: float) -> dict[str, Any]:
    """One arm's curve and figures from its metrics (steps, and the snapshots' eval rows)."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    steps = sorted((r for r in rows if "kind" not in r), key=lambda r: r["step"])
    evals = sorted((r for r in rows if r.get("kind") == "eval"), key=lambda r: r["step"])
    curve = [(int(e["step"]), float(e["accuracy"])) for e in evals]
    reached = next(((s, e) for (s, _), e in zip(curve, evals) if e["accuracy"] >= target), None)
    steps_to_target = reached[0] if reached else None
    time_to_target = reached[1]["wall_s"] if reached else None
    until = [r for r in steps if steps_to_target is None or r["step"] <= steps_to_target]
    clock = until[-1]["wall_s"] if until else 0.0
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "run_dir": str(run_dir), "steps": len(steps), "curve": curve,
        "accuracy_start": curve[0][1] if curve else None, "accuracy_end": curve[-1][1] if curve else None,
        "accuracy_max": max((a for _, a in curve), default=None), "heldout_n": evals[-1].get("n") if evals else None,
        "steps_to_target": steps_to_target, "time_to_target_s": time_to_target,
        "collapsed": collapsed(curve, steps_to_target),
        # throughput up to the target (or the end): after it, flat groups make tokens/s meaningless
        "trained_tokens_per_s": sum(r.get("tokens_trained", 0) for r in until) / clock if clock else None,
        "step_s_mean": clock / len(until) if until else None,
        "policy_lag_mean": statistics.fmean(r["policy_lag_mean"] for r in steps) if steps else None,
        "clip_frac_mean": statistics.fmean(r["clip_frac"] for r in steps) if steps else None,
        "ess_frac_mean": mean_of(steps, "ess_frac"),
        "lr_scale_mean": mean_of(steps, "lr_scale"),
        "by_lag": {key: value for key, value in summary.items() if key.split("/")[0] in BUCKET_NAMES},
    }


def collapsed(curve: list[tuple[int, float]], steps_to_target: int | None) -> bool:
    """An eval more than COLLAPSE_DROP below the best so far, within twice the steps to the
    target (the whole curve when the target was never reached)."""
    horizon = 2 * steps_to_target if steps_to_target is not None else None
    best = float("-inf")
    for step, accuracy in curve:
        if horizon is not None and step > horizon:
            break
        best = max(best, accuracy)
        if accuracy < best - COLLAPSE_DROP:
            return True
    return False


def mean_of(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def spread(values: list[float | None]) -> dict[str, Any]:
    """Median, min and max over seeds; a seed that never reached the target counts as infinitely
    late (the median is None when half or more did not)."""
    reached = sorted(v for v in values if v is not None)
    missing = len(values) - len(reached)
    ordered: list[float] = reached + [float("inf")] * missing
    median = statistics.median(ordered) if ordered else None
    return {"median": None if median is None or median == float("inf") else median,
            "min": reached[0] if reached else None, "max": reached[-1] if reached and not missing else None,
            "reached": f"{len(reached)}/{len(values)}"}


def report(arms: Sequence[Arm], run_dirs: list[Path], target: float) -> dict[str, Any]:
    figures = {arm: arm_figures(d, target) for arm, d in zip(arms, run_dirs)}
    losses = list(dict.fromkeys(a.loss for a in arms))
    lags = sorted({a.lag for a in arms})
    seeds = sorted({a.seed for a in arms})
    table: dict[str, dict[str, Any]] = {}
    for loss in losses:
        per_lag: dict[str, Any] = {}
        for lag in lags:
            mine = [figures[a] for a in arms if a.loss == loss and a.lag == lag]
            per_lag[str(lag)] = {
                "seeds": len(mine),
                "steps_to_target": spread([f["steps_to_target"] for f in mine]),
                "time_to_target_s": spread([f["time_to_target_s"] for f in mine]),
                "accuracy_max": statistics.median(f["accuracy_max"] for f in mine if f["accuracy_max"] is not None)
                if any(f["accuracy_max"] is not None for f in mine) else None,
                "collapsed": sum(f["collapsed"] for f in mine),
                "trained_tokens_per_s": median_of(mine, "trained_tokens_per_s"),
                "clip_frac_mean": median_of(mine, "clip_frac_mean"),
                "ess_frac_mean": median_of(mine, "ess_frac_mean"),
                "by_lag": {key: statistics.median(f["by_lag"][key] for f in mine if key in f["by_lag"])
                           for key in sorted({k for f in mine for k in f["by_lag"]})},
            }
        base = per_lag[str(lags[0])]["steps_to_target"]["median"]
        steps = {(a.lag, a.seed): figures[a]["steps_to_target"] for a in arms if a.loss == loss}
        for lag in lags:
            median = per_lag[str(lag)]["steps_to_target"]["median"]
            per_lag[str(lag)]["steps_over_k0"] = median / base if median is not None and base else None
            per_lag[str(lag)]["paired_over_k0"] = paired_ratios(steps, lag, lags[0], seeds)
        table[loss] = per_lag
    return {"target": target, "losses": losses, "lags": lags, "seeds": seeds, "table": table,
            "arms": {arm.name: figures[arm] for arm in arms}}


def paired_ratios(steps: dict[tuple[int, int], int | None], lag: int, base: int, seeds: list[int]) -> dict[str, Any]:
    """Steps to target at `lag` over those at `base` seed by seed (paired seeds draw the same
    first batch, so the ratio cancels what the seed alone decides), as a `spread`. A seed whose
    base arm never reached the target has no ratio; one whose lagged arm never did is infinitely
    late."""
    ratios = []
    for seed in seeds:
        at_base, at_lag = steps.get((base, seed)), steps.get((lag, seed))
        if at_base:
            ratios.append(None if at_lag is None else at_lag / at_base)
    return spread(ratios)


def median_of(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def markdown(result: dict[str, Any]) -> str:
    """The table for bench/RESULTS.md: a row per loss, a column group per k."""
    lags = result["lags"]

    def cell(value: float | None, fmt: str) -> str:
        return "-" if value is None else fmt.format(value)

    head = "| loss | " + " | ".join(f"k={k}: steps to {result['target']:g}" for k in lags) + " | " + \
        " | ".join(f"k={k}/k={lags[0]}" for k in lags[1:]) + " | clip/mask % (k=" + ",".join(map(str, lags)) + \
        ") | collapsed |"
    lines = [head, "|---" * (1 + len(lags) + len(lags) - 1 + 2) + "|"]
    for loss in result["losses"]:
        row = result["table"][loss]
        steps = []
        for k in lags:
            s = row[str(k)]["steps_to_target"]
            med = cell(s["median"], "{:g}")
            steps.append(f"{med} ({cell(s['min'], '{:g}')}-{cell(s['max'], '{:g}')}, {s['reached']})")
        ratios = [cell(row[str(k)]["steps_over_k0"], "{:.2f}x") + paired_cell(row[str(k)]["paired_over_k0"])
                  for k in lags[1:]]
        clips = ",".join(cell(row[str(k)]["clip_frac_mean"] and 100 * row[str(k)]["clip_frac_mean"], "{:.1f}")
                         for k in lags)
        falls = sum(row[str(k)]["collapsed"] for k in lags)
        lines.append(f"| {loss} | " + " | ".join(steps) + " | " + " | ".join(ratios) + f" | {clips} | {falls} |")
    return "\n".join(lines)


def paired_cell(paired: dict[str, Any]) -> str:
    """`; paired 1.09 (0.88-1.38)`: the seed-by-seed ratios' median and range (none for 1 seed)."""
    if paired["median"] is None or paired["reached"].split("/")[1] == "1":
        return ""
    high = "inf" if paired["max"] is None else f"{paired['max']:.2f}"
    return f"; paired {paired['median']:.2f} ({paired['min']:.2f}-{high})"


def diagnostics_markdown(result: dict[str, Any]) -> str:
    """The figures by lag (`lag_figures.py`) of each loss at each k: medians over seeds of each
    arm's average over its steps, for the bucket of its own lag (k = 3 or more: `lag3+`)."""
    lines = ["| loss | k | tokens clipped or masked | mean (log ratio)^2 | ESS fraction | mean A+ | mean A- |",
             "|---|---|---|---|---|---|---|"]
    for loss in result["losses"]:
        for k in result["lags"]:
            figures = result["table"][loss][str(k)]["by_lag"]
            bucket = BUCKET_NAMES[min(k, len(BUCKET_NAMES) - 1)]

            def get(key: str, fmt: str) -> str:
                value = figures.get(f"{bucket}/{key}")
                return "-" if value is None else fmt.format(value)

            lines.append(f"| {loss} | {k} | {get('clip_frac', '{:.2%}')} | {get('log_ratio_sq', '{:.4f}')} | "
                         f"{get('ess_frac', '{:.3f}')} | {get('adv_pos', '{:.2f}')} | {get('adv_neg', '{:.2f}')} |")
    return "\n".join(lines)


def chart(result: dict[str, Any], out: Path) -> Path:
    """Held-out accuracy against step: one panel per loss, one line per k (the median over seeds,
    each seed faint behind it)."""
    import math
    import os

    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses, lags = result["losses"], result["lags"]
    columns = min(len(losses), 3)
    rows = math.ceil(len(losses) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.4 * rows), squeeze=False, sharey=True)
    palette = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    arms = result["arms"]
    for ax, loss in zip(axes.flat, losses):
        for i, lag in enumerate(lags):
            curves = [f["curve"] for name, f in arms.items() if name.startswith(f"{loss.replace('+', '-')}-k{lag}-s")]
            by_step: dict[int, list[float]] = {}
            for curve in curves:
                xs, ys = zip(*curve) if curve else ((), ())
                ax.plot(xs, ys, color=palette[i % len(palette)], alpha=0.25, linewidth=0.8)
                for step, accuracy in curve:
                    by_step.setdefault(step, []).append(accuracy)
            steps = sorted(by_step)
            ax.plot(steps, [statistics.median(by_step[s]) for s in steps], color=palette[i % len(palette)],
                    label=f"k = {lag}", linewidth=1.8)
        ax.axhline(result["target"], color="grey", linestyle=":", linewidth=1)
        ax.set_title(loss)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(losses):]:
        ax.set_visible(False)
    axes[0][0].set_ylabel("held-out accuracy (greedy)")
    axes[0][0].legend(fontsize="small")
    fig.suptitle(f"held-out accuracy by step at a fixed lag k (median of seeds {result['seeds']}, faint: each seed)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
