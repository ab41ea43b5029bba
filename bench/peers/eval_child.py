"""Held-out accuracy of a peer-benchmark run, scored after the run by lora-async's evaluation.

    python bench/peers/eval_child.py --run-dir DIR --config CONFIG [--set KEY=VALUE ...]

Every system saves its adapter at fixed steps, stamped with its training clock; this scores each
saved adapter the same way, off every system's clock:
- a TRL run lists them in `DIR/snapshots.jsonl` (trl_child.py);
- a lora-async run keeps them in its adapter store, `DIR/adapters/main/vK/` (`run.save_every`,
  and the final adapter; `lora_async.json` holds the step and the training clock).

Each adapter is loaded from its PEFT directory by vLLM's own loader, as `lora-async eval
--adapter DIR` does, and scored greedily on the task's held-out problems with
`run.eval_max_tokens`, all on one engine. The scores replace the eval rows of `DIR/metrics.jsonl`
(lora-async's format: kind = "eval", stamped with the training clock at which the adapter was
saved), so `lora-async plot` draws every system alike. `DIR/eval.json` says how long scoring took.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

ADAPTER = "main"  # the adapter's name in metrics rows (lora-async's name for a single adapter)
EVAL_SLOT = "eval"  # the engine's name for the adapter under evaluation; each snapshot is a new version


def snapshots(run_dir: Path) -> list[dict[str, Any]]:
    """The run's saved adapters in step order: step, wall_s, when, path."""
    from lora_async.metrics import read_metrics

    listed = run_dir / "snapshots.jsonl"
    if listed.is_file():
        return read_metrics(listed)
    found = []
    for info_file in (run_dir / "adapters" / ADAPTER).glob("v*/lora_async.json"):
        info = json.loads(info_file.read_text())  # a snapshot, or the final adapter (stamped at the end)
        found.append({"step": info["step"], "wall_s": info["wall_s"],
                      "when": "snapshot" if info.get("snapshot") else "end", "path": str(info_file.parent.resolve())})
    return sorted(found, key=lambda s: s["step"])


def score_snapshots(config: Any, snaps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One eval row per saved adapter, in the order saved."""
    from lora_async.adapters import load_peft_dir
    from lora_async.config import vllm_rank
    from lora_async.evaluate import eval_engine
    from lora_async.tasks import make_source

    spec = config.adapter_specs[0]
    source = make_source(spec, config, config.run.seed)
    rank = max(int(load_peft_dir(Path(s["path"]))[1].get("r", config.lora.rank)) for s in snaps)
    rows = []
    try:
        with eval_engine(config, vllm_rank(rank)) as engine:
            for version, snap in enumerate(snaps):
                engine.load_dir(EVAL_SLOT, version, Path(snap["path"]))
                result = engine.run(source, EVAL_SLOT)
                rows.append({"kind": "eval", "when": snap["when"], "adapter": ADAPTER, "step": snap["step"],
                             "version": snap["step"], "wall_s": snap["wall_s"], "accuracy": result.accuracy,
                             "mean_reward": result.mean_reward, "n": result.n})
                print(f"step {snap['step']:>4}  wall {snap['wall_s']:>7.1f}s  accuracy {result.accuracy:.3f}  "
                      f"(n={result.n}) e.g. {result.examples[:1]}", flush=True)
    finally:
        source.close()
    return rows


def replace_eval_rows(metrics: Path, rows: list[dict[str, Any]]) -> None:
    """Keep the other rows of `metrics`, drop its old eval rows, append `rows`."""
    kept = [line for line in metrics.read_text().splitlines() if '"kind": "eval"' not in line]
    metrics.write_text("".join(f"{line}\n" for line in kept) + "".join(json.dumps(r) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", type=Path, required=True, help="the run's directory")
    p.add_argument("--config", required=True, help="the lora-async config the benchmark runs")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="lora-async config override")
    a = p.parse_args(argv)
    from lora_async.config import load_config

    began = time.perf_counter()
    snaps = snapshots(a.run_dir)
    if not snaps:
        raise SystemExit(f"error: {a.run_dir} has no saved adapters to score")
    rows = score_snapshots(load_config(a.config, a.set), snaps)
    replace_eval_rows(a.run_dir / "metrics.jsonl", rows)
    (a.run_dir / "eval.json").write_text(json.dumps({"snapshots": len(rows),
                                                      "eval_s": round(time.perf_counter() - began, 1)}))


if __name__ == "__main__":  # vLLM spawns processes that re-import this module
    main()
