"""Does self-play against past versions teach the embedded model Nim? (bench/RESULTS.md section 24)

    python bench/nim_selfplay.py [--seeds 0,1,2] [--budget 900] [--out runs/nim-selfplay]

Trains `examples/nim.toml` (the embedded SmolLM2-135M against a league of its own past versions)
once per seed, one run after another on this machine's cores, each for `--budget` seconds of
training. Every run evaluates at the start, every 10 steps and at the end: greedy held-out games
against its step-0 version (`vs_self_v0/win`, the config's accuracy) and each scripted player.
Then, per seed: the start and end win rates against the step-0 version and against the random
player, and the steps; across seeds: the medians with their range. Runs already finished in
`--out` are read, not trained again.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FIGURES = ("vs_self_v0/win", "vs_random/win", "vs_expert/win", "vs_optimal/win")


def train(seed: int, budget: float, out: Path) -> None:
    if (out / "summary.json").is_file():
        return
    subprocess.run([sys.executable, "-m", "lora_async", "train", str(REPO / "examples" / "nim.toml"),
                    "--set", f"run.seed={seed}", "--set", f"run.time_budget_s={budget}",
                    "--set", f"run.output_dir={out}", "--set", "run.progress=false"], check=True, cwd=REPO)


def figures(out: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if r.get("kind") == "eval"]
    steps = [r for r in rows if "kind" not in r]
    start, end = evals[0], evals[-1]
    return {"steps": steps[-1]["step"] if steps else 0, "training_s": steps[-1]["wall_s"] if steps else 0.0,
            "league_elo": steps[-1].get("league_elo"),
            **{f"start {k}": start.get(k) for k in FIGURES}, **{f"end {k}": end.get(k) for k in FIGURES},
            "curve": [(r["step"], r.get("vs_self_v0/win"), r.get("vs_random/win")) for r in evals]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--budget", type=float, default=900.0, help="seconds of training per run")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "nim-selfplay")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    per_seed = {}
    for seed in seeds:
        out = args.out / f"s{seed}"
        train(seed, args.budget, out)
        per_seed[seed] = figures(out)
        print(json.dumps({"seed": seed, **per_seed[seed]}), flush=True)
    keys = [k for k in per_seed[seeds[0]] if k != "curve" and per_seed[seeds[0]][k] is not None]
    medians = {k: {"median": statistics.median(v[k] for v in per_seed.values()),
                   "min": min(v[k] for v in per_seed.values()), "max": max(v[k] for v in per_seed.values())}
               for k in keys}
    result = {"seeds": per_seed, "medians": medians}
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(medians, indent=2))


if __name__ == "__main__":
    main()
