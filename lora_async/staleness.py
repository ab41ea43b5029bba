"""The staleness window: how far behind the learner a version may be and still train.

One rule, asked everywhere it matters: what was drawn on version `k` may train at learner
version `v` when `v - k <= max_staleness` (its *lag*). Everything else follows from it:

- the buffer judges a sample by the version it *finished* on (the newest version among its
  trained tokens): it drops (or admits for correction) a group with a sample that finished
  outside the window, and in the samples it admits marks the tokens whose own lag is outside
  it, which the loss importance-corrects token by token (`admits`; see `buffer.py`). A
  sample that spans versions (a turn or completion stopped by a step and continued on the
  newest version) always has tokens one version outside: judged by its oldest token, every
  continuation would be thrown away;
- admission starts a group only if its expected lag when trained is inside (`admits`);
- a learner step aborts the rollouts its new version would leave outside (`oldest`);
- the generator retires a version once it has left the window of the newest (`retirable`);
- the engine sizes its LoRA slots for every version the window keeps live (`engine_slots`);
- Ray replicas keep one version more than the router (`widened`), so a version a request was
  pinned to is still there when the request arrives.

A window of 0 is synchronous training (`synchronous`), and which runs are synchronous is said
once, in `StalenessWindow.widest`: `buffer.mode = "sync"` pins a window of 0, and so does
`max_staleness = 0` whatever the mode. The config, the mode choice and the run ask a window.

A run holds the window in force in one object, `WindowInForce`, that the buffer, every
adapter's admission and the learner step share: a mode switch changes it once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class StalenessWindow:
    max_staleness: int

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    @classmethod
    def widest(cls, mode: str, max_staleness: int) -> "StalenessWindow":
        """The widest window a run with this `buffer.mode` and `buffer.max_staleness` may train
        with: 0 (synchronous) where the mode is sync or max_staleness is 0."""
        return cls(0 if mode == "sync" else max_staleness)

    @property
    def synchronous(self) -> bool:
        return self.max_staleness == 0

    def admits(self, lag: int) -> bool:
        """A sample `lag` versions behind the learner may train."""
        return lag <= self.max_staleness

    def oldest(self, newest: int) -> int:
        """The oldest version still inside the window when `newest` is the current one."""
        return newest - self.max_staleness

    def retirable(self, version: int, newest: int) -> bool:
        """A generator may drop `version` (once drained): nothing will train on it any more."""
        return version < self.oldest(newest)

    @property
    def live_versions(self) -> int:
        """Versions of one adapter the window keeps servable at once."""
        return self.max_staleness + 1

    def engine_slots(self, adapters: int) -> tuple[int, int]:
        """(max_loras, max_cpu_loras) for an engine serving `adapters` adapters: every live
        version of every adapter plus one being published may share a batch; one draining
        version per adapter may stay registered beside them."""
        batch = adapters * self.live_versions + 1
        return batch, batch + adapters

    def widened(self) -> "StalenessWindow":
        """One version more (a Ray replica's window, beside the router's)."""
        return StalenessWindow(self.max_staleness + 1)


class Window(Protocol):
    """What the buffer and admission ask of a window: a fixed one, or a run's `WindowInForce`."""

    def admits(self, lag: int) -> bool: ...


@dataclass
class WindowInForce:
    """The window a run trains with now: the buffer, every adapter's admission and the learner
    step hold this one object, so a mode switch (`orchestrator.auto.apply_choice`) sets it once."""

    current: StalenessWindow

    @property
    def synchronous(self) -> bool:
        return self.current.synchronous

    def admits(self, lag: int) -> bool:
        return self.current.admits(lag)

    def oldest(self, newest: int) -> int:
        return self.current.oldest(newest)
