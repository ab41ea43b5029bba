"""`lora-async bench e2e`: asynchronous vs synchronous training on the same config and budget.

Both runs are the real CLI in a subprocess (one vLLM engine per process), one after the other:
`max_staleness` as configured (async; at least 1) and `max_staleness = 0` (sync). Placement is
`auto` for both: async splits the cores between generator and learner, sync gives both all
cores (they take turns). Held-out accuracy is evaluated every `eval_every` steps.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from ..config import TrainConfig
from .proc import last_error, run_logged, summarize_run


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
        if cfg.generator.engine_home != "server":  # an engine of ours: async splits the cores, sync shares
            cfg.generator.cpus = "auto"
        cfg.learner.cpus = "auto"
        run_dir.mkdir(parents=True, exist_ok=True)
        config_file = run_dir.parent / f"{mode}.json"
        config_file.write_text(json.dumps(cfg.model_dump(mode="json")))
        log = run_dir.parent / f"{mode}.log"
        done = run_logged([sys.executable, "-m", "lora_async.bench.run_json", str(config_file)], log)
        if done.returncode != 0:
            raise RuntimeError(f"{mode} run failed (see {log}): {last_error(log)}")
        report[mode] = {"max_staleness": s, **summarize_run(run_dir, budget)}
    a, b = report["async"], report["sync"]
    if a["time_to_acc_0.5_s"] and b["time_to_acc_0.5_s"]:
        report["sync_over_async_time_to_0.5"] = b["time_to_acc_0.5_s"] / a["time_to_acc_0.5_s"]
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report
