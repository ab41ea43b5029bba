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

Per arm the report (`staleness_report.py`) gives the steps and the training time to the target
accuracy, its peak, and whether it collapsed; per (loss, k) the median, min and max of those
over seeds, the steps over k = 0's, and the figures by lag (`lag_figures.py`) averaged over the
arm's steps. One chart: held-out accuracy against step, one panel per loss, one line per k.

Arms already finished in `--out` with the same config are kept (not rerun), and snapshots
already scored are not scored again, so a screen with one seed can be confirmed with three by
running the same command with more seeds.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..config import LOSS_TYPES, TrainConfig, dump_config, loss_of
from .common import finished
from .staleness_report import chart, diagnostics_markdown, markdown, report

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
