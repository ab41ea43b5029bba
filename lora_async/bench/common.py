"""Small helpers shared by the benchmarks."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from ..config import TrainConfig, dump_config
from ..generator.types import GenRequest, GenResult


def finished(cfg: TrainConfig) -> bool:
    """`cfg.run.output_dir` holds a finished run of exactly this config (a benchmark keeps it
    rather than run it again)."""
    out = Path(cfg.run.output_dir)
    summary, saved = out / "summary.json", out / "config.json"
    if not (summary.is_file() and saved.is_file()):
        return False
    return json.loads(summary.read_text()).get("ended") == "done" and saved.read_text() == dump_config(cfg)


def blocking_generate(generator: Any, request: GenRequest, timeout: float = 600.0) -> GenResult:
    done = threading.Event()
    box: list[GenResult] = []

    def on_done(result: GenResult) -> None:
        box.append(result)
        done.set()

    generator.submit(request, on_done)
    if not done.wait(timeout):
        raise TimeoutError("generation timed out")
    return box[0]
