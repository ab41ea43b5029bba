"""What a stalled experiment tracker costs a training step (bench/RESULTS.md section 23).

    python bench/tracker_stall.py [--pairs 3] [--steps 10] [--stall 5] [--out runs/tracker-stall]

The same short run (a tiny random Llama built in seconds, a smooth reward, the mode pinned:
sync by default, whose step time is the steadiest; in this process through the Python API) in
pairs: one arm reports to no tracker (`run.report_to = ["none"]`),
the other to TensorBoard with every call of its tracker made to sleep `--stall` seconds first
(a tracker that has stopped answering). The arms alternate within each pair, so the machine's
drift falls on both. Per run: the median `step_s` of its steps after the first two (engine and
learner warm-up); per arm: the median over runs, with its range; and the paired ratio. (A
stalled run's end waits up to `trackers.thread.DRAIN_S` for its tracker, after training.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

REWARD = '''
def vowels(prompt, completion, answer):
    letters = [c for c in completion.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0
'''


def config(model: Path, work: Path, out: Path, steps: int, trackers: list[str], mode: str) -> Any:
    from lora_async import load_config

    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say something about item {i}.", "answer": "-"}) + "\n"
                               for i in range(64)))
    (work / "stall_rewards.py").write_text(REWARD)
    buffer = 'mode = "sync"' if mode == "sync" else 'mode = "async"\nmax_staleness = 2'
    toml = work / "stall.toml"
    toml.write_text(f"""
[model]
name = "{model}"
[generator]
kv_cache_gb = 0.25
max_model_len = 256
[sampling]
max_new_tokens = 32
samples_per_prompt = 4
[buffer]
{buffer}
[learner]
groups_per_step = 2
lr = 2e-3
skip_flat_groups = false
[run]
max_steps = {steps}
output_dir = "{out}"
progress = false
canary_every = 0
chart_every = 0
report_to = {json.dumps(trackers)}
[task]
type = "jsonl"
path = "{prompts}"
reward = "stall_rewards:vowels"
heldout = 4
""")
    return load_config(toml)


def step_call_us(arm: str, row: dict[str, Any], work: Path, calls: int = 2000) -> float:
    """What the training loop pays per step row to hand it to the trackers (`Trackers.step`),
    in microseconds, median of `calls`: with no tracker, or with the stalled one."""
    from lora_async.trackers import RunInfo, Trackers

    out = work / f"calls-{arm}"
    out.mkdir()
    info = RunInfo(out_dir=out, project="stall", name=arm, config={}, adapters=["main"])
    trackers = Trackers(["none"] if arm == "none" else ["tensorboard"], info, False, lambda _: None, drain_s=0.1)
    took = []
    for step in range(1, calls + 1):
        began = time.perf_counter()
        trackers.step({**row, "step": step})
        took.append(time.perf_counter() - began)
    trackers.close(failed=False)  # the stalled one is left behind after 0.1 s
    return round(statistics.median(took) * 1e6, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--stall", type=float, default=5.0)
    parser.add_argument("--mode", choices=["sync", "async"], default="sync",
                        help="sync: each step generates then trains (the steadier step time); async: at staleness 2")
    parser.add_argument("--out", type=Path, default=Path("runs/tracker-stall"))
    args = parser.parse_args()

    import os
    import sys

    from lora_async import train
    from lora_async.models import build_tiny_model, embedded_tokenizer
    from lora_async.trackers import backends

    stall = args.stall

    class StalledBoard(backends.TensorBoardBackend):
        """TensorBoard behind a tracker that takes `stall` seconds to answer every call."""

        def log(self, prefix: str, values: dict[str, float], step: int) -> None:
            time.sleep(stall)
            super().log(prefix, values, step)

    backends.BACKENDS["tensorboard"] = StalledBoard
    work = Path(tempfile.mkdtemp(prefix="tracker-stall-"))
    # the reward module, for this process and the reward's worker processes
    sys.path.insert(0, str(work))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(work), os.environ.get("PYTHONPATH")]))
    model = build_tiny_model(work / "tiny", embedded_tokenizer())
    runs: dict[str, list[dict[str, Any]]] = {"none": [], "stalled": []}
    for pair in range(args.pairs):
        order = ["none", "stalled"] if pair % 2 == 0 else ["stalled", "none"]
        for arm in order:
            out = args.out / f"{arm}-{pair}"
            cfg = config(model, work, out, args.steps, ["none"] if arm == "none" else ["tensorboard"],
                         args.mode)
            began = time.perf_counter()
            summary = train(cfg)
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            steps = [r["step_s"] for r in rows if "kind" not in r][2:]
            runs[arm].append({"run": out.name, "step_s_median": statistics.median(steps), "steps": summary["steps"],
                              "seconds": round(time.perf_counter() - began, 1)})
            print(json.dumps(runs[arm][-1]), flush=True)
    report: dict[str, Any] = {"stall_s": stall, "steps": args.steps, "pairs": args.pairs, "mode": args.mode}
    for arm, done in runs.items():
        medians = [r["step_s_median"] for r in done]
        report[arm] = {"step_s_median": statistics.median(medians), "min": min(medians), "max": max(medians),
                       "runs": done}
    ratios = [s["step_s_median"] / n["step_s_median"] for s, n in zip(runs["stalled"], runs["none"])]
    report["stalled_over_none"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    row = json.loads((args.out / "none-0" / "metrics.jsonl").read_text().splitlines()[-1])
    report["step_call_us"] = {arm: step_call_us(arm, row, work) for arm in ("none", "stalled")}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
