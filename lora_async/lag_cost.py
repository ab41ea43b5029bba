"""What a stale sample costs in steps: for each loss, the steps to an accuracy target at policy
lag k over the steps at lag 0, as `lora-async bench staleness` measured them.

`buffer.mode = "auto"` weighs each staleness it could run at by this ratio: an async step that
trains `r` times fewer useful steps per step must be `r` times shorter to reach the target as
soon (`mode/`).

The built-in table is the median over the workloads the benchmark ran with 3 paired seeds
(`REPORTS`: bench/results/staleness/; `tests/test_lag_cost.py` recomputes it from them, so the
table cannot drift from the reports). A loss without 3-seed figures takes ppo-clip's, the most
lag-sensitive measured. `buffer.lag_costs` names a report of the user's own (`bench staleness`
on their task) to use instead.

Between measured lags the ratio is interpolated linearly (lag 1: halfway to lag 2), beyond the
last one extrapolated along its last slope; a ratio under 1 (lag helped, within the noise) is
taken as 1, and a larger lag never costs less than a smaller one.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import UserError

# bench/results/staleness/: v2 (lr 1e-4, target 0.5), programs (lr 2e-4, 0.8), reasoning-gym (lr 5e-4, 0.6)
REPORTS = ("v2-seeds.json", "programs-3seeds.json", "rg-3seeds.json")
MIN_SEEDS = 3
FALLBACK_LOSS = "ppo-clip"
# loss -> {lag: steps at that lag / steps at lag 0}; the medians over REPORTS (3 seeds each)
BUILTIN: dict[str, dict[int, float]] = {
    "m2po": {0: 1.0, 2: 1.1538, 4: 1.0353},
    "ppo-clip": {0: 1.0, 2: 1.1538, 4: 1.4615},
    "topr": {0: 1.0, 2: 1.188, 4: 1.1538},
}


class LagCostError(UserError, ValueError):
    """A `buffer.lag_costs` report that cannot be read or has no row for the run's loss."""


@dataclass(frozen=True)
class LagCosts:
    """Steps-to-target ratios by lag for one loss, and where they came from."""

    loss: str
    ratios: dict[int, float]  # measured lags (0 included) -> ratio
    source: str

    def at(self, lag: int) -> float:
        """The ratio at `lag` (interpolated, monotone, at least 1)."""
        points = sorted(self.ratios.items())
        if lag <= points[0][0]:
            cost = points[0][1]
        else:
            for (k0, r0), (k1, r1) in zip(points, points[1:]):
                if lag <= k1:
                    break
            cost = r0 + (r1 - r0) * (lag - k0) / (k1 - k0)  # past the last lag: along the last slope
        floor = max((r for k, r in points if k <= lag), default=1.0)  # a larger lag never costs less
        return round(max(cost, floor, 1.0), 4)

    def describe(self, lags: list[int]) -> str:
        return ", ".join(f"k{k} {self.at(k):.2f}x" for k in lags) + f" ({self.source})"


def builtin(loss: str) -> LagCosts:
    if loss in BUILTIN:
        return LagCosts(loss, BUILTIN[loss], f"bench staleness, {loss}, 3 seeds on {len(REPORTS)} workloads")
    return LagCosts(loss, BUILTIN[FALLBACK_LOSS], f"{loss} not measured with 3 seeds: {FALLBACK_LOSS}'s, the "
                                                  "most lag-sensitive measured")


def ratios_of_report(report: dict[str, Any], loss: str, min_seeds: int = 1) -> dict[int, float]:
    """loss -> {lag: steps_over_k0} of one `bench staleness` report (`staleness_report.py`),
    the lags whose arms reached the target on enough seeds."""
    table = report.get("table", {}).get(loss, {})
    out: dict[int, float] = {}
    for lag, row in table.items():
        ratio = row.get("steps_over_k0")
        if ratio is not None and int(row.get("seeds", 0)) >= min_seeds:
            out[int(lag)] = float(ratio)
    return out


def from_reports(paths: list[Path], min_seeds: int = MIN_SEEDS) -> dict[str, dict[int, float]]:
    """The table from reports: per loss and lag, the median over the reports that measured it."""
    by_loss: dict[str, dict[int, list[float]]] = {}
    for path in paths:
        report = json.loads(path.read_text())
        for loss in report.get("table", {}):
            for lag, ratio in ratios_of_report(report, loss, min_seeds).items():
                by_loss.setdefault(loss, {}).setdefault(lag, []).append(ratio)
    return {loss: {lag: round(statistics.median(values), 4) for lag, values in sorted(lags.items())}
            for loss, lags in sorted(by_loss.items()) if 0 in lags and len(lags) > 1}


def load(path: str | None, loss: str) -> LagCosts:
    """The run's table: the built-in one, or the loss's row of the report at `path`."""
    if path is None:
        return builtin(loss)
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise LagCostError(f"buffer.lag_costs: cannot read {path}: {exc}") from exc
    ratios = ratios_of_report(report, loss)
    if 0 not in ratios or len(ratios) < 2:
        raise LagCostError(f"buffer.lag_costs: {path} has no steps-to-target at lag 0 and another lag for "
                           f"loss.type = {loss!r} (run `lora-async bench staleness --losses {loss}`)")
    return LagCosts(loss, ratios, f"{Path(path).name}, {loss}")
