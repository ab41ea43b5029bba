"""One training step's parts that every learner shares: what its micro-batches add up to
(`Accumulated`), the update it applies (`Update`, at the learning rate `lr_scale` sets for it,
`scaled_lr`), and what it reports (`StepStats`, `step_stats`).

`Learner` runs a step on one process; `ParallelLearner` runs it on data-parallel ranks and
puts the ranks' parts together with these same pieces.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..buffer import TrainSample
from ..loss import LossStats


@dataclass
class StepStats:
    adapter: str
    version: int  # after the step
    updated: bool
    skipped_nonfinite: bool
    loss: float
    grad_norm: float
    samples: int
    tokens_trained: int
    padded_tokens: int
    micro_batches: int
    loss_stats: LossStats = field(default_factory=LossStats)
    seconds: float = 0.0
    lr_scale: float = 1.0
    # the process's CPU seconds over the step (every thread): in a sync step, where the engine
    # is idle, the cores the learner keeps busy are cpu_s / seconds (the row's learner_cpu_s)
    cpu_s: float = 0.0


@dataclass
class Accumulated:
    """What some micro-batches of a step added up to; their gradients stay in the params."""

    loss_sum: float = 0.0
    padded_tokens: int = 0
    stats: LossStats = field(default_factory=LossStats)

    def merge(self, other: "Accumulated") -> None:
        self.loss_sum += other.loss_sum
        self.padded_tokens += other.padded_tokens
        self.stats.merge(other.stats)


@dataclass
class Update:
    grad_norm: float = 0.0
    updated: bool = False
    nonfinite: bool = False
    lr_scale: float = 1.0  # what the step's learning rate was multiplied by (`learner.lr_scale`)


def lr_scale(setting: str, stats: LossStats) -> float:
    """The step's learning-rate factor: sqrt of the ESS fraction of its sequence ratios for
    `learner.lr_scale = "ess"` (VCPO, arXiv 2602.17616: a step whose samples the learner has moved
    away from says less, so it moves less), else 1."""
    if setting != "ess":
        return 1.0
    ess = stats.ess_frac
    return 1.0 if ess is None or not math.isfinite(ess) else math.sqrt(ess)


def step_stats(adapter: str, version: int, samples: list[TrainSample], total_tokens: int, micro_batches: int,
               part: Accumulated, update: Update, started: float, cpu_started: float) -> StepStats:
    return StepStats(
        adapter=adapter, version=version, updated=update.updated, skipped_nonfinite=update.nonfinite,
        loss=part.loss_sum / total_tokens if total_tokens else 0.0, grad_norm=update.grad_norm,
        samples=len(samples), tokens_trained=total_tokens, padded_tokens=part.padded_tokens,
        micro_batches=micro_batches, loss_stats=part.stats, seconds=time.perf_counter() - started,
        lr_scale=update.lr_scale, cpu_s=time.process_time() - cpu_started,
    )


@contextlib.contextmanager
def scaled_lr(optimizer: torch.optim.Optimizer, scale: float) -> Iterator[None]:
    """The optimizer's learning rates times `scale` for one step, then as they were (a
    checkpoint saves the configured rate, not a step's)."""
    if scale == 1.0:
        yield
        return
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * scale
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, rates):
            group["lr"] = lr
