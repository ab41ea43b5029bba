"""Summarise the runs of `bench/qlora_runs.sh`: held-out accuracy by step, the learner/generator
gap (on-policy logprob mismatch and canary, medians over the run), clip fraction, step time.

    .venv/bin/python bench/qlora_table.py runs/qlora-v2 [--json]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def yes(flag: bool) -> str:
    return "yes" if flag else "no"


def summarise(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    # An eval row's `version` is the adapter it scored (version k: after step k); its `step` is
    # where training had got to when the eval finished.
    evals = {r["version"]: r["accuracy"] for r in rows if r.get("kind") == "eval"}
    steps = [r for r in rows if "kind" not in r and "step" in r]
    canary = [r["canary_mismatch"] for r in rows if r.get("kind") == "canary"]
    onpolicy = [r["logprob_mismatch_onpolicy"] for r in steps if r.get("logprob_mismatch_onpolicy") is not None]
    late = [evals[s] for s in range(8, 13) if s in evals]
    later = [evals[s] for s in range(9, 13) if s in evals]
    return {
        "run": run.name, "acc_start": evals.get(0), "acc_by_step": [evals.get(s) for s in range(1, 13)],
        "acc_step5": evals.get(5), "acc_min_8_12": min(late) if late else None,
        "acc_mean_8_12": statistics.fmean(late) if late else None, "acc_step12": evals.get(12),
        "held_0.9_8_12": len(late) == 5 and min(late) >= 0.9,
        "held_0.9_9_12": len(later) == 4 and min(later) >= 0.9,
        "mismatch_onpolicy_median": statistics.median(onpolicy) if onpolicy else None,
        "canary_median": statistics.median(canary) if canary else None,
        "clip_frac_median": statistics.median(r["clip_frac"] for r in steps) if steps else None,
        "ratio_max": max(r["ratio_max"] for r in steps) if steps else None,
        "step_s_median": statistics.median(r["step_s"] for r in steps) if steps else None,
        "steps": len(steps),
    }


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/qlora-v2")
    runs = sorted(p for p in root.iterdir() if (p / "metrics.jsonl").is_file())
    table = [summarise(run) for run in runs]
    if "--json" in sys.argv:
        print(json.dumps(table, indent=1))
        return
    print("| run | acc. start | step 5 | steps 8-12 (min / mean) | step 12 | >= 0.9 from step 8 / 9 to 12 "
          "| on-policy mismatch "
          "(nats/token, median) | canary median | clip frac | ratio max | step s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        def f(x: float | None, p: str = ".2f") -> str:
            return "-" if x is None else format(x, p)
        late = f"{f(r['acc_min_8_12'])} / {f(r['acc_mean_8_12'])}"
        print(f"| {r['run']} | {f(r['acc_start'])} | {f(r['acc_step5'])} | {late} | "
              f"{f(r['acc_step12'])} | {yes(r['held_0.9_8_12'])} / {yes(r['held_0.9_9_12'])} | "
              f"{f(r['mismatch_onpolicy_median'], '.2g')} | {f(r['canary_median'], '.2g')} | "
              f"{f(r['clip_frac_median'], '.3f')} | {f(r['ratio_max'], '.1f')} | {f(r['step_s_median'], '.1f')} |")
        print(f"|  | by step: {' '.join(f(a) for a in r['acc_by_step'])} |||||||||")


if __name__ == "__main__":
    main()
