"""Experiment trackers: where a run's figures go beside OUT/metrics.jsonl (`run.report_to`).

| module        | holds                                                                   |
|---------------|-------------------------------------------------------------------------|
| `backends.py` | TensorBoard, W&B, Trackio and MLflow behind the same four calls; `check_installed` |
| `thread.py`   | one background thread per tracker; the marks a resumed run continues from |

`Trackers` is what the metrics writer holds. Every step row, eval, mode event and the summary
goes to each tracker under the names TensorBoard has always shown: `<adapter>/<key>` for a step
row, `<kind>/<key>` for an event (`<kind>/<adapter>/<key>` in a fleet), with `key` the name in
metrics.jsonl, and `<prefix>/step` beside them (W&B's x-axis for the prefix; what a resumed run
reads back); only numbers are sent. A resumed run reopens each tracker's run and skips the rows
it already holds (a step at or below the last one its store holds under that prefix): so the
tracker has no step twice, and holds the killed attempt's figures for the steps between the
checkpoint and the kill. What a tracker lacks up to the checkpoint (rows still queued for it at
the kill, or written but lost with the process) is sent from metrics.jsonl's kept lines
(`Trackers.replay`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Sequence

from .backends import BACKENDS, RunInfo, check_installed
from .thread import DRAIN_S, Marks, Tracker

__all__ = ["RunInfo", "Trackers", "check_installed", "figures"]


def figures(row: dict[str, Any]) -> dict[str, float]:
    """A row's numbers (booleans and the step itself left out)."""
    return {k: v for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}


class Trackers:
    """The run's trackers: rows go on each one's queue; nothing here waits for a tracker."""

    def __init__(self, names: Sequence[str], info: RunInfo, resumed: bool, say: Callable[[str], None],
                 drain_s: float = DRAIN_S) -> None:
        self.drain_s = drain_s
        self.marks = Marks(info.out_dir / "trackers.json", resumed)
        self.fleet = len(info.adapters) > 1
        self.trackers = [Tracker(BACKENDS[name](info), self.marks, say) for name in names if name != "none"]

    def step(self, row: dict[str, Any]) -> None:
        self._log(row.get("adapter", "main"), row)

    def event(self, row: dict[str, Any]) -> None:
        kind = row.get("kind", "event")
        self._log(f"{kind}/{row['adapter']}" if self.fleet and "adapter" in row else kind, row)

    def _log(self, prefix: str, row: dict[str, Any]) -> None:
        if "step" not in row:
            return
        step, values = int(row["step"]), figures(row)
        for tracker in self.trackers:
            tracker.put("log", prefix, values, step)  # its thread skips what the tracker holds

    def replay(self, rows: list[dict[str, Any]]) -> None:
        """A resumed run's kept metrics.jsonl lines (up to the checkpoint) to each tracker that
        lacks them: rows still queued for a tracker, or not yet written by it, when the run was
        killed. Their steps are not trained again, so nothing else would send them."""
        for row in rows:
            if "kind" in row:
                self.event(row)
            else:
                self.step(row)

    def summary(self, summary: dict[str, Any], step: int) -> None:
        for tracker in self.trackers:
            tracker.put("summary", figures(summary), step)

    def close(self, failed: bool) -> None:
        """Every tracker finishes what it holds, together, within one `drain_s`."""
        for tracker in self.trackers:
            tracker.stop(failed)
        deadline = time.monotonic() + self.drain_s
        for tracker in self.trackers:
            tracker.join(deadline)


def run_info(out_dir: Path, project: str, config: dict[str, Any], adapters: list[str]) -> RunInfo:
    return RunInfo(out_dir=out_dir, project=project, name=out_dir.resolve().name, config=config, adapters=adapters)
