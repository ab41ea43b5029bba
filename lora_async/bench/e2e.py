"""`lora-async bench e2e`: the training modes side by side on the same config and budget.

Modes (`MODES`; `--modes` picks some):
- `sync`: `buffer.mode = "sync"` (both halves take turns on every core);
- `async`: pinned async at the config's `max_staleness` (at least 1), no partial rollouts;
- `async-partial`: the same, with partial rollouts (a generation a learner step stops is
  continued on the newest version);
- `auto`: `buffer.mode = "auto"` with partial rollouts: it measures its first steps and chooses.

Every run is the real CLI in a subprocess (one vLLM engine per process), one after the other,
for each seed. Evaluation is off the clock: each run saves its adapter every `save_every` steps
(and at the start), stamped with the training clock, and all of them are scored afterwards on
one engine (`snapshots.py`). `target` is the held-out accuracy (success rate) whose first
crossing is timed.

Per mode the report gives each seed's figures and their medians: time to the target, trained
tokens/s up to the target (after it a run's groups go flat and its tokens/s stops meaning
anything; over the whole budget as `trained_tokens_per_s_all`), the generator's and the
learner's idle shares, and where the time went
(`proc.time_split`); `split_table` sets the modes side by side (also in `OUT/time_split.md`).

A run already finished in `--out` with the same config is kept (not run again), and one already
scored is not scored again, so seeds can be added by running the same command with more of
them. A kept run was timed when it ran: for modes timed side by side, use a fresh `--out`.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

from ..config import TrainConfig
from .common import finished
from ..metrics import decisions_line
from .proc import SPLIT_SHARES, last_error, run_logged, summarize_run

# name -> (buffer.mode, partial_rollouts)
MODES: dict[str, tuple[str, bool]] = {
    "sync": ("sync", False),
    "async": ("async", False),
    "async-partial": ("async", True),
    "auto": ("auto", True),
}
# The per-seed figures whose medians the report gives.
MEDIANS = ("time_to_target_s", "trained_tokens_per_s", "gen_tokens_per_s", "trained_tokens_per_s_all", "steps",
           "gen_idle_frac",
           "learner_idle_share", "accuracy_end", "accuracy_max", "policy_lag_mean", "resumed_turns",
           *SPLIT_SHARES)


def mode_config(config: TrainConfig, mode: str, seed: int, budget: float, save_every: int, run_dir: Path) -> TrainConfig:
    """The config of one run: the mode, the seed, the budget, snapshots for scoring, no evals."""
    buffer_mode, partial = MODES[mode]
    cfg = config.model_copy(deep=True)
    cfg.buffer.max_staleness = max(1, config.buffer.max_staleness)
    cfg.buffer.mode = buffer_mode  # type: ignore[assignment]
    cfg.buffer.partial_rollouts = partial
    cfg.run.seed = seed
    cfg.run.time_budget_s = budget
    cfg.run.max_steps = 100_000
    cfg.run.output_dir = str(run_dir)
    cfg.run.save_every = save_every
    cfg.run.eval_every = 0
    cfg.run.eval_at_start = False
    cfg.run.eval_at_end = False
    cfg.run.progress = False
    cfg.run.chart_every = 0
    if cfg.local_engine is not None:  # an engine here: async splits the cores, sync shares
        cfg.local_engine.cpus = "auto"
    cfg.learner.cpus = "auto"
    return cfg


def run_e2e_bench(config: TrainConfig, budget: float, out: Path, modes: list[str], seeds: list[int],
                  save_every: int = 1, config_path: Path | None = None, target: float = 0.5,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    report: dict[str, Any] = {"config": str(config_path) if config_path else None, "budget_s": budget,
                              "target": target, "modes": modes, "seeds": seeds, "save_every": save_every}
    runs: dict[str, list[Path]] = {mode: [] for mode in modes}
    for seed in seeds:
        for mode in modes:
            run_dir = out / f"{mode}-s{seed}"
            cfg = mode_config(config, mode, seed, budget, save_every, run_dir)
            runs[mode].append(run_dir)
            if finished(cfg):
                log(f"[{run_dir.name}] kept: finished earlier with this config")
                continue
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
            config_file = out / f"{mode}-s{seed}.json"
            config_file.write_text(json.dumps(cfg.model_dump(mode="json")))
            run_log = out / f"{mode}-s{seed}.log"
            log(f"[{run_dir.name}] training for {budget:g}s ({run_log})")
            done = run_logged([sys.executable, "-m", "lora_async.bench.run_json", str(config_file)], run_log)
            if done.returncode != 0:
                raise RuntimeError(f"{run_dir.name} run failed (see {run_log}): {last_error(run_log)}")
    todo = [d for dirs in runs.values() for d in dirs if not (d / "eval.json").is_file()]
    if todo:
        score(config, modes[0], seeds[0], budget, save_every, out, todo, log)
    for mode, dirs in runs.items():
        per_seed = [run_figures(d, budget, target) for d in dirs]
        report[mode] = {"buffer_mode": MODES[mode][0], "partial_rollouts": MODES[mode][1], "seeds": per_seed,
                        **medians(per_seed)}
    report["ratios"] = ratios(report, modes)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "time_split.md").write_text(split_table(report) + "\n")
    return report


def score(config: TrainConfig, mode: str, seed: int, budget: float, save_every: int, out: Path,
          run_dirs: list[Path], log: Callable[[str], None]) -> None:
    """Score the runs' snapshots off the clock, on one engine in a process of its own."""
    score_log = out / "scoring.log"
    log(f"scoring {len(run_dirs)} runs' snapshots off the clock ({score_log})")
    # Scoring measures accuracy, not time: a simulated tool latency would only slow it down.
    scoring = mode_config(config, mode, seed, budget, save_every, out)
    if scoring.task.type == "env" and scoring.adapters is None:
        scoring.task.tool_latency = None
    scoring_config = out / "scoring.json"
    scoring_config.write_text(json.dumps(scoring.model_dump(mode="json")))
    done = run_logged([sys.executable, "-m", "lora_async.bench.snapshots", "--config", str(scoring_config),
                       *map(str, run_dirs)], score_log)
    if done.returncode != 0:
        raise RuntimeError(f"scoring failed (see {score_log}): {last_error(score_log)}")


