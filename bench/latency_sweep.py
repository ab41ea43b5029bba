"""The async-vs-sync sweep over simulated tool latency (bench/RESULTS.md section 16).

    python bench/latency_sweep.py --latencies 0,1,3,10 --budgets 150,180,240,420 --out runs/sweep \
        [--modes sync,async-partial,auto] [--seeds 0] [--config examples/sandbox.toml] [--set KEY=VALUE ...]

For each median latency (seconds; sigma 1) it runs `lora-async bench e2e` on the config with
`task.tool_latency = {median_s = L, sigma = 1}`, then writes `OUT/sweep.json` (each latency's
report) and `OUT/sweep.png`: the async/sync ratio of time to the target and of trained tokens/s
against the latency, with auto's time against the better of the two.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def run_latency(latency: float, budget: float, args: argparse.Namespace) -> dict:
    out = args.out / f"latency-{latency:g}"
    cmd = [sys.executable, "-m", "lora_async", "bench", "e2e", str(args.config), "--budget", str(budget),
           "--modes", args.modes, "--seeds", args.seeds, "--save-every", str(args.save_every), "--target",
           str(args.target), "--out", str(out), "--json",
           "--set", f"task.tool_latency={{median_s={latency}, sigma=1.0}}", *[f"--set={s}" for s in args.set]]
    print(" ".join(cmd), flush=True)
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"latency {latency:g}: bench e2e failed (exit {done.returncode})")
    return json.loads(done.stdout)


def chart(sweep: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latencies = sorted(sweep, key=float)
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("async-partial_sooner_than_sync", "async+partial: sync time to target / its own"),
                       ("async-partial_tokens_per_s_over_sync", "async+partial: trained tokens/s over sync"),
                       ("auto_sooner_than_sync", "auto: sync time to target / its own")):
        xs = [float(lat) for lat in latencies if sweep[lat]["ratios"].get(key)]
        ys = [sweep[lat]["ratios"][key] for lat in latencies if sweep[lat]["ratios"].get(key)]
        if xs:
            ax.plot(xs, ys, marker="o", label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("simulated tool latency, median (s; lognormal sigma 1)")
    ax.set_ylabel("ratio over sync (> 1: async better)")
    ax.set_title("sandbox environment, 2 CPU cores")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--latencies", default="0,1,3,10")
    p.add_argument("--budgets", default="150,180,240,420", help="training seconds per run, one per latency")
    p.add_argument("--modes", default="sync,async-partial,auto")
    p.add_argument("--seeds", default="0")
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--target", type=float, default=0.7)
    p.add_argument("--config", type=Path, default=Path("examples/sandbox.toml"))
    p.add_argument("--out", type=Path, default=Path("runs/sweep"))
    p.add_argument("--set", action="append", default=[])
    args = p.parse_args()
    latencies = [float(x) for x in args.latencies.split(",")]
    budgets = [float(x) for x in args.budgets.split(",")]
    if len(budgets) != len(latencies):
        raise SystemExit("--budgets: give one budget per latency")
    args.out.mkdir(parents=True, exist_ok=True)
    sweep_file = args.out / "sweep.json"
    sweep = json.loads(sweep_file.read_text()) if sweep_file.is_file() else {}
    for latency, budget in zip(latencies, budgets):
        sweep[f"{latency:g}"] = run_latency(latency, budget, args)
        sweep_file.write_text(json.dumps(sweep, indent=2))
        chart(sweep, args.out / "sweep.png")
    print(json.dumps({lat: report["ratios"] for lat, report in sweep.items()}, indent=2))


if __name__ == "__main__":
    main()
