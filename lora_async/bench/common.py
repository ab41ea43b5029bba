"""Small helpers shared by the benchmarks."""

from __future__ import annotations

import threading
from typing import Any

from ..generator.types import GenRequest, GenResult


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
