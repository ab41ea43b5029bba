"""Held-out accuracy of a run's saved adapters, scored after the run, off its training clock.

    python -m lora_async.bench.snapshots --config CONFIG.json RUN_DIR [RUN_DIR ...]

A benchmarked run saves its adapter at fixed steps (`run.save_every`, and at the start), each
stamped with its step and the training clock (`OUT/adapters/main/vK/lora_async.json`); a TRL run
of the peer benchmark lists them in `RUN_DIR/snapshots.jsonl`. Each adapter is loaded from its
PEFT directory by vLLM's own loader, as `lora-async eval --adapter DIR` does, and scored greedily
on the task's held-out problems with `run.eval_max_tokens`: every run on one engine, a few
snapshots at once in LoRA slots of their own (`--at-once`), their episodes batched together. The scores
replace the eval rows of `RUN_DIR/metrics.jsonl` (kind = "eval", stamped with the training clock
at which the adapter was saved), so summaries and `lora-async plot` read them as usual;
`RUN_DIR/eval.json` says how long scoring took. Evaluation then costs no run any training time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

ADAPTER = "main"  # the adapter's name in a TRL run's rows (lora-async's default name for a single adapter)
EVAL_SLOT = "eval"  # the engine's names for the adapters under evaluation: eval0, eval1, ...; each snapshot a new version
# Snapshots scored at once. One snapshot's 100 greedy episodes leave the CPU engine idle while its
# tools run and decode small batches; several share the batches (bench/RESULTS.md §20).
AT_ONCE = 4


def snapshots(run_dir: Path) -> list[dict[str, Any]]:
    """The run's saved adapters in step order: step, wall_s, when, path, adapter (a single-adapter
    run's, whatever its name)."""
    from ..metrics import read_metrics

    listed = run_dir / "snapshots.jsonl"
    if listed.is_file():
        return [{"adapter": ADAPTER, **s} for s in read_metrics(listed)]
    found = []
    for info_file in (run_dir / "adapters").glob("*/v*/lora_async.json"):
        info = json.loads(info_file.read_text())  # a snapshot, or the final adapter (stamped at the end)
        found.append({"step": info["step"], "wall_s": info["wall_s"], "adapter": info_file.parent.parent.name,
                      "when": "snapshot" if info.get("snapshot") else "end", "path": str(info_file.parent.resolve())})
    return sorted(found, key=lambda s: (s["step"], s["when"] != "snapshot"))


def score_runs(config: Any, runs: list[tuple[Path, list[dict[str, Any]]]], log: Any = print,
               at_once: int = AT_ONCE) -> list[list[dict[str, Any]]]:
    """One list of eval rows per run (one row per saved adapter, in the order saved), all on one
    engine, `at_once` snapshots at a time (each in a LoRA slot of its own)."""
    from ..adapters import load_peft_dir
    from ..config import vllm_rank
    from ..evaluate import eval_engine
    from ..tasks import make_source

    spec = config.adapter_specs[0]
    source = make_source(spec, config, config.run.seed)
    queue = [(r, snap) for r, (_, snaps) in enumerate(runs) for snap in snaps]
    rank = max(int(load_peft_dir(Path(s["path"]))[1].get("r", config.lora.rank)) for _, s in queue)
    slots = tuple(f"{EVAL_SLOT}{j}" for j in range(max(1, min(at_once, len(queue)))))
    scored: list[list[dict[str, Any]]] = [[] for _ in runs]
    version = 0
    try:
        with eval_engine(config, vllm_rank(rank), slots) as engine:
            for first in range(0, len(queue), len(slots)):
                batch = queue[first:first + len(slots)]
                for slot, (_, snap) in zip(slots, batch):
                    engine.load_dir(slot, version, Path(snap["path"]))
                    version += 1
                results = engine.run_many(source, list(slots[:len(batch)]))
                for (r, snap), result in zip(batch, results):
                    scored[r].append({"kind": "eval", "when": snap["when"], "adapter": snap["adapter"],
                                      "step": snap["step"], "version": snap["step"], "wall_s": snap["wall_s"],
                                      "accuracy": result.accuracy, "mean_reward": result.mean_reward, "n": result.n})
                    log(f"{runs[r][0].name}: step {snap['step']:>4}  wall {snap['wall_s']:>7.1f}s  "
                        f"accuracy {result.accuracy:.3f} (n={result.n})")
    finally:
        source.close()
    return scored


def replace_eval_rows(metrics: Path, rows: list[dict[str, Any]]) -> None:
    """Keep the other rows of `metrics`, drop its old eval rows, append `rows`."""
    kept = [line for line in metrics.read_text().splitlines() if '"kind": "eval"' not in line]
    metrics.write_text("".join(f"{line}\n" for line in kept) + "".join(json.dumps(r) + "\n" for r in rows))


def score_dirs(config: Any, run_dirs: list[Path], log: Any = print, at_once: int = AT_ONCE) -> None:
    """Score every run's snapshots and write them back (`replace_eval_rows`, `eval.json`)."""
    began = time.perf_counter()
    runs = [(d, snapshots(d)) for d in run_dirs]
    empty = [str(d) for d, snaps in runs if not snaps]
    if empty:
        raise SystemExit(f"error: no saved adapters to score in {', '.join(empty)} (run.save_every = 0?)")
    for (run_dir, snaps), rows in zip(runs, score_runs(config, runs, log, at_once)):
        replace_eval_rows(run_dir / "metrics.jsonl", rows)
        (run_dir / "eval.json").write_text(json.dumps({"snapshots": len(rows),
                                                        "eval_s": round(time.perf_counter() - began, 1)}))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", type=Path, nargs="+", help="the runs' directories")
    p.add_argument("--config", required=True, type=Path, help="the config the runs trained (TOML or resolved JSON)")
    p.add_argument("--at-once", type=int, default=AT_ONCE, help=f"snapshots scored at once (default {AT_ONCE})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (TOML only)")
    a = p.parse_args(argv)
    from ..config import TrainConfig, load_config
    from ..quiet import quiet_start

    quiet_start(False)
    if a.config.suffix == ".json":
        config = TrainConfig.model_validate(json.loads(a.config.read_text()))
    else:
        config = load_config(a.config, a.set)
    score_dirs(config, a.run_dirs, at_once=a.at_once)


if __name__ == "__main__":  # vLLM spawns processes that re-import this module
    main()
