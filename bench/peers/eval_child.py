"""Held-out accuracy of the peer benchmark's TRL run, measured by lora-async's own evaluation.

    python bench/peers/eval_child.py --run-dir DIR --config CONFIG [--set KEY=VALUE ...]

Every adapter trl_child.py saved (`DIR/snapshots.jsonl`) is loaded from its PEFT directory by
vLLM's own loader, as `lora-async eval --adapter DIR` does, and scored greedily on the task's
held-out problems with `run.eval_max_tokens`, all on one engine. The scores replace the eval
rows of `DIR/metrics.jsonl` (lora-async's format: kind = "eval", stamped with the training
wall-clock at which the adapter was saved), so `lora-async plot` draws them like a lora-async run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from trl_child import ADAPTER

# The engine's name for the adapter under evaluation; each snapshot is a new version of it.
EVAL_SLOT = "eval"


def score_snapshots(config: Any, snaps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One eval row per saved adapter, in the order saved."""
    from lora_async.adapters import load_peft_dir
    from lora_async.config import vllm_rank
    from lora_async.evaluate import eval_engine
    from lora_async.tasks import make_task

    task = make_task(config.task, config.run.seed)
    spec = config.adapter_specs[0]
    rank = max(int(load_peft_dir(Path(s["path"]))[1].get("r", config.lora.rank)) for s in snaps)
    rows = []
    try:
        with eval_engine(config, vllm_rank(rank)) as engine:
            for version, snap in enumerate(snaps):
                engine.load_dir(EVAL_SLOT, version, Path(snap["path"]))
                result = engine.run(task, spec, config, EVAL_SLOT)
                rows.append({"kind": "eval", "when": snap["when"], "adapter": ADAPTER, "step": snap["step"],
                             "version": snap["step"], "wall_s": snap["wall_s"], "accuracy": result.accuracy,
                             "mean_reward": result.mean_reward, "n": result.n})
                print(f"step {snap['step']:>4}  wall {snap['wall_s']:>7.1f}s  accuracy {result.accuracy:.3f}  "
                      f"(n={result.n}) e.g. {result.examples[:1]}", flush=True)
    finally:
        task.close()
    return rows


def replace_eval_rows(metrics: Path, rows: list[dict[str, Any]]) -> None:
    """Keep the step rows of `metrics`, drop its old eval rows, append `rows`."""
    kept = [line for line in metrics.read_text().splitlines() if '"kind": "eval"' not in line]
    metrics.write_text("".join(f"{line}\n" for line in kept) + "".join(json.dumps(r) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", type=Path, required=True, help="the TRL run's directory")
    p.add_argument("--config", required=True, help="the lora-async config the benchmark runs")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="lora-async config override")
    a = p.parse_args(argv)
    from lora_async.config import load_config
    from lora_async.metrics import read_metrics

    snaps = read_metrics(a.run_dir / "snapshots.jsonl")
    if not snaps:
        raise SystemExit("error: the TRL run saved no adapters")
    replace_eval_rows(a.run_dir / "metrics.jsonl", score_snapshots(load_config(a.config, a.set), snaps))


if __name__ == "__main__":  # vLLM spawns processes that re-import this module
    main()
