"""What a step reports by lag: each trained token's lag bucket, and the figures of each bucket.

A token's lag is the learner's version when it trains minus the version that sampled it; the
buckets are 0, 1, 2 and 3+ (`LAG_BUCKETS`). Per bucket and step (`LagStats.figures`, in the
step row as `lag0/clip_frac`, `lag3+/ess_frac`, ...):

- `tokens`: trained tokens;
- `clip_frac`: the share the loss clipped, truncated or masked (`loss.py` says which, per loss);
- `log_ratio_sq`: the mean (log π/μ)², the second moment M2PO bounds;
- `ess_frac`: (Σw)² / (B·Σw²) over the bucket's B sequences, w = a sequence's ratio
  exp(Σ_t log π/μ), each sequence in the bucket of its oldest token;
- `adv_pos`, `adv_neg`: the mean advantage of its samples with A > 0 and with A < 0.

`run_averages` turns a run's step rows into the summary's averages. Kept free of torch: the
summary and the benchmarks read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

LAG_BUCKETS = (0, 1, 2, 3)  # a token's lag, with 3 standing for 3 or more
FIGURES = ("tokens", "clip_frac", "log_ratio_sq", "ess_frac", "adv_pos", "adv_neg")
TOKEN_WEIGHTED = ("clip_frac", "log_ratio_sq")  # averaged over a run by tokens; the rest by steps


def bucket_name(bucket: int) -> str:
    """`lag0` ... `lag3+`: the prefix of a bucket's keys in step rows and the summary."""
    return f"lag{bucket}" + ("+" if bucket == LAG_BUCKETS[-1] else "")


BUCKET_NAMES = tuple(bucket_name(b) for b in LAG_BUCKETS)


def ess_fraction(log_weights: list[float]) -> float | None:
    """(Σw)² / (B·Σw²) of B sequence weights w = exp(log_weight): 1 when all are equal, 1/B when
    one dominates. Scale-free, so computed from log w − max log w (a long sequence's ratio
    overflows a float). None for no sequence."""
    if not log_weights:
        return None
    top = max(log_weights)
    w = [math.exp(lw - top) for lw in log_weights]
    return sum(w) ** 2 / (len(w) * sum(x * x for x in w))


@dataclass
class LagStats:
    """What one lag bucket of a step held."""

    tokens: int = 0
    dropped: int = 0  # clipped, truncated or masked
    log_ratio_sq_sum: float = 0.0
    seq_log_weights: list[float] = field(default_factory=list)  # Σ_t log r of each sequence
    positive: int = 0  # samples with A > 0 ...
    positive_adv_sum: float = 0.0
    negative: int = 0  # ... and with A < 0
    negative_adv_sum: float = 0.0

    def merge(self, other: "LagStats") -> None:
        self.tokens += other.tokens
        self.dropped += other.dropped
        self.log_ratio_sq_sum += other.log_ratio_sq_sum
        self.seq_log_weights.extend(other.seq_log_weights)
        self.positive += other.positive
        self.positive_adv_sum += other.positive_adv_sum
        self.negative += other.negative
        self.negative_adv_sum += other.negative_adv_sum

    def add_sequence(self, log_weight: float, advantage: float) -> None:
        self.seq_log_weights.append(log_weight)
        if advantage > 0:
            self.positive += 1
            self.positive_adv_sum += advantage
        elif advantage < 0:
            self.negative += 1
            self.negative_adv_sum += advantage

    def figures(self) -> dict[str, float | int | None]:
        """The bucket's figures (`FIGURES`; a mean over nothing is None)."""
        return {"tokens": self.tokens, "clip_frac": self.dropped / self.tokens if self.tokens else None,
                "log_ratio_sq": self.log_ratio_sq_sum / self.tokens if self.tokens else None,
                "ess_frac": ess_fraction(self.seq_log_weights),
                "adv_pos": self.positive_adv_sum / self.positive if self.positive else None,
                "adv_neg": self.negative_adv_sum / self.negative if self.negative else None}


def row_figures(by_lag: dict[int, LagStats]) -> dict[str, float | int | None]:
    """`lag0/tokens`, `lag0/clip_frac`, ... for each bucket that held tokens."""
    return {f"{bucket_name(bucket)}/{key}": value for bucket in sorted(by_lag)
            for key, value in by_lag[bucket].figures().items()}


def run_averages(rows: Iterable[dict[str, Any]]) -> dict[str, float | int]:
    """Each bucket's figures over a run's step rows: `tokens` summed, `clip_frac` and
    `log_ratio_sq` weighted by the tokens of each step, the rest the mean over the steps that
    had them."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for row in rows:
        for name in BUCKET_NAMES:
            tokens = row.get(f"{name}/tokens")
            if not tokens:
                continue
            sums[f"{name}/tokens"] = sums.get(f"{name}/tokens", 0) + tokens
            for key in FIGURES[1:]:
                value = row.get(f"{name}/{key}")
                if value is None:
                    continue
                weight = tokens if key in TOKEN_WEIGHTED else 1
                sums[f"{name}/{key}"] = sums.get(f"{name}/{key}", 0.0) + weight * value
                weights[f"{name}/{key}"] = weights.get(f"{name}/{key}", 0.0) + weight
    return {key: (int(total) if key.endswith("/tokens") else total / weights[key]) for key, total in sums.items()}
