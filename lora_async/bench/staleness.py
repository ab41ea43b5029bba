"""`lora-async bench staleness`: how much a stale sample teaches, per loss, at a controlled lag.

An *arm* is one (loss, lag k, seed). At k = 0 it trains synchronously; at k > 0 the generator
is held k versions behind the learner (`buffer.fixed_lag`), so every sample trains exactly k
versions after the one that drew it (the first k steps train on version 0, the only one there
is). Arms differ in nothing else: seeds are paired, so every arm of a seed draws the same
prompts in the same order, starts from the same LoRA weights, and samples with the same seeds
(`rollout.sub_seed`), so at step 1 every arm of a seed trains on the same groups.

All arms run in this process on one engine and one learner (`shared.SharedParts`): an arm costs
its training, not a model load and an engine start. Each saves its adapter after every
`eval_every` steps, stamped with its step and training clock; after the last arm, the engine
is closed and every snapshot is scored greedily on the task's held-out problems (at least 100
for a figure worth reading) on one evaluation engine in a process of its own, off every clock
(`snapshots.py`).

Per arm the report gives the steps and the training time to the target accuracy, its peak, and
whether it collapsed (an eval more than `COLLAPSE_DROP` below its own best so far, within twice
its steps to the target); per (loss, k) the median, min and max of those over seeds, the ratio
of the median steps to k = 0's, and the figures by lag (`lag_figures.py`) averaged over the arm's
steps. One chart: held-out accuracy against step, one panel per loss, one line per k.

Arms already finished in `--out` with the same config are kept (not rerun), and snapshots
already scored are not scored again, so a screen with one seed can be confirmed with three by
running the same command with more seeds.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..config import LOSS_TYPES, TrainConfig, dump_config, loss_of
from ..lag_figures import BUCKET_NAMES
from ..metrics import read_metrics

COLLAPSE_DROP = 0.2  # an eval this far below the arm's best so far is a collapse
MIN_HELDOUT = 100  # fewer held-out problems than this: one problem moves accuracy by over 1%
ESS_SUFFIX = "+ess"  # `--losses m2po+ess`: that loss with learner.lr_scale = "ess"


class BenchError(ValueError):
    """A benchmark that cannot run as asked (the message says why, in one line)."""


@dataclass(frozen=True)
class Arm:
    """One run of the benchmark."""

    loss: str  # a loss type, with ESS_SUFFIX for lr_scale = "ess"
    lag: int
    seed: int

    @property
    def loss_type(self) -> str:
        return self.loss.removesuffix(ESS_SUFFIX)

    @property
    def lr_scale(self) -> str:
        return "ess" if self.loss.endswith(ESS_SUFFIX) else "none"

    @property
    def name(self) -> str:
        """Its directory and adapter name: `m2po-ess-k2-s0`."""
        return f"{self.loss.replace('+', '-')}-k{self.lag}-s{self.seed}"


def parse_losses(text: str) -> list[str]:
    losses = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [loss for loss in losses if loss.removesuffix(ESS_SUFFIX) not in LOSS_TYPES]
    if not losses or unknown:
        raise BenchError(f"--losses: unknown {', '.join(unknown) or '(none given)'} "
                         f"(choose from {', '.join(LOSS_TYPES)}, each optionally with {ESS_SUFFIX})")
    return losses


def arms_of(losses: list[str], lags: list[int], seeds: list[int]) -> list[Arm]:
    """Seed by seed, so an interrupted benchmark has whole comparisons for the seeds it finished."""
    return [Arm(loss, lag, seed) for seed in seeds for loss in losses for lag in lags]


def check_base(config: TrainConfig) -> None:
    """What every arm needs of the config it is built from."""
    if config.adapters is not None:
        raise BenchError("adapters: the benchmark trains one adapter per arm; give a single-adapter config")
    if config.generator.type != "vllm" or config.generator.engine_home != "same":
        raise BenchError('generator: arms share an in-process engine (generator.type = "vllm", '
                         'engine_process = "same")')
    if config.learner.devices is not None and len(config.learner.devices) > 1:
        raise BenchError("learner.devices: arms share one learner; a data-parallel learner is not supported")


def arm_config(base: TrainConfig, arm: Arm, steps: int, eval_every: int, out: Path) -> TrainConfig:
    """`base` as one arm trains it. The loss keeps the base's settings when it is the base's type
    (and the base's kl_coef in any case); the buffer is sync at k = 0 and at a fixed lag k above."""
    cfg = base.model_copy(deep=True)
    cfg.adapter.name = arm.name
    settings = base.loss.model_dump(exclude={"type"}) if base.loss.type == arm.loss_type else {}
    cfg.loss = loss_of(arm.loss_type, **{**settings, "kl_coef": base.loss.kl_coef})
    cfg.learner.lr_scale = arm.lr_scale  # type: ignore[assignment]
    cfg.buffer.partial_rollouts = False
    if arm.lag == 0:
        cfg.buffer.fixed_lag = None
        cfg.buffer.mode = "sync"
        cfg.buffer.max_staleness = 0
    else:
        cfg.buffer.fixed_lag = None  # set last: each assignment is validated against the others
        cfg.buffer.mode = "async"
        cfg.buffer.max_staleness = arm.lag
        cfg.buffer.fixed_lag = arm.lag
    run = cfg.run
    run.seed, run.max_steps, run.time_budget_s = arm.seed, steps, None
    run.output_dir = str(out / arm.name)
    run.save_every, run.eval_every = eval_every, 0
    run.eval_at_start = run.eval_at_end = False
    run.progress, run.chart_every = False, 0
    return TrainConfig.model_validate(json.loads(dump_config(cfg)))  # the cross-field checks, once more


def widest(base: TrainConfig, lags: list[int], out: Path) -> TrainConfig:
    """The config the shared engine and learner are built from: the widest window of any arm."""
    return arm_config(base, Arm(LOSS_TYPES[0], max(lags), 0), 1, 1, out)


def finished(cfg: TrainConfig) -> bool:
    """An arm whose directory holds a finished run of exactly this config."""
    out = Path(cfg.run.output_dir)
    summary, saved = out / "summary.json", out / "config.json"
    if not (summary.is_file() and saved.is_file()):
        return False
    return json.loads(summary.read_text()).get("ended") == "done" and saved.read_text() == dump_config(cfg)


def train_arms(base: TrainConfig, arms: list[Arm], steps: int, eval_every: int, out: Path,
               log: Callable[[str], None]) -> list[Path]:
    """Train every arm not already finished, one after the other, on one engine and learner."""
    from rich.console import Console

    from ..orchestrator import TrainingError, train
    from .shared import SharedParts

    configs = {arm: arm_config(base, arm, steps, eval_every, out) for arm in arms}
    todo = [arm for arm in arms if not finished(configs[arm])]
    for arm in arms:
        if arm not in todo:
            log(f"[{arm.name}] kept: finished earlier with this config")
    if todo:
        console = Console(stderr=True, quiet=True)
        shared = SharedParts(widest(base, [a.lag for a in arms], out), console, out)
        try:
            for i, arm in enumerate(todo, 1):
                cfg = configs[arm]
                shutil.rmtree(cfg.run.output_dir, ignore_errors=True)
                log(f"[{arm.name}] training {steps} steps ({i}/{len(todo)})")
                try:
                    summary = asyncio.run(train(cfg, console=console, parts=shared.arm(cfg)))
                except TrainingError as exc:  # what fails one arm would fail the next: stop here
                    raise BenchError(f"{arm.name} failed: {exc} (its run: {cfg.run.output_dir}); the arms "
                                     "finished before it are kept: run the same command to go on") from None
                if summary.get("ended") != "done":  # Ctrl-C or SIGTERM: the arm stopped after a step
                    raise BenchError(f"stopped during {arm.name} ({summary.get('ended')}); the arms finished "
                                     "before it are kept: run the same command to go on")
                log(f"[{arm.name}] done in {summary['wall_s']:.0f} s of training")
        finally:
            shared.close()
    return [Path(configs[arm].run.output_dir) for arm in arms]


def score(base: TrainConfig, run_dirs: list[Path], out: Path, log: Callable[[str], None]) -> None:
    """Score the snapshots of every run not scored yet, on one evaluation engine in a process of
    its own (this one still holds the training engine's memory, which vLLM counts against a new
    engine's KV cache)."""
    import sys

    from .proc import last_error, run_logged

    todo = [d for d in run_dirs if not (d / "eval.json").is_file()]
    if not todo:
        return
    scoring = base.model_copy(deep=True)
    if scoring.task.type == "env":
        scoring.task.tool_latency = None  # scoring measures accuracy, not time
    config_file, score_log = out / "scoring.json", out / "scoring.log"
    config_file.write_text(dump_config(scoring))
    log(f"scoring the snapshots of {len(todo)} arms off the clock ({score_log})")
    done = run_logged([sys.executable, "-m", "lora_async.bench.snapshots", "--config", str(config_file),
                       *map(str, todo)], score_log)
    if done.returncode != 0:
        raise BenchError(f"scoring failed (see {score_log}): {last_error(score_log)}")


# ---------------------------------------------------------------- the report


def arm_figures(run_dir: Path, target: float) -> dict[str, Any]:
    """One arm's curve and figures from its metrics (steps, and the snapshots' eval rows)."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    steps = sorted((r for r in rows if "kind" not in r), key=lambda r: r["step"])
    evals = sorted((r for r in rows if r.get("kind") == "eval"), key=lambda r: r["step"])
    curve = [(int(e["step"]), float(e["accuracy"])) for e in evals]
    reached = next(((s, e) for (s, _), e in zip(curve, evals) if e["accuracy"] >= target), None)
    steps_to_target = reached[0] if reached else None
    time_to_target = reached[1]["wall_s"] if reached else None
    until = [r for r in steps if steps_to_target is None or r["step"] <= steps_to_target]
    clock = until[-1]["wall_s"] if until else 0.0
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "run_dir": str(run_dir), "steps": len(steps), "curve": curve,
        "accuracy_start": curve[0][1] if curve else None, "accuracy_end": curve[-1][1] if curve else None,
        "accuracy_max": max((a for _, a in curve), default=None), "heldout_n": evals[-1].get("n") if evals else None,
        "steps_to_target": steps_to_target, "time_to_target_s": time_to_target,
        "collapsed": collapsed(curve, steps_to_target),
        # throughput up to the target (or the end): after it, flat groups make tokens/s meaningless
        "trained_tokens_per_s": sum(r.get("tokens_trained", 0) for r in until) / clock if clock else None,
        "step_s_mean": clock / len(until) if until else None,
        "policy_lag_mean": statistics.fmean(r["policy_lag_mean"] for r in steps) if steps else None,
        "clip_frac_mean": statistics.fmean(r["clip_frac"] for r in steps) if steps else None,
        "ess_frac_mean": mean_of(steps, "ess_frac"),
        "lr_scale_mean": mean_of(steps, "lr_scale"),
        "by_lag": {key: value for key, value in summary.items() if key.split("/")[0] in BUCKET_NAMES},
    }


def collapsed(curve: list[tuple[int, float]], steps_to_target: int | None) -> bool:
    """An eval more than COLLAPSE_DROP below the best so far, within twice the steps to the
    target (the whole curve when the target was never reached)."""
    horizon = 2 * steps_to_target if steps_to_target is not None else None
    best = float("-inf")
    for step, accuracy in curve:
        if horizon is not None and step > horizon:
            break
        best = max(best, accuracy)
        if accuracy < best - COLLAPSE_DROP:
            return True
    return False


def mean_of(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def spread(values: list[float | None]) -> dict[str, Any]:
    """Median, min and max over seeds; a seed that never reached the target counts as infinitely
    late (the median is None when half or more did not)."""
    reached = sorted(v for v in values if v is not None)
    missing = len(values) - len(reached)
    ordered: list[float] = reached + [float("inf")] * missing
    median = statistics.median(ordered) if ordered else None
    return {"median": None if median is None or median == float("inf") else median,
            "min": reached[0] if reached else None, "max": reached[-1] if reached and not missing else None,
            "reached": f"{len(reached)}/{len(values)}"}


def report(arms: list[Arm], run_dirs: list[Path], target: float) -> dict[str, Any]:
    figures = {arm: arm_figures(d, target) for arm, d in zip(arms, run_dirs)}
    losses = list(dict.fromkeys(a.loss for a in arms))
    lags = sorted({a.lag for a in arms})
    seeds = sorted({a.seed for a in arms})
    table: dict[str, dict[str, Any]] = {}
    for loss in losses:
        per_lag: dict[str, Any] = {}
        for lag in lags:
            mine = [figures[a] for a in arms if a.loss == loss and a.lag == lag]
            per_lag[str(lag)] = {
                "seeds": len(mine),
                "steps_to_target": spread([f["steps_to_target"] for f in mine]),
                "time_to_target_s": spread([f["time_to_target_s"] for f in mine]),
                "accuracy_max": statistics.median(f["accuracy_max"] for f in mine if f["accuracy_max"] is not None)
                if any(f["accuracy_max"] is not None for f in mine) else None,
                "collapsed": sum(f["collapsed"] for f in mine),
                "trained_tokens_per_s": median_of(mine, "trained_tokens_per_s"),
                "clip_frac_mean": median_of(mine, "clip_frac_mean"),
                "ess_frac_mean": median_of(mine, "ess_frac_mean"),
                "by_lag": {key: statistics.median(f["by_lag"][key] for f in mine if key in f["by_lag"])
                           for key in sorted({k for f in mine for k in f["by_lag"]})},
            }
        base = per_lag[str(lags[0])]["steps_to_target"]["median"]
        steps = {(a.lag, a.seed): figures[a]["steps_to_target"] for a in arms if a.loss == loss}
        for lag in lags:
            median = per_lag[str(lag)]["steps_to_target"]["median"]
            per_lag[str(lag)]["steps_over_k0"] = median / base if median is not None and base else None
            per_lag[str(lag)]["paired_over_k0"] = paired_ratios(steps, lag, lags[0], seeds)
        table[loss] = per_lag
    return {"target": target, "losses": losses, "lags": lags, "seeds": seeds, "table": table,
            "arms": {arm.name: figures[arm] for arm in arms}}


def paired_ratios(steps: dict[tuple[int, int], int | None], lag: int, base: int, seeds: list[int]) -> dict[str, Any]:
    """Steps to target at `lag` over those at `base` seed by seed (paired seeds draw the same
    first batch, so the ratio cancels what the seed alone decides), as a `spread`. A seed whose
    base arm never reached the target has no ratio; one whose lagged arm never did is infinitely
    late."""
    ratios = []
    for seed in seeds:
        at_base, at_lag = steps.get((base, seed)), steps.get((lag, seed))
        if at_base:
            ratios.append(None if at_lag is None else at_lag / at_base)
    return spread(ratios)


def median_of(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def markdown(result: dict[str, Any]) -> str:
    """The table for bench/RESULTS.md: a row per loss, a column group per k."""
    lags = result["lags"]

    def cell(value: float | None, fmt: str) -> str:
        return "-" if value is None else fmt.format(value)

    head = "| loss | " + " | ".join(f"k={k}: steps to {result['target']:g}" for k in lags) + " | " + \
        " | ".join(f"k={k}/k={lags[0]}" for k in lags[1:]) + " | clip/mask % (k=" + ",".join(map(str, lags)) + \
        ") | collapsed |"
    lines = [head, "|---" * (1 + len(lags) + len(lags) - 1 + 2) + "|"]
    for loss in result["losses"]:
        row = result["table"][loss]
        steps = []
        for k in lags:
            s = row[str(k)]["steps_to_target"]
            med = cell(s["median"], "{:g}")
            steps.append(f"{med} ({cell(s['min'], '{:g}')}-{cell(s['max'], '{:g}')}, {s['reached']})")
        ratios = [cell(row[str(k)]["steps_over_k0"], "{:.2f}x") + paired_cell(row[str(k)]["paired_over_k0"])
                  for k in lags[1:]]
        clips = ",".join(cell(row[str(k)]["clip_frac_mean"] and 100 * row[str(k)]["clip_frac_mean"], "{:.1f}")
                         for k in lags)
        falls = sum(row[str(k)]["collapsed"] for k in lags)
        lines.append(f"| {loss} | " + " | ".join(steps) + " | " + " | ".join(ratios) + f" | {clips} | {falls} |")
    return "\n".join(lines)


def paired_cell(paired: dict[str, Any]) -> str:
    """`; paired 1.09 (0.88-1.38)`: the seed-by-seed ratios' median and range (none for 1 seed)."""
    if paired["median"] is None or paired["min"] == paired["max"] and paired["reached"].endswith("/1"):
        return ""
    high = "inf" if paired["max"] is None else f"{paired['max']:.2f}"
    return f"; paired {paired['median']:.2f} ({paired['min']:.2f}-{high})"


def diagnostics_markdown(result: dict[str, Any]) -> str:
    """The figures by lag (`lag_figures.py`) of each loss at each k: medians over seeds of each
    arm's average over its steps, for the bucket of its own lag (k = 3 or more: `lag3+`)."""
    lines = ["| loss | k | tokens clipped or masked | mean (log ratio)^2 | ESS fraction | mean A+ | mean A- |",
             "|---|---|---|---|---|---|---|"]
    for loss in result["losses"]:
        for k in result["lags"]:
            figures = result["table"][loss][str(k)]["by_lag"]
            bucket = BUCKET_NAMES[min(k, len(BUCKET_NAMES) - 1)]

            def get(key: str, fmt: str) -> str:
                value = figures.get(f"{bucket}/{key}")
                return "-" if value is None else fmt.format(value)

            lines.append(f"| {loss} | {k} | {get('clip_frac', '{:.2%}')} | {get('log_ratio_sq', '{:.4f}')} | "
                         f"{get('ess_frac', '{:.3f}')} | {get('adv_pos', '{:.2f}')} | {get('adv_neg', '{:.2f}')} |")
    return "\n".join(lines)


def chart(result: dict[str, Any], out: Path) -> Path:
    """Held-out accuracy against step: one panel per loss, one line per k (the median over seeds,
    each seed faint behind it)."""
    import math
    import os

    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses, lags = result["losses"], result["lags"]
    columns = min(len(losses), 3)
    rows = math.ceil(len(losses) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.4 * rows), squeeze=False, sharey=True)
    palette = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    arms = result["arms"]
    for ax, loss in zip(axes.flat, losses):
        for i, lag in enumerate(lags):
            curves = [f["curve"] for name, f in arms.items() if name.startswith(f"{loss.replace('+', '-')}-k{lag}-s")]
            by_step: dict[int, list[float]] = {}
            for curve in curves:
                xs, ys = zip(*curve) if curve else ((), ())
                ax.plot(xs, ys, color=palette[i % len(palette)], alpha=0.25, linewidth=0.8)
                for step, accuracy in curve:
                    by_step.setdefault(step, []).append(accuracy)
            steps = sorted(by_step)
            ax.plot(steps, [statistics.median(by_step[s]) for s in steps], color=palette[i % len(palette)],
                    label=f"k = {lag}", linewidth=1.8)
        ax.axhline(result["target"], color="grey", linestyle=":", linewidth=1)
        ax.set_title(loss)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(losses):]:
        ax.set_visible(False)
    axes[0][0].set_ylabel("held-out accuracy (greedy)")
    axes[0][0].legend(fontsize="small")
    fig.suptitle(f"held-out accuracy by step at a fixed lag k (median of seeds {result['seeds']}, faint: each seed)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run_staleness_bench(base: TrainConfig, losses: list[str], lags: list[int], seeds: list[int], steps: int,
                        target: float, out: Path, eval_every: int = 1,
                        log: Callable[[str], None] = print) -> dict[str, Any]:
    check_base(base)
    arms = arms_of(losses, lags, seeds)
    out.mkdir(parents=True, exist_ok=True)
    run_dirs = train_arms(base, arms, steps, eval_every, out, log)
    score(base, run_dirs, out, log)
    result = report(arms, run_dirs, target)
    result.update(steps=steps, eval_every=eval_every)
    small = sorted({f["heldout_n"] for f in result["arms"].values() if (f["heldout_n"] or 0) < MIN_HELDOUT})
    if small:
        log(f"note: {small} held-out problems; {MIN_HELDOUT} or more make a step to the target worth comparing")
    (out / "report.json").write_text(json.dumps(result, indent=2))
    (out / "table.md").write_text(markdown(result) + "\n\n" + diagnostics_markdown(result) + "\n")
    chart(result, out / "staleness.png")
    return result