def run_figures(run_dir: Path, budget: float, target: float) -> dict[str, Any]:
    """One run's summary (`proc.summarize_run`) plus its mode choice and the learner's idle share."""
    figures = summarize_run(run_dir, budget, target)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    figures["mode"] = summary.get("mode")
    figures["mode_reason"] = summary.get("mode_reason")
    figures["mode_staleness"] = summary.get("mode_staleness")
    decisions = summary.get("mode_decisions") or []
    figures["mode_decisions"] = decisions_line(decisions)
    figures["steps_in_left_modes"] = steps_in_left_modes(decisions)
    wait = figures.get("learner_wait_share")
    figures["learner_idle_share"] = wait
    figures["run_dir"] = str(run_dir)
    return figures


def steps_in_left_modes(decisions: list[dict[str, Any]]) -> int | None:
    """What deciding cost an auto run: the most steps it spent in a mode that its deciding then
    left (the sync steps it measured before choosing async, an async step whose confirmation went
    back to sync, sync steps that measured again). A mode left because its steps drifted from the
    prediction (`re-measure`) was the right one until then and does not count. None for a pinned
    run."""
    if not decisions or decisions[0].get("mode_kind") == "pinned":
        return None
    spans, mode, since = [], ("sync", 0), 0
    for d in decisions:
        new = (d["mode"], d["mode_staleness"])
        if new != mode:
            if d["mode_kind"] != "re-measure":
                spans.append(d["mode_decided_at_step"] - since)
            mode, since = new, d["mode_decided_at_step"]
    return max(spans, default=0)


def medians(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each of `MEDIANS` over the seeds; a time to target counts only if every seed
    reached it (else None, with `reached` saying how many did)."""
    out: dict[str, Any] = {}
    for key in MEDIANS:
        values = [s.get(key) for s in per_seed]
        present = [v for v in values if v is not None]
        if key == "time_to_target_s":
            out["reached"] = f"{len(present)}/{len(values)}"
            out[key] = statistics.median(present) if present and len(present) == len(values) else None
        else:
            out[key] = statistics.median(present) if present else None
    return out


def ratios(report: dict[str, Any], modes: list[str]) -> dict[str, float | None]:
    """Head-to-head ratios of the medians: each mode's speed-up over sync (time to target, > 1 is
    sooner) and its trained tokens/s over sync's; auto against the better of the others."""
    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    out: dict[str, float | None] = {}
    sync = report.get("sync")
    for mode in modes:
        if mode == "sync" or sync is None:
            continue
        figures = report[mode]
        out[f"{mode}_sooner_than_sync"] = ratio(sync["time_to_target_s"], figures["time_to_target_s"])
        out[f"{mode}_tokens_per_s_over_sync"] = ratio(figures["trained_tokens_per_s"], sync["trained_tokens_per_s"])
    if "async" in modes and "async-partial" in modes:
        out["partial_tokens_per_s_over_async"] = ratio(report["async-partial"]["trained_tokens_per_s"],
                                                       report["async"]["trained_tokens_per_s"])
    if "auto" in modes:
        others = [report[m]["time_to_target_s"] for m in modes if m != "auto" and report[m]["time_to_target_s"]]
        auto = report["auto"]["time_to_target_s"]
        out["auto_time_over_best"] = auto / min(others) if auto and others else None
    return out


def split_table(report: dict[str, Any]) -> str:
    """Where each mode's time went (medians over seeds), one column per mode, shares of its
    training time in %."""
    modes = [mode for mode in report.get("modes", []) if isinstance(report.get(mode), dict)]
    lines = ["| time share | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for key in SPLIT_SHARES:
        label = (key.removesuffix("_share").replace("gen_idle_", "idle: ").replace("gen_", "generator ")
                 .replace("_", " "))
        cells = [report[mode].get(key) for mode in modes]
        lines.append(f"| {label} | " + " | ".join("-" if c is None else f"{100 * c:.1f}%" for c in cells) + " |")
    return "\n".join(lines)


def headline_table(report: dict[str, Any]) -> str:
    """The per-mode figures the issue asks for, medians over seeds."""
    modes = [mode for mode in report.get("modes", []) if isinstance(report.get(mode), dict)]
    rows = [("time to target (s)", "time_to_target_s", "{:.0f}"), ("reached", "reached", "{}"),
            ("steps", "steps", "{:.0f}"), ("trained tokens/s, up to the target", "trained_tokens_per_s", "{:.1f}"),
            ("generator idle", "gen_idle_frac", "{:.0%}"), ("learner idle (waiting for data)", "learner_idle_share",
                                                            "{:.0%}"),
            ("held-out accuracy, end", "accuracy_end", "{:.2f}"), ("mean policy lag", "policy_lag_mean", "{:.2f}"),
            ("resumed generations", "resumed_turns", "{:.0f}")]
    lines = ["| median over seeds | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for label, key, fmt in rows:
        cells = [report[m].get(key) for m in modes]
        lines.append(f"| {label} | " + " | ".join("-" if c is None else fmt.format(c) for c in cells) + " |")
    return "\n".join(lines)
