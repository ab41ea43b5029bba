"""Processes and runs for the benchmarks: loopback ports, process groups, the peak RSS of process
trees, child runs logged to a file, and the one summary of a run's `metrics.jsonl`.

`lora-async bench e2e` and `fleet`, the tests' training server (`server.py`) and the peer
benchmark (bench/peers/) all start children here the same way: in their own session (so one
signal reaches a child's whole tree, a vLLM engine core included) with their output in a log.
Nothing here imports torch or vLLM.
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import psutil

from ..metrics import read_metrics
from ..timing import IDLE_CAUSES

# The accuracy whose first crossing the summaries time: the key `time_to_acc_0.5_s` names it.
TARGET_ACCURACY = 0.5
ACCURACY_MARKS = (0.5, 0.7, 0.8)  # each mark's first crossing: `time_to_acc_<mark>_s`
# Sampling RSS twice a second catches a vLLM engine's start-up peak (it lasts seconds) at a cost
# of one /proc walk per sample, too little to show on the 2-core benchmark machine.
RSS_SAMPLE_S = 0.5
# How often a logged run's `stop_when` is asked; a child that exits is noticed at once.
POLL_S = 0.5
# A training child needs a few seconds to stop its engine on SIGTERM; 10 s is ample on CPU.
STOP_GRACE_S = 10.0
# A thread that is sampling /proc stops within one interval; this only bounds a stuck join.
MONITOR_JOIN_S = 5.0
# Substrings that mark the line of a log that says why a run failed.
ERROR_MARKERS = ("Error:", "Error(", "Exception:", "error:", "raise ", "NotImplemented", "Traceback")
MAX_ERROR_CHARS = 800
MB = 1 << 20


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` now (the OS picks it; another process may take it later)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process group of `proc` (started with start_new_session=True), give it
    `grace_s` seconds, then SIGKILL it. Does nothing if `proc` has already exited."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group went away between the two signals
            pass
        proc.wait()
    except ProcessLookupError:  # it exited between poll() and killpg()
        proc.wait()


class TreeMonitor:
    """Peak RSS summed over the process trees of some root pids, sampled in a thread.

    Use as a context manager; `add` a root pid whenever a child starts. Shared pages count once
    per process, as in `ps`."""

    def __init__(self, interval_s: float = RSS_SAMPLE_S) -> None:
        self.interval_s = interval_s
        self.roots: list[psutil.Process] = []
        self.peak_bytes = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-monitor", daemon=True)

    @property
    def peak_mb(self) -> float:
        return self.peak_bytes / MB

    def add(self, pid: int) -> None:
        try:
            self.roots.append(psutil.Process(pid))
        except psutil.NoSuchProcess:  # it exited before we looked: nothing to measure
            pass

    def __enter__(self) -> "TreeMonitor":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=MONITOR_JOIN_S)

    def sample(self) -> int:
        """Bytes resident now, summed over every live process under the roots (each counted once)."""
        seen: dict[int, psutil.Process] = {}
        for root in list(self.roots):
            try:
                for proc in [root, *root.children(recursive=True)]:
                    seen[proc.pid] = proc
            except psutil.NoSuchProcess:
                continue
        total = 0
        for proc in seen.values():
            try:
                total += proc.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return total

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self.sample())
            self.samples += 1
            self._stop.wait(self.interval_s)


@dataclass(frozen=True)
class RunResult:
    """How a logged child run ended."""

    returncode: int
    wall_s: float
    stopped: str | None  # why `stop_when` stopped it, or None if it ended by itself


def start_logged(cmd: Sequence[str], log: Path, env: Mapping[str, str] | None = None,
                 cwd: Path | None = None) -> subprocess.Popen:
    """Start `cmd` in its own session with stdout and stderr going to `log` (truncated)."""
    with open(log, "w") as out:  # the child holds its own copy of the descriptor
        return subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                env=dict(env) if env is not None else None, start_new_session=True)


def run_logged(cmd: Sequence[str], log: Path, monitor: TreeMonitor | None = None, *,
               env: Mapping[str, str] | None = None, cwd: Path | None = None,
               stop_when: Callable[[], str | None] | None = None,
               grace_s: float = STOP_GRACE_S) -> RunResult:
    """Run `cmd` to the end with its output in `log` and its tree in `monitor`.

    `stop_when()` is asked every POLL_S; a reason it returns stops the child's group. Any
    exception here (Ctrl-C included) stops the group too, and so does a SIGTERM to this process
    (`exit_on_sigterm`), so no child outlives the caller."""
    started = time.perf_counter()
    with exit_on_sigterm():
        proc = start_logged(cmd, log, env, cwd)
        if monitor is not None:
            monitor.add(proc.pid)
        stopped = None
        try:
            while True:
                try:
                    proc.wait(timeout=POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    pass
                stopped = stop_when() if stop_when is not None else None
                if stopped is not None:
                    stop_group(proc, grace_s)
                    break
        except BaseException:
            stop_group(proc, grace_s)
            raise
    return RunResult(proc.wait(), time.perf_counter() - started, stopped)


@contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """SIGTERM exits through Python (SystemExit, status 143) for the duration, so `run_logged`
    stops its child's group (its own session, which the signal does not reach) before this
    process ends. Only the main thread may set a handler: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _log_lines(log: Path) -> list[str] | None:
    try:
        return log.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return None


