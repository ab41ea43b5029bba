"""Run one training from a resolved JSON config (what `bench` writes for each of its runs)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from ..config import TrainConfig
from ..quiet import quiet_start


def main(path: str) -> None:
    config = TrainConfig.model_validate(json.loads(Path(path).read_text()))
    quiet_start(config.run.engine_log)  # before torch is imported
    from ..orchestrator import train

    asyncio.run(train(config))


if __name__ == "__main__":
    main(sys.argv[1])
