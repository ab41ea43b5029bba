"""`lora-async bench fleet`: a K-adapter fleet vs K separate single-adapter runs.

Same model, tasks and learner steps per adapter. The separate runs go one after another (as a
team would train them today); each run is the real trainer in its own process. Peak memory is
the peak RSS of each run's process tree (`proc.TreeMonitor`).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from ..config import TrainConfig
from .proc import TreeMonitor, last_error, run_logged

# K arithmetic skills on the embedded model (each its own adapter).
SKILLS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("add", ("+",)),
    ("sub", ("-",)),
    ("mul", ("*",)),
    ("addsub", ("+", "-")),
)


def _run(config: dict, work: Path, label: str) -> dict[str, Any]:
    """One training run in its own process: its wall-clock and the peak RSS of its process tree."""
    path = work / f"{label}.json"
    path.write_text(json.dumps(config))
    log = work / f"{label}.log"
    with TreeMonitor() as monitor:
        done = run_logged([sys.executable, "-m", "lora_async.bench.run_json", str(path)], log, monitor)
    if done.returncode != 0:
        raise RuntimeError(f"{label} failed (see {log}): {last_error(log)}")
    return {"wall_s": done.wall_s, "peak_rss_bytes": monitor.peak_bytes}


def run_fleet_bench(base: TrainConfig, k: int, steps: int, out: Path) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    skills = SKILLS[:k]
    common = base.model_dump(mode="json")
    for section in ("adapter", "adapters", "task"):
        common.pop(section, None)
    common["run"].update(max_steps=steps, time_budget_s=None, eval_at_start=False, eval_at_end=False,
                         eval_every=0, checkpoint_every=0, progress=False, canary_every=0)
    system = "Answer with only the final number."

    def task(ops: tuple[str, ...]) -> dict:
        return {"type": "arithmetic", "ops": list(ops), "system_prompt": system}

    fleet = json.loads(json.dumps(common))
    fleet["adapters"] = [{"name": name, "task": task(ops)} for name, ops in skills]
    fleet["run"]["output_dir"] = str(out / "fleet")
    report: dict[str, Any] = {"k": k, "steps_per_adapter": steps, "fleet": _run(fleet, out, "fleet")}
    separate = []
    for name, ops in skills:
        single = json.loads(json.dumps(common))
        single["adapter"] = {"name": name}
        single["task"] = task(ops)
        single["run"]["output_dir"] = str(out / f"single-{name}")
        separate.append({"adapter": name, **_run(single, out, f"single-{name}")})
    report["separate"] = separate
    total_wall = sum(r["wall_s"] for r in separate)
    total_peak = sum(r["peak_rss_bytes"] for r in separate)
    report["wall_ratio"] = report["fleet"]["wall_s"] / total_wall
    report["peak_memory_ratio"] = report["fleet"]["peak_rss_bytes"] / total_peak
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report
