"""Admission: when a producer may start another group of an adapter.

A group started now is sampled on the newest version the generator *serves*, which is
`unpublished` versions behind the learner while a hand-off is on its way, and it will be
trained about `busy + queued // groups_per_step` steps from now (`queued`: every group of the
adapter between admission and the learner). Start it only if that lag stays inside the
staleness window: a group started on a version about to be superseded would only be dropped as
stale. With `max_staleness = 0` producers run only while the learner waits for data and the
generator serves its newest version: synchronous training from the same loop.

`Admission` owns the counts the rule reads, one method per event that changes them; the
producers (`rollouts.py`), the collector (`batches.py`), the learner step (`loop.py`) and the
publisher (`publish.py`) report their events to it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..staleness import Window


def expected_lag(learner_busy: bool, queued_groups: int, groups_per_step: int, unpublished: int = 0) -> int:
    """How many versions behind the learner a group started now will be when it trains."""
    return int(learner_busy) + unpublished + queued_groups // groups_per_step


def may_start(learner_busy: bool, queued_groups: int, groups_per_step: int, window: Window,
              unpublished: int = 0) -> bool:
    """The rule: a new group starts if its expected lag is inside the window."""
    return window.admits(expected_lag(learner_busy, queued_groups, groups_per_step, unpublished))


@dataclass
class Admission:
    """One adapter's groups between admission and the learner, and the version it serves."""

    window: Window  # a run's: the window in force, shared with the buffer (`staleness.WindowInForce`)
    in_flight: int = 0  # started: generating or being scored
    collected: int = 0  # taken into the batch being collected (or waiting to train)
    carried: int = 0  # taken, but left for the next step (they did not fit this one)
    busy: bool = False  # the learner is training this adapter
    published: int = -1  # the newest version the generator serves (-1: none yet)

    # ---- events
    def group_started(self) -> None:
        self.in_flight += 1

    def group_finished(self) -> None:
        """Generated and scored: in the buffer now, or dropped."""
        self.in_flight -= 1

    def batch_holds(self, collected: int, carried: int) -> None:
        """The collector holds `collected` groups for the next step and `carried` for the one after."""
        self.collected, self.carried = collected, carried

    def step_began(self) -> None:
        """The learner took the collected batch."""
        self.busy, self.collected = True, 0

    def step_ended(self) -> None:
        self.busy = False

    def version_published(self, version: int) -> None:
        self.published = version

    # ---- the decision
    def unpublished(self, learner_version: int) -> int:
        """Versions the learner made that the generator does not serve yet (a hand-off on its way;
        a refused version counts until the next one lands, as the generator keeps serving the old)."""
        return max(0, learner_version - self.published)

    def may_start(self, buffered: int, learner_version: int, groups_per_step: int) -> bool:
        """Whether a new group may start, with `buffered` groups of this adapter in the rollout
        buffer and steps taking `groups_per_step` groups from it."""
        queued = self.in_flight + buffered + self.carried + self.collected
        return may_start(self.busy, queued, groups_per_step, self.window, self.unpublished(learner_version))
