"""The peer benchmark's report: per-system medians and spread over seeds, the head-to-head
ratios, and the chart (`lora-async plot`, one colour per system, one line per seed).

A run that never reached an accuracy mark within its budget counts as "not reached" (infinitely
late) in the median, so a system whose median did not reach it shows None, never a flattering
figure from its lucky seeds.
"""

from __future__ import annotations

import math
import statistics
import subprocess
from pathlib import Path
from typing import Any, Sequence

# Figures summarised per system over its seeds (median, min, max, each seed's value).
FIGURES = ("time_to_acc_0.5_s", "time_to_acc_0.7_s", "time_to_acc_0.8_s", "launch_to_acc_0.8_s", "accuracy_start", "accuracy_end",
           "accuracy_max", "steps", "wall_s", "startup_s", "time_to_first_step_s", "gen_s", "learner_s", "sync_s",
           "sync_ms_p50", "eval_s", "gen_idle_frac", "gen_tokens_per_s", "tokens_generated", "policy_lag_mean",
           "aborted_stale_groups", "zero_adv_groups", "peak_rss_mb")
# Figures where a missing value means "not reached within the budget" (ranked after every value).
LATE_IF_MISSING = ("time_to_acc_0.5_s", "time_to_acc_0.7_s", "time_to_acc_0.8_s", "launch_to_acc_0.8_s")
# (numerator, denominator) systems of the head-to-head ratios (time to 0.8: > 1 means the first is slower).
HEAD_TO_HEAD = (("trl", "auto"), ("sync", "auto"), ("async", "auto"),
               ("trl", "async"), ("sync", "async"), ("trl", "sync"),
               ("trl", "async-nofilter"), ("sync-nofilter", "async-nofilter"), ("trl", "sync-nofilter"),
               ("async", "async-nofilter"), ("sync", "sync-nofilter"))


def seed_median(values: Sequence[float | None], late_if_missing: bool) -> float | None:
    """The median over seeds; a missing value is +inf where it means "not reached" (a median that
    lands on it is None), else it is left out."""
    if late_if_missing:
        ranked = sorted(math.inf if v is None else v for v in values)
    else:
        ranked = sorted(v for v in values if v is not None)
    if not ranked:
        return None
    value = statistics.median(ranked)
    return None if math.isinf(value) else round(value, 4)


def summarise(entries: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per system (variant): its seeds, and per figure the median, min, max and the seeds' values."""
    systems: dict[str, list[dict[str, Any]]] = {}
    for entry in entries.values():
        if "error" not in entry:
            systems.setdefault(entry["system"], []).append(entry)
    out: dict[str, dict[str, Any]] = {}
    for system, runs in systems.items():
        runs.sort(key=lambda e: e["seed"])
        figures: dict[str, Any] = {"seeds": [e["seed"] for e in runs]}
        for key in FIGURES:
            values = [e.get(key) for e in runs]
            present = [v for v in values if isinstance(v, (int, float))]
            late = key in LATE_IF_MISSING
            figures[key] = {"median": seed_median(values, late), "min": min(present) if present else None,
                            "max": max(present) if present else None, "values": values,
                            **({"not_reached": sum(v is None for v in values)} if late else {})}
        out[system] = figures
    return out


def head_to_head(systems: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Median time to 0.8 of one system over another's (> 1: the first is slower), for the pairs
    of HEAD_TO_HEAD that both ran; also time to 0.7 and 0.5 and launch to 0.8."""
    out: dict[str, float | None] = {}
    for a, b in HEAD_TO_HEAD:
        if a in systems and b in systems:
            for key in ("time_to_acc_0.8_s", "time_to_acc_0.7_s", "time_to_acc_0.5_s", "launch_to_acc_0.8_s"):
                x, y = systems[a][key]["median"], systems[b][key]["median"]
                out[f"{a}/{b} {key}"] = round(x / y, 3) if x is not None and y else None
    return out


def draw(cmd: list[str], run_dirs: list[Path], chart: Path, title: str, cwd: Path) -> str | None:
    """`lora-async plot --group-seeds` of the runs into `chart`; an error message or None."""
    if not run_dirs:
        return None
    done = subprocess.run(cmd + ["plot", *map(str, run_dirs), "-o", str(chart), "--title", title, "--group-seeds"],
                          capture_output=True, text=True, cwd=cwd)
    if done.returncode != 0:
        return f"plot failed: {(done.stderr or done.stdout).strip()[-500:]}"
    return None


def table(systems: dict[str, dict[str, Any]]) -> str:
    """A markdown table of the medians (min-max) per system, for bench/RESULTS.md."""
    def cell(fig: dict[str, Any], digits: int = 1) -> str:
        med = fig["median"]
        if med is None and "not_reached" not in fig:
            return "-"
        values = fig["values"]
        if med is None:  # the median run did not get there: say which runs did
            reached = [f"{v:.{digits}f}" for v in values if v is not None]
            return f"not reached ({len(reached)} of {len(values)} did: {', '.join(reached)})" if reached else \
                f"not reached (0 of {len(values)})"
        text = f"{med:.{digits}f}"
        if fig["min"] is not None and fig["max"] is not None and len(values) > 1:
            text += f" ({fig['min']:.{digits}f}-{fig['max']:.{digits}f})"
        if fig.get("not_reached"):
            text += f", {fig['not_reached']} of {len(values)} not reached"
        return text

    rows = [("seeds", lambda f: ",".join(map(str, f["seeds"]))),
            ("time to 0.5 (s, training clock)", lambda f: cell(f["time_to_acc_0.5_s"])),
            ("time to 0.7 (s, training clock)", lambda f: cell(f["time_to_acc_0.7_s"])),
            ("time to 0.8 (s, training clock)", lambda f: cell(f["time_to_acc_0.8_s"])),
            ("launch to 0.8 (s)", lambda f: cell(f["launch_to_acc_0.8_s"])),
            ("accuracy at the end", lambda f: cell(f["accuracy_end"], 2)),
            ("steps", lambda f: cell(f["steps"], 0)),
            ("startup (s)", lambda f: cell(f["startup_s"])),
            ("launch to first step (s)", lambda f: cell(f["time_to_first_step_s"])),
            ("generation busy (s)", lambda f: cell(f["gen_s"])),
            ("learner (s)", lambda f: cell(f["learner_s"])),
            ("adapter sync (s)", lambda f: cell(f["sync_s"], 2)),
            ("eval, after the run (s)", lambda f: cell(f["eval_s"])),
            ("generator idle", lambda f: cell(f["gen_idle_frac"], 3)),
            ("generated tokens/s", lambda f: cell(f["gen_tokens_per_s"], 0))]
    names = list(systems)
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for label, fn in rows:
        lines.append(f"| {label} | " + " | ".join(fn(systems[n]) for n in names) + " |")
    return "\n".join(lines)