def last_error(log: Path) -> str:
    """The most telling line of a failed run's log: its last exception line, else the last line."""
    text = _log_lines(log)
    if text is None:
        return "(no log)"
    for line in reversed(text):
        s = line.strip()
        if s and any(m in s for m in ERROR_MARKERS) and not s.startswith("Traceback"):
            return s[:MAX_ERROR_CHARS]
    return (text[-1].strip() if text else "(empty log)")[:MAX_ERROR_CHARS]


# ------------------------------------------------------------------ the summary of a run


def summarize_run(run_dir: Path, budget: float, target: float = TARGET_ACCURACY) -> dict[str, Any]:
    """Figures of one run from its `metrics.jsonl` (lora-async's format; the peer benchmark's TRL
    run writes it too). Step rows have no `kind`; eval rows have kind = "eval". Figures that
    need lora-async-only fields (generator idle time, adapter syncs, stale drops) are None for
    a run whose rows lack them."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    steps = sorted((r for r in rows if "kind" not in r), key=lambda r: r["wall_s"])
    evals = sorted((r for r in rows if r.get("kind") == "eval"), key=lambda r: r["wall_s"])
    wall = steps[-1]["wall_s"] if steps else 0.0
    tokens = steps[-1].get("tokens_generated_total", 0) if steps else 0
    rewards = [r["reward_mean"] for r in steps if r.get("reward_mean") is not None]
    lags = [r["policy_lag_mean"] for r in steps if r.get("policy_lag_mean") is not None]
    time_to_target = next((e["wall_s"] for e in evals if e["accuracy"] >= target), None)
    # Throughput up to the target: once a run has solved the task its groups go flat, it trains
    # fewer tokens, and a figure over the whole budget would rank the run that learned slowest
    # first. A run that never reached the target is measured over all of it.
    until = [r for r in steps if time_to_target is None or r["wall_s"] <= time_to_target]
    clock = until[-1]["wall_s"] if until else 0.0
    trained_until = sum(r.get("tokens_trained", 0) for r in until)
    generated_until = until[-1].get("tokens_generated_total", 0) if until else 0
    return {
        "steps": len(steps),
        "wall_s": wall,
        "budget_s": budget,
        **{f"time_to_acc_{mark}_s": next((e["wall_s"] for e in evals if e["accuracy"] >= mark), None)
           for mark in ACCURACY_MARKS},
        "target": target,
        "time_to_target_s": time_to_target,
        "tokens_trained": sum(r.get("tokens_trained", 0) for r in steps),
        "throughput_until": "end" if time_to_target is None else "target",
        "trained_tokens_per_s": trained_until / clock if clock else 0.0,
        "trained_tokens_per_s_all": sum(r.get("tokens_trained", 0) for r in steps) / wall if wall else 0.0,
        "engine_running_mean": _mean_of(steps, "engine_running_mean"),
        "version_span_mean": _mean_of(steps, "version_span_mean"),
        "resumed_turns": steps[-1].get("resumed_turns_total") if steps else None,
        "tokens_reprefilled": steps[-1].get("tokens_reprefilled_total") if steps else None,
        "aborted_stale_groups": steps[-1].get("aborted_stale_groups") if steps else None,
        "accuracy_start": evals[0]["accuracy"] if evals else None,
        "accuracy_end": evals[-1]["accuracy"] if evals else None,
        "accuracy_max": max((e["accuracy"] for e in evals), default=None),
        "accuracy_curve": [(round(e["wall_s"], 1), e["accuracy"]) for e in evals],
        "heldout_n": evals[-1].get("n") if evals else None,
        "evals": len(evals),
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "tokens_generated": tokens,
        "gen_tokens_per_s": generated_until / clock if clock else 0.0,
        "gen_tokens_per_s_all": tokens / wall if wall else 0.0,
        "policy_lag_mean": statistics.fmean(lags) if lags else None,
        "dropped_stale": steps[-1].get("dropped_stale") if steps else 0,
        "zero_adv_groups": steps[-1].get("zero_adv_groups") if steps else None,
        **_engine_figures(steps, wall),
        **_time_breakdown(rows, steps),
        **time_split(steps),
    }


# The shares `time_split` reports: the generator's compute, its idle time and each cause of it,
# and the learner's compute and wait for data.
SPLIT_SHARES = ("gen_compute_share", "gen_idle_share", *(f"gen_idle_{c}_share" for c in IDLE_CAUSES),
                "learner_compute_share", "learner_wait_share")


def time_split(steps: list[dict[str, Any]]) -> dict[str, float | None]:
    """Where a run's time went, as shares (None for a run whose rows lack the split: an older run,
    TRL's). The generator's parts are shares of the summed step intervals (each adapter's steps
    tile its time, so in a fleet too); the learner's are shares of the span from training's start
    (the first row's interval began there) to the last step."""
    split = [r for r in steps if r.get("step_s") is not None and r.get("gen_compute_s") is not None]
    if not split or len(split) != len(steps):
        return dict.fromkeys(SPLIT_SHARES)
    interval = sum(r["step_s"] for r in split)
    span = split[-1]["wall_s"] - split[0]["wall_s"] + split[0]["step_s"]
    if interval <= 0 or span <= 0:
        return dict.fromkeys(SPLIT_SHARES)
    gen_keys = ("gen_compute_s", "gen_idle_s", *(f"gen_idle_{c}_s" for c in IDLE_CAUSES))
    shares: dict[str, float | None] = {f"{key[:-2]}_share": sum(r[key] for r in split) / interval
                                       for key in gen_keys}  # gen_..._s -> gen_..._share
    shares["learner_compute_share"] = sum(r.get("learner_s") or 0.0 for r in split) / span
    shares["learner_wait_share"] = sum(r.get("learner_wait_s") or 0.0 for r in split) / span
    return shares


def _time_breakdown(rows: list[dict[str, Any]], steps: list[dict[str, Any]]) -> dict[str, float | None]:
    """Where a run's time went, in seconds: startup (launch to training start, from the `start`
    row), time to the first learner step (startup plus the first step's training clock),
    generation (the engine's busy time; a TRL row's `gen_s`), learner, and adapter sync. On one
    machine generation and learner overlap in async runs, so they need not add up to the clock."""
    start = next((r for r in rows if r.get("kind") == "start"), None)
    startup = start.get("startup_s") if start else None
    first = steps[0]["wall_s"] if steps else None
    gen_s = None
    if steps and all(r.get("gen_idle_frac") is not None for r in steps):
        step_s = [b["wall_s"] - a["wall_s"] for a, b in zip([{"wall_s": 0.0}, *steps], steps)]
        gen_s = sum(t * (1.0 - r["gen_idle_frac"]) for t, r in zip(step_s, steps))
    elif steps and all(r.get("gen_s") is not None for r in steps):
        gen_s = sum(r["gen_s"] for r in steps)
    learner = [r["learner_s"] for r in steps if r.get("learner_s") is not None]
    syncs = [r["sync_ms"] for r in steps if r.get("sync_ms") is not None]
    return {
        "startup_s": startup,
        "time_to_first_step_s": startup + first if startup is not None and first is not None else None,
        "gen_s": gen_s,
        "learner_s": sum(learner) if learner else None,
        "sync_s": sum(syncs) / 1000 if syncs else None,
    }


def _mean_of(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def _engine_figures(steps: list[dict[str, Any]], wall: float) -> dict[str, float | None]:
    """Generator idle share and adapter-sync cost of a lora-async run (None where not logged)."""
    idle = None
    if wall and steps and all(r.get("gen_idle_frac") is not None for r in steps):
        # Each step's idle fraction weighted by that step's share of the wall-clock.
        step_s = [b["wall_s"] - a["wall_s"] for a, b in zip([{"wall_s": 0.0}, *steps], steps)]
        idle = sum(t * r["gen_idle_frac"] for t, r in zip(step_s, steps)) / wall
    logged = [r for r in steps if r.get("sync_ms") is not None]
    if not logged:
        return {"gen_idle_frac": idle, "sync_share": None, "sync_wait_share": None, "sync_ms_p50": None}
    synced = [r["sync_ms"] for r in logged if r.get("updated") and not r.get("sync_error")]
    sync_s = sum(r["sync_ms"] for r in logged) / 1000
    # Time the learner waited for a sync; a sync in the background logs none (nobody waits).
    wait_s = sum(r.get("sync_wait_ms") or 0.0 for r in logged) / 1000
    return {
        "gen_idle_frac": idle,
        "sync_share": sync_s / wall if wall else None,
        "sync_wait_share": wait_s / wall if wall else None,
        "sync_ms_p50": statistics.median(synced) if synced else None,
    }
