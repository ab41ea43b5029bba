"""What every command shares: config loading with one-line errors (exit code 2), `fail` and `warn`."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn, Optional

import typer
from rich.console import Console

from ..api import warn
from ..config import ConfigError, TrainConfig, load_config

SET_HELP = "Override a config field: --set dotted.key=value (repeatable), e.g. --set learner.lr=1e-4"
CONFIG_HELP = "TOML config file (see examples/). Omit to use the defaults."


def fail(message: str, code: int = 2) -> NoReturn:
    from rich.markup import escape

    # Escaped: messages name tables and extras in brackets ("[ray]", "lora-async[ray]").
    Console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def load_or_exit(config: Optional[Path], overrides: list[str]) -> TrainConfig:
    try:
        return load_config(config, overrides)
    except ConfigError as exc:
        fail(str(exc))
