"""`lora-async bench rewards`: scoring throughput of a slow reward, this code beside a baseline.

The reward sleeps like a sandbox or a judge: lognormally, median `median_s`, sigma `sigma`,
the same duration for the same completion on both sides (seeded by its text). `groups` groups
of `n` completions are scored as a run's producers score them: `in_flight` groups at a time,
the next one starting as soon as one is scored. Each side scores them all:

- this code: `rewards.make_rewards` (a pool of guarded workers, the default size, started
  before the clock: a run pays for starting them once), per-sample plain (`def`) and, on this
  side only, the same reward written `async def`;
- the baseline (`--baseline DIR`, a checkout of an older commit, e.g. a `git worktree`): its own
  reward path, each group on a thread as its producers scored them, run in a child process
  with `PYTHONPATH=DIR`.

Figures per side: samples scored per second, each group's reward wait (its first call to its
last score), and that wait over the slowest single call of the group (1.0 = no group waited
longer than its slowest call). Repetitions alternate the sides; medians are reported. The
baseline, serial, takes the sum of every call (minutes), so it repeats `baseline_reps` times.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REWARD_MODULE = '''
import asyncio, math, random, time

MEDIAN_S, SIGMA = {median_s!r}, {sigma!r}

def delay(completion):
    if completion.startswith("warm-up"):
        return 0.2
    return random.Random(completion).lognormvariate(math.log(MEDIAN_S), SIGMA)

def sandbox(completion, answer):
    time.sleep(delay(completion))
    return float(answer in completion)

async def sandbox_async(completion, answer):
    await asyncio.sleep(delay(completion))
    return float(answer in completion)
'''

# Run with PYTHONPATH=<baseline checkout>: its reward path as its producers used it (a group per
# thread, `task.rewards` -> `safe_rewards`); prints one JSON line of per-group waits.
BASELINE_DRIVER = '''
import json, sys, threading, time
from lora_async.tasks import Problem, RewardStats
from lora_async.tasks.rewards import make_reward, safe_rewards
groups = json.loads(sys.argv[1])
stats = RewardStats()
fn = make_reward("bench_reward:sandbox", float(sys.argv[2]), stats)
waits = [0.0] * len(groups)
todo = iter(range(len(groups)))
lock = threading.Lock()
def producer():
    while True:
        with lock:
            i = next(todo, None)
        if i is None:
            return
        began = time.monotonic()
        safe_rewards(fn, stats, Problem(i, "p", "7"), groups[i])
        waits[i] = time.monotonic() - began
began = time.monotonic()
threads = [threading.Thread(target=producer) for _ in range(int(sys.argv[3]))]
for t in threads: t.start()
for t in threads: t.join()
wall = time.monotonic() - began
fn.close()
print(json.dumps({"wall_s": wall, "group_waits": waits, "errors": stats.errors}))
'''


def workload(groups: int, n: int, seed: int = 0) -> list[list[str]]:
    rng = random.Random(seed)
    return [[f"group {g} sample {i}: the answer is {rng.choice(['7', '8'])}" for i in range(n)] for g in range(groups)]


def delays(batch: list[list[str]], median_s: float, sigma: float) -> list[list[float]]:
    """The sleep of each call, as the reward module draws it."""
    return [[random.Random(c).lognormvariate(math.log(median_s), sigma) for c in g] for g in batch]


def figures(wall_s: float, group_waits: list[float], slowest: list[float], errors: int) -> dict[str, Any]:
    ratios = sorted(w / s for w, s in zip(group_waits, slowest))
    return {"wall_s": round(wall_s, 2), "group_wait_p50_s": round(statistics.median(group_waits), 3),
            "group_wait_p95_s": round(quantile(group_waits, 0.95), 3),
            "wait_over_slowest_p50": round(statistics.median(ratios), 3),
            "wait_over_slowest_p95": round(quantile(ratios, 0.95), 3), "errors": errors}


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


async def score_here(batch: list[list[str]], spec: str, timeout_s: float,
                     in_flight: int) -> tuple[float, list[float], int, int]:
    """This code's path, `in_flight` producers at a time; returns (wall, waits, errors, pool size)."""
    from ..config import auto_workers
    from ..rewards import Batch, make_rewards
    from ..rollout import RewardStats

    stats = RewardStats()
    workers = auto_workers(None, in_flight * len(batch[0]))  # as a run sizes it: the completions in flight
    rewards = make_rewards([spec], None, timeout_s, workers, stats)
    try:
        # Workers start on demand and stay: a run pays their start once, on its first groups. The
        # figure is the steady state, so every worker is started first.
        await rewards.score(Batch("p", "7", [f"warm-up {i}" for i in range(workers)]))
        stats.errors = 0
        todo = iter(enumerate(batch))
        waits = [0.0] * len(batch)

        async def producer() -> None:
            for i, group in todo:
                waits[i] = (await rewards.score(Batch("p", "7", group))).wait_s

        began = time.monotonic()
        await asyncio.gather(*(producer() for _ in range(in_flight)))
        wall = time.monotonic() - began
    finally:
        rewards.close()
    return wall, waits, stats.errors, workers


