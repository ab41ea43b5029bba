"""What a guarded call gives back: `CallResult` (a value, or the error the call ended in; never
an exception), and `GuardedError` (the function cannot be used at all)."""

from __future__ import annotations

import dataclasses


class GuardedError(ValueError):
    """The function cannot be used at all (import failure, not callable, no signature)."""


@dataclasses.dataclass(frozen=True)
class CallResult:
    """The result of one call: a value, or an error message (and where it was raised).

    `started`/`ended` are wall-clock times (`time.time()`) of the call itself, as whoever ran it
    saw them; `wait_s` is what the caller waited, from the call to the result, a queue included.
    `exception` is what a call in this process raised (`inprocess.py`); a child's stays there."""

    value: object = None  # what the function returned (from a child: as JSON carried it)
    message: str | None = None  # "ValueError: bad input"; None on success
    location: str | None = None  # "path/to/file.py:12", where the exception was raised
    timed_out: bool = False
    unavailable: bool = False  # no worker could start (the module broke after the first one did)
    started: float | None = None
    ended: float | None = None
    wait_s: float = 0.0
    exception: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.message is None

    @property
    def error(self) -> str | None:
        """The error text with its location, e.g. "TypeError: ... (file.py:3)"."""
        if self.message is None or self.location is None:
            return self.message
        return f"{self.message} ({self.location})"
