"""Held-out accuracy of a peer-benchmark run, scored after the run by lora-async's evaluation.

    python bench/peers/eval_child.py --run-dir DIR --config CONFIG [--set KEY=VALUE ...]

The scoring itself is `lora_async.bench.snapshots` (`lora-async bench e2e` scores its runs the
same way): every saved adapter of the run, greedy on the task's held-out problems, off the clock.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lora_async.bench.snapshots import replace_eval_rows, score_runs, snapshots  # noqa: F401 (re-exported)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", type=Path, required=True, help="the run's directory")
    p.add_argument("--config", required=True, help="the lora-async config the benchmark runs")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="lora-async config override")
    a = p.parse_args(argv)
    from lora_async.bench.snapshots import score_dirs
    from lora_async.config import load_config

    score_dirs(load_config(a.config, a.set), [a.run_dir])


if __name__ == "__main__":  # vLLM spawns processes that re-import this module
    main()