def score_baseline(batch: list[list[str]], baseline: Path, module_dir: Path, timeout_s: float,
                   in_flight: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(baseline), str(module_dir)])}
    out = subprocess.run([sys.executable, "-c", BASELINE_DRIVER, json.dumps(batch), str(timeout_s), str(in_flight)],
                         env=env,
                         cwd=module_dir, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"the baseline failed: {out.stderr.strip()[-500:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def run_rewards_bench(groups: int = 48, n: int = 8, in_flight: int = 8, median_s: float = 0.4, sigma: float = 1.0,
                      reps: int = 3, baseline: Path | None = None, baseline_reps: int = 1,
                      timeout_s: float = 60.0) -> dict[str, Any]:
    batch = workload(groups, n)
    slowest = [max(d) for d in delays(batch, median_s, sigma)]
    samples = groups * n
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "async": []}
    if baseline is not None:
        runs["baseline"] = []
    workers = 0
    with tempfile.TemporaryDirectory() as tmp:
        module_dir = Path(tmp)
        (module_dir / "bench_reward.py").write_text(REWARD_MODULE.format(median_s=median_s, sigma=sigma))
        cwd = os.getcwd()
        os.chdir(module_dir)  # the pool's workers import the module from the working directory
        try:
            for rep in range(reps):
                if baseline is not None and rep < baseline_reps:
                    got = score_baseline(batch, baseline, module_dir, timeout_s, in_flight)
                    runs["baseline"].append(figures(got["wall_s"], got["group_waits"], slowest, got["errors"]))
                for form, spec in (("plain", "bench_reward:sandbox"), ("async", "bench_reward:sandbox_async")):
                    wall, waits, errors, workers = asyncio.run(score_here(batch, spec, timeout_s, in_flight))
                    runs[form].append(figures(wall, waits, slowest, errors))
        finally:
            os.chdir(cwd)
    calls_s = sum(sum(d) for d in delays(batch, median_s, sigma))
    report: dict[str, Any] = {"groups": groups, "n": n, "in_flight": in_flight, "samples": samples, "median_s": median_s, "sigma": sigma,
                              "reps": reps, "pool_size": workers, "sum_of_calls_s": round(calls_s, 2),
                              "slowest_call_s": round(max(slowest), 2), "sides": {}}
    for side, rows in runs.items():
        walls = [r["wall_s"] for r in rows]
        median_row = rows[walls.index(sorted(walls)[len(walls) // 2])]
        report["sides"][side] = {**median_row, "samples": samples,
                                 "samples_per_s": round(samples / statistics.median(walls), 2),
                                 "wall_s_all": walls}
    if baseline is not None:
        base = report["sides"]["baseline"]["samples_per_s"]
        for side in ("plain", "async"):
            report["sides"][side]["speedup_vs_baseline"] = round(report["sides"][side]["samples_per_s"] / base, 1)
    return report
