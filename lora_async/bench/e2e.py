"""`lora-async bench e2e`: asynchronous vs synchronous training on the same config and budget.

Every run is the real CLI in a subprocess (one vLLM engine per process), one after the other:
`max_staleness` as configured (async; at least 1) and `max_staleness = 0` (sync); on an
environment task also async without partial rollouts (a turn made too stale is aborted and its
group dropped). Placement is `auto` for all: async splits the cores between generator and
learner, sync gives both all cores (they take turns). Held-out accuracy (success rate) is
evaluated every `eval_every` steps; `target` is the one timed.

Each mode's report says where its time went (`proc.time_split`: the generator's compute and
idle shares by cause, the learner's compute and wait for data); `split_table` sets them side by
side (also written to `OUT/time_split.md`).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from ..config import TrainConfig
from .proc import SPLIT_SHARES, last_error, run_logged, summarize_run


def bench_modes(config: TrainConfig) -> list[tuple[str, int, bool]]:
    """(name, max_staleness, partial_rollouts) of each run."""
    staleness = max(1, config.buffer.max_staleness)
    if config.task.type == "env" and config.adapters is None:
        return [("async-partial", staleness, True), ("async", staleness, False), ("sync", 0, False)]
    return [("async", staleness, config.buffer.partial_rollouts), ("sync", 0, False)]


def run_e2e_bench(config: TrainConfig, budget: float, out: Path, eval_every: int = 2,
                  config_path: Path | None = None, target: float = 0.5) -> dict[str, Any]:
    report: dict[str, Any] = {"config": str(config_path) if config_path else None, "budget_s": budget,
                              "target": target}
    modes = bench_modes(config)
    for mode, s, partial in modes:
        run_dir = out / mode
        shutil.rmtree(run_dir, ignore_errors=True)
        cfg = config.model_copy(deep=True)
        cfg.buffer.max_staleness = s
        cfg.buffer.partial_rollouts = partial
        cfg.run.time_budget_s = budget
        cfg.run.max_steps = 100_000
        cfg.run.output_dir = str(run_dir)
        cfg.run.eval_every = eval_every
        cfg.run.eval_at_start = True
        cfg.run.eval_at_end = True
        cfg.run.progress = False
        if cfg.local_engine is not None:  # an engine here: async splits the cores, sync shares
            cfg.local_engine.cpus = "auto"
        cfg.learner.cpus = "auto"
        run_dir.mkdir(parents=True, exist_ok=True)
        config_file = run_dir.parent / f"{mode}.json"
        config_file.write_text(json.dumps(cfg.model_dump(mode="json")))
        log = run_dir.parent / f"{mode}.log"
        done = run_logged([sys.executable, "-m", "lora_async.bench.run_json", str(config_file)], log)
        if done.returncode != 0:
            raise RuntimeError(f"{mode} run failed (see {log}): {last_error(log)}")
        report[mode] = {"max_staleness": s, "partial_rollouts": partial, **summarize_run(run_dir, budget, target)}
    sync = report["sync"]
    for mode, *_ in modes[:-1]:
        a = report[mode]
        if a["time_to_acc_0.5_s"] and sync["time_to_acc_0.5_s"]:
            report[f"sync_over_{mode}_time_to_0.5"] = sync["time_to_acc_0.5_s"] / a["time_to_acc_0.5_s"]
        if a["time_to_target_s"] and sync["time_to_target_s"]:
            report[f"sync_over_{mode}_time_to_target"] = sync["time_to_target_s"] / a["time_to_target_s"]
        if sync["trained_tokens_per_s"]:
            report[f"{mode}_over_sync_trained_tokens_per_s"] = a["trained_tokens_per_s"] / sync["trained_tokens_per_s"]
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "time_split.md").write_text(split_table(report) + "\n")
    return report


def split_table(report: dict[str, Any]) -> str:
    """Where each mode's time went, one column per mode (shares of its training time, in %)."""
    modes = [mode for mode, figures in report.items() if isinstance(figures, dict) and "gen_compute_share" in figures]
    lines = ["| time share | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for key in SPLIT_SHARES:
        label = (key.removesuffix("_share").replace("gen_idle_", "idle: ").replace("gen_", "generator ")
                 .replace("_", " "))
        cells = [report[mode][key] for mode in modes]
        lines.append(f"| {label} | " + " | ".join("-" if c is None else f"{100 * c:.1f}%" for c in cells) + " |")
    return "\n".join(lines)
