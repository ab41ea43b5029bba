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
adapters_app = typer.Typer(help="The adapters a run stored: list and export.", no_args_is_help=True)
app.add_typer(adapters_app, name="adapters")

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
    from ..sync.http import ServerError
    from ..sync.transports import TransportError
    from ..tasks import RewardError

    try:
        summary = asyncio.run(run_train(cfg, resume=resume))
    except (TrainingError, ModelError, RewardError, TransportError, ServerError) as exc:
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


SYNC_TRANSPORTS = ("inproc", "peft-dir-disk", "peft-dir-devshm", "full-reload", "shm", "gloo", "http",
                   "cuda-ipc", "nccl")


@bench_app.command("sync")
def bench_sync(
    transport: str = typer.Option(
        "local", "--transport",
        help="'local' (in-process engine paths), 'all', or a comma list of: " + ", ".join(SYNC_TRANSPORTS)),
    versions: int = typer.Option(12, "--versions", help="Successive versions measured per path."),
    rank: str = typer.Option("8", "--rank", help="LoRA rank(s), all linear layers: '8' or '1,8,64'."),
    model: str = typer.Option("smollm2-135m", "--model", help="Model name or directory."),
    cpus: str = typer.Option("0", "--cpus", help="Engine cores ('0', '0-1'; 'all' = no pinning)."),
    as_json: bool = typer.Option(False, "--json", help="Print {\"results\": [...]} as JSON."),
) -> None:
    """Adapter sync per transport: publish time and hot-swap latency (ready -> first token)."""
    from ..bench.sync import ALL, LOCAL, run_sync_bench

    chosen = ALL if transport == "all" else LOCAL if transport == "local" else tuple(transport.split(","))
    unknown = sorted(set(chosen) - set(ALL))
    if unknown:
        fail(f"--transport: unknown {', '.join(unknown)} (choose from {', '.join(ALL)})")
    try:
        ranks = [int(r) for r in rank.split(",")]
    except ValueError:
        fail("--rank: give integers like '8' or '1,8,64'")
    results = run_sync_bench(model, ranks, versions, chosen, console=Console(stderr=True),
                             cpus=None if cpus == "all" else cpus)
    if as_json:
        print(json.dumps({"results": results}))
        return
    from rich.table import Table

    table = Table(title=f"adapter sync, {versions} versions per row")
    for col in ("transport", "rank", "bytes", "publish p50 ms", "swap p50 ms", "swap max ms", "vs full reload"):
        table.add_column(col)
    for row in results:
        if not row["measured"]:
            table.add_row(row["transport"], "-", "-", "not measured", row["why"], "", "")
            continue
        table.add_row(row["transport"], str(row["rank"] or "-"), f"{row['bytes']:,}",
                      f"{row['publish_p50_ms']:.1f}", f"{row['p50_ms']:.1f}", f"{row['max_ms']:.1f}",
                      f"{row['speedup_vs_full']:.0f}x" if row.get("speedup_vs_full") else "-")
    Console().print(table)


@bench_app.command("gen")
def bench_gen(
    prompts: int = typer.Option(64, "--prompts", help="Concurrent prompts per round."),
    tokens: int = typer.Option(64, "--tokens", help="Sampled tokens per prompt."),
    reps: int = typer.Option(3, "--reps", help="Rounds per configuration (median reported)."),
    model: str = typer.Option("smollm2-135m", "--model", help="Model name or directory."),
    cpus: str = typer.Option("all", "--cpus", help="Engine cores ('0', '0-1', 'all')."),
) -> None:
    """Generation tokens/s: base model, LoRA with vLLM's CPU ops, LoRA with the grouped ops."""
    from ..bench.gen import run_gen_bench

    print(json.dumps({"results": run_gen_bench(model, prompts, tokens, reps, None if cpus == "all" else cpus)},
                     indent=2))


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


@app.command()
def plot(
    run_dirs: list[Path] = typer.Argument(..., help="One or more run directories."),
    out: Path = typer.Option(..., "-o", "--out", help="PNG file to write."),
    title: Optional[str] = typer.Option(None, "--title"),
) -> None:
    """Reward, held-out accuracy, policy lag and sync time against wall-clock, one line per run."""
    from ..plot import PlotError, plot_runs

    try:
        path = plot_runs(run_dirs, out, title)
    except PlotError as exc:
        fail(str(exc), code=1)
    Console().print(f"wrote {path}")


