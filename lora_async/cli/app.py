"""Typer app: `lora-async train | eval | bench | adapters`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NoReturn, Optional

import typer
from rich.console import Console

from ..config import ConfigError, TrainConfig, load_config

app = typer.Typer(
    name="lora-async",
    help="LoRA-first asynchronous RL trainer: a peft learner and a vLLM multi-LoRA generator.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="Benchmarks (figures go to bench/RESULTS.md).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")

SET_HELP = "Override a config field: --set dotted.key=value (repeatable), e.g. --set learner.lr=1e-4"
CONFIG_HELP = "TOML config file (see examples/). Omit to use the defaults."


def fail(message: str, code: int = 2) -> NoReturn:
    Console(stderr=True).print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def load_or_exit(config: Optional[Path], overrides: list[str]) -> TrainConfig:
    try:
        return load_config(config, overrides)
    except ConfigError as exc:
        fail(str(exc))


@app.command()
def train(
    config: Optional[Path] = typer.Argument(None, help=CONFIG_HELP),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in run.output_dir from its checkpoint."),
) -> None:
    """Train LoRA adapters with async GRPO-style RL while vLLM keeps generating."""
    cfg = load_or_exit(config, set_)
    import asyncio

    from ..loop import TrainingError, train as run_train
    from ..models import ModelError
    from ..tasks import RewardError

    try:
        summary = asyncio.run(run_train(cfg, resume=resume))
    except (TrainingError, ModelError, RewardError) as exc:
        fail(str(exc), code=1)
    except KeyboardInterrupt:
        fail("interrupted; the last checkpoint is in run.output_dir (use --resume)", code=130)
    if "error" in summary:
        fail(summary["error"], code=1)


@app.command("eval")
def eval_cmd(
    config: Optional[Path] = typer.Argument(None, help=CONFIG_HELP),
    adapter: Optional[Path] = typer.Option(None, "--adapter", help="PEFT adapter directory to evaluate."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    limit: int = typer.Option(0, "--limit", help="Evaluate only the first N held-out problems (0 = all)."),
) -> None:
    """Greedy accuracy on the task's held-out split, for the base model and for an adapter."""
    cfg = load_or_exit(config, set_)
    from ..evaluate import run_eval
    from ..models import ModelError

    try:
        report = run_eval(cfg, adapter, limit)
    except (ModelError, FileNotFoundError, ValueError) as exc:
        fail(str(exc), code=1)
    if as_json:
        print(json.dumps(report))
        return
    console = Console()
    for row in report["results"]:
        console.print(f"{row['model']:<40} accuracy {row['accuracy']:.3f}  (n={row['n']})", highlight=False)


@bench_app.command("sync")
def bench_sync(
    transport: str = typer.Option("local", "--transport", help="'local' (the four in-process paths) or 'all'."),
    versions: int = typer.Option(12, "--versions", help="Successive versions measured per path."),
    rank: int = typer.Option(8, "--rank", help="LoRA rank (all linear layers)."),
    model: str = typer.Option("smollm2-135m", "--model", help="Model name or directory."),
    as_json: bool = typer.Option(False, "--json", help="Print {\"results\": [...]} as JSON."),
) -> None:
    """Hot-swap latency: tensors ready -> first generation on the new version."""
    from ..bench.sync import run_sync_bench

    results = run_sync_bench(model, rank, versions, transport)
    if as_json:
        print(json.dumps({"results": results}))
        return
    from rich.table import Table

    table = Table(title=f"adapter sync, r={rank}, {versions} versions")
    for col in ("transport", "p50_ms", "max_ms", "bytes", "vs_full_reload"):
        table.add_column(col)
    for row in results:
        table.add_row(row["transport"], f"{row['p50_ms']:.1f}", f"{row['max_ms']:.1f}", f"{row['bytes']:,}",
                      f"{row.get('speedup_vs_full', 0):.0f}x" if row.get("speedup_vs_full") else "-")
    Console().print(table)


@bench_app.command("e2e")
def bench_e2e(
    config: Path = typer.Argument(Path("examples/arithmetic.toml"), help=CONFIG_HELP),
    budget: float = typer.Option(300.0, "--budget", help="Wall-clock seconds of training per mode."),
    eval_every: int = typer.Option(2, "--eval-every", help="Held-out eval every N steps."),
    out: Path = typer.Option(Path("runs/bench-e2e"), "--out", help="Where the two runs go."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Async (max_staleness >= 1) vs sync (max_staleness = 0) on the same config and budget."""
    cfg = load_or_exit(config, set_)
    from ..bench.e2e import run_e2e_bench

    report = run_e2e_bench(cfg, budget, out, eval_every, config)
    print(json.dumps(report, indent=None if as_json else 2))


def main() -> None:  # pragma: no cover - console entry
    try:
        app()
    except ConfigError as exc:
        fail(str(exc))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
