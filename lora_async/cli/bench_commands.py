"""`lora-async bench ...`: the benchmarks whose figures go to bench/RESULTS.md."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from .common import CONFIG_HELP, SET_HELP, fail, load_or_exit

bench_app = typer.Typer(help="Benchmarks (figures go to bench/RESULTS.md).", no_args_is_help=True)


@bench_app.callback()
def quiet() -> None:
    """Benchmarks print their figures; the libraries' start-up chatter is hidden (see quiet.py)."""
    from ..quiet import quiet_start

    quiet_start(engine_log=False)


SYNC_TRANSPORTS = ("inproc", "peft-dir-disk", "peft-dir-devshm", "full-reload", "torch-copy", "shm", "gloo",
                   "http", "cuda-ipc", "nccl")  # the CLI's list, without importing the bench (torch); see bench/sync.py


@bench_app.command("sync")
def bench_sync(
    transport: str = typer.Option(
        "local", "--transport",
        help="'local' (in-process engine paths and the plain torch-copy floor), 'all', or a comma list of: " + ", ".join(SYNC_TRANSPORTS)),
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
    budget: float = typer.Option(300.0, "--budget", help="Wall-clock seconds of training per run."),
    modes: str = typer.Option("sync,async,async-partial,auto", "--modes",
                              help="Comma list of: sync, async, async-partial, auto."),
    seeds: str = typer.Option("0,1", "--seeds", help="Comma list of seeds; every mode runs each."),
    save_every: int = typer.Option(1, "--save-every", min=1,
                                   help="Save the adapter every N steps; all are scored after the runs, off the clock."),
    out: Path = typer.Option(Path("runs/bench-e2e"), "--out",
                             help="Where the runs go; runs finished there with the same config are kept "
                                  "(timed when they ran: use a fresh directory to time modes side by side)."),
    target: float = typer.Option(0.5, "--target", help="Held-out accuracy (success rate) whose time is reported."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """The modes side by side (sync, async, async with partial rollouts, auto), each at every seed,
    on the same config and budget; held-out accuracy scored afterwards from saved adapters."""
    from ..bench.e2e import MODES

    chosen = [m for m in modes.split(",") if m]
    unknown = sorted(set(chosen) - set(MODES))
    if unknown or not chosen:
        fail(f"--modes: unknown {', '.join(unknown) or '(none given)'} (choose from {', '.join(MODES)})")
    try:
        seed_list = [int(s) for s in seeds.split(",")]
    except ValueError:
        fail("--seeds: give integers like '0,1'")
    cfg = load_or_exit(config, set_)
    from ..bench.e2e import headline_table, run_e2e_bench, split_table

    report = run_e2e_bench(cfg, budget, out, chosen, seed_list, save_every, config, target,
                           log=lambda line: typer.echo(line, err=True))
    print(json.dumps(report, indent=None if as_json else 2))
    typer.echo(f"\n{headline_table(report)}\n\nwhere the time went (also in {out / 'time_split.md'}):\n"
               f"{split_table(report)}", err=True)


@bench_app.command("staleness")
def bench_staleness(
    config: Path = typer.Argument(..., help=CONFIG_HELP),
    losses: str = typer.Option("ppo-clip,m2po,cispo,topr", "--losses",
                               help="Comma list of loss types (ppo-clip, tis, decoupled, none, m2po, cispo, topr); "
                                    "append +ess for learner.lr_scale = 'ess' (m2po+ess)."),
    lags: str = typer.Option("0,2,4", "--lags", help="Comma list of fixed lags k (0 = sync)."),
    seeds: str = typer.Option("0", "--seeds", help="Comma list of seeds; every arm runs each, paired."),
    steps: int = typer.Option(16, "--steps", min=1, help="Learner steps per arm."),
    target: float = typer.Option(0.5, "--target", help="Held-out accuracy whose steps and time are reported."),
    eval_every: int = typer.Option(1, "--eval-every", min=1,
                                   help="Save (and afterwards score) the adapter every N steps."),
    out: Path = typer.Option(Path("runs/bench-staleness"), "--out",
                             help="Where the arms go; arms finished there with the same config are kept."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """Every loss at a fixed lag k (the generator held k versions behind the learner) and at
    k = 0, with paired seeds, in one process on one engine; held-out accuracy scored afterwards.
    Reports steps and time to the target per loss and k, the figures by lag, and a chart."""
    from ..bench.staleness import BenchError, parse_losses, run_staleness_bench
    from ..bench.staleness_report import diagnostics_markdown, markdown

    try:
        loss_list = parse_losses(losses)
        lag_list = sorted({int(k) for k in lags.split(",") if k.strip()})
        seed_list = [int(s) for s in seeds.split(",") if s.strip()]
    except BenchError as exc:
        fail(str(exc))
    except ValueError:
        fail("--lags and --seeds: give integers like '0,2,4'")
    if not lag_list or min(lag_list) < 0 or not seed_list:
        fail("--lags and --seeds: give at least one of each, lags >= 0")
    cfg = load_or_exit(config, set_)
    try:
        result = run_staleness_bench(cfg, loss_list, lag_list, seed_list, steps, target, out, eval_every,
                                     log=lambda line: typer.echo(line, err=True))
    except BenchError as exc:
        fail(str(exc))
    typer.echo(f"\n{markdown(result)}\n\n{diagnostics_markdown(result)}\n\nreport: {out / 'report.json'}, "
               f"table: {out / 'table.md'}, chart: {out / 'staleness.png'}", err=True)


@bench_app.command("rewards")
def bench_rewards(
    groups: int = typer.Option(48, "--groups", min=1, help="Groups scored in all."),
    n: int = typer.Option(8, "--n", min=1, help="Completions per group."),
    in_flight: int = typer.Option(8, "--in-flight", min=1, help="Groups scored at a time (producers)."),
    median_s: float = typer.Option(0.4, "--median-s", min=0.0, help="Median seconds of one reward call."),
    sigma: float = typer.Option(1.0, "--sigma", min=0.0, help="Lognormal sigma of the call time."),
    reps: int = typer.Option(3, "--reps", min=1, help="Repetitions (sides alternate; medians reported)."),
    baseline: Path = typer.Option(None, "--baseline", help="A checkout of an older commit to score beside this "
                                                           "code (e.g. a git worktree)."),
    baseline_reps: int = typer.Option(1, "--baseline-reps", min=1, help="Repetitions of the (slow) baseline."),
) -> None:
    """Samples scored per second by a slow reward (lognormal sleep), and each group's reward wait
    against its slowest call; beside a baseline checkout with --baseline."""
    from ..bench.rewards import run_rewards_bench

    if baseline is not None and not (baseline / "lora_async").is_dir():
        fail(f"--baseline {baseline}: no lora_async package there")
    report = run_rewards_bench(groups, n, in_flight, median_s, sigma, reps, baseline.resolve() if baseline else None,
                               baseline_reps)
    print(json.dumps(report, indent=2))


@bench_app.command("sandbox")
def bench_sandbox(
    calls: int = typer.Option(100, "--calls", min=1, help="Sequential print(1) runs per round and isolation."),
    concurrency: int = typer.Option(48, "--concurrency", min=1, help="Callers at once for the throughput."),
    per_thread: int = typer.Option(4, "--per-thread", min=1, help="Calls per caller in the throughput test."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Rounds (the isolations alternate; medians reported)."),
) -> None:
    """The namespaced runner's cost beside the process runner: p50/p95 of a print(1) run, and
    calls per second with --concurrency callers at once."""
    from ..bench.sandbox_cost import run_sandbox_bench
    from ..sandbox import SandboxUnavailable

    try:
        report = run_sandbox_bench(calls, concurrency, per_thread, rounds)
    except SandboxUnavailable as exc:
        fail(str(exc))
    print(json.dumps(report, indent=2))


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


@bench_app.command("ray")
def bench_ray(
    replicas: str = typer.Option("1,2,4", "--replicas", help="Replica counts for the publish latency rows."),
    versions: int = typer.Option(12, "--versions", help="Versions published per replica count."),
    rank: int = typer.Option(8, "--rank", help="LoRA rank (all linear layers)."),
    prompts: int = typer.Option(64, "--prompts", help="Concurrent prompts per throughput round."),
    tokens: int = typer.Option(64, "--tokens", help="Sampled tokens per prompt."),
    reps: int = typer.Option(3, "--reps", help="Throughput rounds per configuration (median reported)."),
    model: str = typer.Option("smollm2-135m", "--model", help="Model name or directory."),
) -> None:
    """Ray replicas on this machine: publish latency to N replicas, and tokens/s of one engine
    against one replica per core."""
    from ..generator.ray import RayError, require_ray

    try:
        require_ray()
        counts = [int(n) for n in replicas.split(",")]
    except RayError as exc:
        fail(str(exc))
    except ValueError:
        fail("--replicas: give integers like '1,2,4'")
    from ..bench.replicas import run_ray_bench

    console = Console(stderr=True)
    report = run_ray_bench(model, counts, versions, rank, prompts, tokens, reps, log=console.print)
    print(json.dumps(report, indent=2))
