"""The `lora-async` command line. Heavy imports (torch, vLLM) happen inside commands.

    app.py             the app and its commands: train, eval, plot, adapters, serve, server
    plan.py            `lora-async plan`, and the same check `train` makes first
    bench_commands.py  `lora-async bench ...`: one command per benchmark of `lora_async/bench/`
    common.py          what every command shares: config loading with one-line errors, fail, warn
"""

from __future__ import annotations

from .app import app


def main() -> None:
    app()


__all__ = ["app", "main"]