@bench_app.command("fleet")
def bench_fleet(
    config: Path = typer.Argument(Path("examples/arithmetic.toml"), help="Base config (model, learner, ...)."),
    k: int = typer.Option(4, "--k", min=1, max=4, help="Adapters in the fleet."),
    steps: int = typer.Option(6, "--steps", help="Learner steps per adapter."),
    out: Path = typer.Option(Path("runs/bench-fleet"), "--out"),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """A K-adapter fleet vs K separate runs: wall-clock and peak-memory ratios."""
    cfg = load_or_exit(config, set_)
    from ..bench.fleet import run_fleet_bench

    print(json.dumps(run_fleet_bench(cfg, k, steps, out), indent=2))


@adapters_app.command("list")
def adapters_list(
    run_dir: Path = typer.Argument(..., help="A run's output directory."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Each adapter with its latest version, step, reward and size."""
    from ..adapters import AdapterStore

    store = AdapterStore(run_dir)
    rows = []
    for name in store.names():
        versions = store.versions(name)
        if not versions:
            continue
        latest = versions[-1]
        rows.append({"adapter": name, "version": latest.version, "versions": len(versions),
                     "step": latest.info.get("step"), "reward": latest.info.get("reward_mean"),
                     "bytes": latest.size_bytes, "path": str(latest.path)})
    if not rows:
        fail(f"{run_dir}: no stored adapters (expected {run_dir}/adapters/<name>/v<k>/)", code=1)
    if as_json:
        print(json.dumps(rows))
        return
    from rich.table import Table

    table = Table(title=f"adapters in {run_dir}")
    for col in ("adapter", "version", "step", "reward", "size", "path"):
        table.add_column(col)
    for r in rows:
        reward = f"{r['reward']:.3f}" if isinstance(r["reward"], (int, float)) else "-"
        table.add_row(r["adapter"], f"v{r['version']}", str(r["step"]), reward,
                      f"{r['bytes'] / 2**20:.1f} MB", r["path"])
    Console().print(table)


@adapters_app.command("export")
def adapters_export(
    run_dir: Path = typer.Argument(..., help="A run's output directory."),
    name: str = typer.Argument(..., help="Adapter name."),
    dest: Path = typer.Argument(..., help="Where to write it (must not exist, or be empty)."),
    version: Optional[int] = typer.Option(None, "--version", help="Version to export (default: latest)."),
    merged: bool = typer.Option(False, "--merged", help="Merge into the base and write a full model."),
) -> None:
    """Write a PEFT adapter directory (or, with --merged, a merged full model)."""
    from ..adapters.export import export_adapter

    try:
        path = export_adapter(run_dir, name, dest, version, merged)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        fail(str(exc), code=1)
    Console().print(f"wrote {'merged model' if merged else 'PEFT adapter'} {name} to {path}")


@app.command()
def serve(
    run_dir: Path = typer.Argument(..., help="A run's output directory."),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    max_model_len: int = typer.Option(1024, "--max-model-len"),
    kv_cache_gb: float = typer.Option(1.0, "--kv-cache-gb", help="KV cache size (CPU)."),
) -> None:
    """vLLM's OpenAI-compatible server: the base model plus every adapter under its plain name."""
    from ..serve import serve as run_server

    try:
        code = run_server(run_dir, host, port, max_model_len, kv_cache_gb)
    except FileNotFoundError as exc:
        fail(str(exc), code=1)
    raise typer.Exit(code)


@app.command("server")
def training_server(
    model: str = typer.Argument("smollm2-135m", help="Model name or local HF directory."),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    max_lora_rank: int = typer.Option(8, "--max-lora-rank"),
    max_loras: int = typer.Option(4, "--max-loras", help="Adapter versions in one batch."),
    max_model_len: int = typer.Option(1024, "--max-model-len"),
    kv_cache_gb: float = typer.Option(1.0, "--kv-cache-gb", help="KV cache size (CPU)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="LORA_ASYNC_API_KEY"),
) -> None:
    """A vLLM server that training runs drive remotely (generator.backend = "server")."""
    from ..serve import serve_for_training

    raise typer.Exit(serve_for_training(model, host, port, max_lora_rank, max_loras, max_model_len,
                                        kv_cache_gb, api_key))


def main() -> None:  # pragma: no cover - console entry
    try:
        app()
    except ConfigError as exc:
        fail(str(exc))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
