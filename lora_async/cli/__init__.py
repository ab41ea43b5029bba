"""The `lora-async` command line. Heavy imports (torch, vLLM) happen inside commands."""

from __future__ import annotations

from .app import app


def main() -> None:
    app()


__all__ = ["app", "main"]
