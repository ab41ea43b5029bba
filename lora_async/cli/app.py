"""Typer app: `lora-async train | plan | eval | plot | compare | adapters | serve | server | bench`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from ..config import ConfigError
from .bench_commands import bench_app
from .common import CONFIG_HELP, SET_HELP, fail, load_or_exit, warn
from .plan import PLAN_HINT, plan_command

app = typer.Typer(
    name="lora-async",
    help="LoRA-first asynchronous RL trainer: a peft learner and a vLLM multi-LoRA generator.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(bench_app, name="bench")
app.command("plan")(plan_command)
adapters_app = typer.Typer(help="The adapters a run stored: list and export.", no_args_is_help=True)
app.add_typer(adapters_app, name="adapters")


@app.command()
def train(
    config: Optional[Path] = typer.Argument(None, help=CONFIG_HELP),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in run.output_dir from its checkpoint."),
    force: bool = typer.Option(False, "--force", help="Start even when the memory plan says the run will not fit."),
) -> None:
    """Train LoRA adapters with async GRPO-style RL while vLLM keeps generating."""
    cfg = load_or_exit(config, set_)
    from ..api import exit_code, prepare, run

    try:
        prepare(cfg, force, warn=warn, hint=PLAN_HINT)  # seconds, no model: one line and exit 2 on a problem
        run(cfg, resume)
    except KeyboardInterrupt:
        fail("interrupted; the last checkpoint is in run.output_dir (use --resume)", code=130)
    except Exception as exc:
        code = exit_code(exc)
        if code is None:
            raise
        fail(str(exc), code=code)


@app.command("eval")
def eval_cmd(
    config: Optional[Path] = typer.Argument(None, help=CONFIG_HELP),
    adapter: Optional[Path] = typer.Option(None, "--adapter", help="PEFT adapter directory to evaluate."),
    name: Optional[str] = typer.Option(
        None, "--name", help="Fleet configs: whose task to evaluate on (default: taken from the adapter's "
                             "directory OUT/adapters/NAME/..., or every adapter's task for the base model)."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    limit: int = typer.Option(0, "--limit", help="Evaluate only the first N held-out problems (0 = all)."),
) -> None:
    """Greedy accuracy on the task's held-out split, for the base model and for an adapter."""
    cfg = load_or_exit(config, set_)
    from ..quiet import quiet_start

    quiet_start(cfg.run.engine_log)
    from ..preflight import PreflightError, check_model

    try:
        check_model(cfg)
    except PreflightError as exc:
        fail(str(exc), code=2)
    from ..evaluate import run_eval
    from ..models import ModelError

    try:
        report = run_eval(cfg, adapter, limit, name)
    except (ModelError, FileNotFoundError, ValueError) as exc:
        fail(str(exc), code=1)
    if as_json:
        print(json.dumps(report))
        return
    console = Console()
    for row in report["results"]:
        console.print(f"{row['adapter']:<12} {row['model']:<40} accuracy {row['accuracy']:.3f}  (n={row['n']})",
                      highlight=False)


@app.command()
def plot(
    run_dirs: list[Path] = typer.Argument(..., help="One or more run directories."),
    out: Path = typer.Option(..., "-o", "--out", help="PNG file to write."),
    title: Optional[str] = typer.Option(None, "--title"),
    group_seeds: bool = typer.Option(False, "--group-seeds",
                                     help="Runs named NAME-s0, NAME-s1 ... (seeds) share one colour and legend entry."),
) -> None:
    """Reward, held-out accuracy, policy lag and sync time against wall-clock, one line per run."""
    from ..plot import PlotError, plot_runs

    try:
        path = plot_runs(run_dirs, out, title, group_seeds)
    except PlotError as exc:
        fail(str(exc), code=1)
    Console().print(f"wrote {path}")


@app.command()
def compare(
    run_dirs: list[Path] = typer.Argument(..., help="Run directories, or directories of runs (a bench's output)."),
    targets: str = typer.Option("0.5,0.7,0.8", "--targets", help="Held-out accuracy marks to time, comma-separated."),
    plot_to: Optional[Path] = typer.Option(None, "--plot", help="Also draw the held-out curves to this PNG."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON instead of the table."),
) -> None:
    """Runs side by side: the settings that differ, held-out accuracy, time to targets, tokens/s, time split."""
    from ..compare import CompareError, compare_table, figures, plot_compare, read_runs

    try:
        marks = tuple(float(t) for t in targets.split(",") if t.strip())
    except ValueError:
        fail(f"--targets: {targets!r} is not a comma-separated list of numbers", code=2)
    try:
        columns = read_runs(run_dirs)
        if as_json:
            print(json.dumps([figures(c, marks) for c in columns], indent=2))
        else:
            console = Console()
            if not console.is_terminal:  # a log or a pipe: the table whole, not folded to 80 columns
                console = Console(width=max(80, 36 + 22 * len(columns)))
            console.print(compare_table(columns, marks))
        if plot_to is not None:
            Console(stderr=as_json).print(f"wrote {plot_compare(columns, plot_to)}")
    except CompareError as exc:
        fail(str(exc), code=2)


@adapters_app.command("list")
def adapters_list(
    run_dir: Path = typer.Argument(..., help="A run's output directory."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Each adapter with its latest version, step, reward and size."""
    from ..adapters import AdapterStore

    store = AdapterStore(run_dir)
    rows: list[dict[str, Any]] = []
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
    quantization: str = typer.Option(
        "none", "--quantization", help="The run's model.quantization: nf4/int8 serve the learner's quantised base "
                                       "dequantised (generator.base = 'learner'), built once and cached."),
    learner_dtype: str = typer.Option("float32", "--learner-dtype", help="The run's learner compute dtype."),
    learner_device: str = typer.Option("cpu", "--learner-device",
                                       help="Where the run's learner quantises: cpu or cuda."),
) -> None:
    """A vLLM server that training runs drive remotely (generator.type = "server")."""
    from ..serve import serve_for_training

    recipe = None
    if quantization != "none":
        from ..base_recipe import Recipe

        if quantization not in ("nf4", "int8") or learner_dtype not in ("float32", "bfloat16") \
                or learner_device not in ("cpu", "cuda"):
            fail("--quantization takes none, nf4 or int8; --learner-dtype float32 or bfloat16; --learner-device "
                 "cpu or cuda", code=2)
        recipe = Recipe(quantization, learner_dtype, learner_device)
    raise typer.Exit(serve_for_training(model, host, port, max_lora_rank, max_loras, max_model_len,
                                        kv_cache_gb, api_key, recipe=recipe))


def main() -> None:  # pragma: no cover - console entry
    try:
        app()
    except ConfigError as exc:
        fail(str(exc))


if __name__ == "__main__":  # pragma: no cover
    main()
