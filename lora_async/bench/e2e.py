"""`lora-async bench e2e`: asynchronous vs synchronous training on the same config and budget.

Both runs are the real CLI in a subprocess (one vLLM engine per process), one after the other:
`max_staleness` as configured (async; at least 1) and `max_staleness = 0` (sync). Placement is
`auto` for both: async splits the cores between generator and learner, sync gives both all
cores (they take turns). Held-out accuracy is evaluated every `eval_every` steps.
"""

from __future__ import annotations

import json
import statistics
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..config import TrainConfig
from ..metrics import read_metrics

TARGET_ACCURACY = 0.5


def summarize(run_dir: Path, budget: float) -> dict[str, Any]:
    rows = read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in rows if "kind" not in r]
    evals = [r for r in rows if r.get("kind") == "eval"]
    reached = next((e["wall_s"] for e in evals if e["accuracy"] >= TARGET_ACCURACY), None)
    wall = steps[-1]["wall_s"] if steps else 0.0
    step_time = [b["wall_s"] - a["wall_s"] for a, b in zip([{"wall_s": 0.0}] + steps, steps)]
    weighted_idle = sum(t * r["gen_idle_frac"] for t, r in zip(step_time, steps))
    sync_s = sum(r["sync_ms"] for r in steps) / 1000
    synced = [r["sync_ms"] for r in steps if r["updated"] and not r.get("sync_error")]
    wait_s = sum(r.get("sync_wait_ms", 0.0) for r in steps) / 1000
    return {
        "steps": len(steps),
        "wall_s": wall,
        "time_to_acc_0.5_s": reached,
        "accuracy_start": evals[0]["accuracy"] if evals else None,
        "accuracy_end": evals[-1]["accuracy"] if evals else None,
        "accuracy_curve": [(round(e["wall_s"], 1), e["accuracy"]) for e in evals],
        "tokens_generated": steps[-1]["tokens_generated_total"] if steps else 0,
        "gen_tokens_per_s": (steps[-1]["tokens_generated_total"] / wall) if steps and wall else 0.0,
        "gen_idle_frac": weighted_idle / wall if wall else None,
        "sync_share": sync_s / wall if wall else None,
        "sync_wait_share": wait_s / wall if wall else None,  # in the background: nobody waits
        "sync_ms_p50": statistics.median(synced) if synced else None,
        "dropped_stale": steps[-1]["dropped_stale"] if steps else 0,
        "policy_lag_mean": sum(r["policy_lag_mean"] for r in steps) / len(steps) if steps else None,
        "budget_s": budget,
    }


def run_e2e_bench(config: TrainConfig, budget: float, out: Path, eval_every: int = 2,
                  config_path: Path | None = None) -> dict[str, Any]:
    staleness = max(1, config.buffer.max_staleness)
    report: dict[str, Any] = {"config": str(config_path) if config_path else None, "budget_s": budget}
    for mode, s in (("async", staleness), ("sync", 0)):
        run_dir = out / mode
        shutil.rmtree(run_dir, ignore_errors=True)
        cfg = config.model_copy(deep=True)
        cfg.buffer.max_staleness = s
        cfg.run.time_budget_s = budget
        cfg.run.max_steps = 100_000
        cfg.run.output_dir = str(run_dir)
        cfg.run.eval_every = eval_every
        cfg.run.eval_at_start = True
        cfg.run.eval_at_end = True
        cfg.run.progress = False
        cfg.generator.cpus = "auto"
        cfg.learner.cpus = "auto"
        run_dir.mkdir(parents=True, exist_ok=True)
        config_file = run_dir.parent / f"{mode}.json"
        config_file.write_text(json.dumps(cfg.model_dump(mode="json")))
        cmd = [sys.executable, "-m", "lora_async.bench.run_json", str(config_file)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        (run_dir.parent / f"{mode}.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            raise RuntimeError(f"{mode} run failed (see {run_dir.parent / f'{mode}.log'}): "
                               f"{done.stderr.strip().splitlines()[-1:]}")
        report[mode] = {"max_staleness": s, **summarize(run_dir, budget)}
    a, b = report["async"], report["sync"]
    if a["time_to_acc_0.5_s"] and b["time_to_acc_0.5_s"]:
        report["sync_over_async_time_to_0.5"] = b["time_to_acc_0.5_s"] / a["time_to_acc_0.5_s"]
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report
