"""`lora-async bench sandbox`: what the namespaces cost per call, beside the process runner.

Both runners start a fresh interpreter per call; the namespaced one starts it under bwrap
(`lora_async/sandbox/namespaces.py`). Measured on the same machine in one command, the two
isolations alternating round by round so that the machine's load falls on both alike:

- latency: `calls` sequential runs of `print(1)` each, p50 and p95 of the wall time;
- throughput: `concurrency` threads calling at once (as a reward pool's workers do), each
  `per_thread` calls; completed calls per second.

Figures per isolation: medians over the rounds; the added p50 and the throughput ratio.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from ..sandbox import ISOLATIONS, Isolation, cage, run_python

CODE = "print(1)"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def latencies(isolation: Isolation, calls: int) -> list[float]:
    """Wall time of `calls` runs one after another (the parent's whole call, in seconds)."""
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        result = run_python(CODE, isolation=isolation)
        times.append(time.perf_counter() - started)
        if result.stdout != "1\n":
            raise RuntimeError(f"{isolation}: print(1) gave {result.text()!r}")
    return times


def throughput(isolation: Isolation, concurrency: int, per_thread: int) -> float:
    """Calls per second with `concurrency` callers at once."""
    failures: list[str] = []
    barrier = threading.Barrier(concurrency + 1)

    def caller() -> None:
        barrier.wait()
        for _ in range(per_thread):
            result = run_python(CODE, isolation=isolation)
            if result.stdout != "1\n":
                failures.append(result.text())

    threads = [threading.Thread(target=caller) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if failures:
        raise RuntimeError(f"{isolation}: {len(failures)} calls failed at {concurrency} at once: {failures[0]!r}")
    return concurrency * per_thread / elapsed


def run_sandbox_bench(calls: int, concurrency: int, per_thread: int, rounds: int) -> dict[str, Any]:
    cage()  # probe first: a machine that refuses namespaces says so before anything is timed
    for isolation in ISOLATIONS:  # warm the page cache for both
        latencies(isolation, 3)
    p50: dict[str, list[float]] = {i: [] for i in ISOLATIONS}
    p95: dict[str, list[float]] = {i: [] for i in ISOLATIONS}
    rate: dict[str, list[float]] = {i: [] for i in ISOLATIONS}
    for round_ in range(rounds):
        order = ISOLATIONS if round_ % 2 == 0 else tuple(reversed(ISOLATIONS))
        for isolation in order:
            times = latencies(isolation, calls)
            p50[isolation].append(statistics.median(times))
            p95[isolation].append(percentile(times, 0.95))
        for isolation in order:
            rate[isolation].append(throughput(isolation, concurrency, per_thread))
    figures: dict[str, dict[str, Any]] = {
        i: {"p50_ms": 1000 * statistics.median(p50[i]), "p95_ms": 1000 * statistics.median(p95[i]),
            "calls_per_s": statistics.median(rate[i]),
            "rounds": {"p50_ms": [1000 * v for v in p50[i]], "p95_ms": [1000 * v for v in p95[i]], "calls_per_s": rate[i]}}
        for i in ISOLATIONS}
    ns, proc = figures["namespaces"], figures["process"]
    return {"code": CODE, "calls": calls, "concurrency": concurrency, "per_thread": per_thread, "rounds": rounds,
            "cage": cage().describe(), **figures,
            "added_p50_ms": ns["p50_ms"] - proc["p50_ms"], "added_p95_ms": ns["p95_ms"] - proc["p95_ms"],
            "throughput_ratio": proc["calls_per_s"] / ns["calls_per_s"]}
