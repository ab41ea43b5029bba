"""Progress where a person waits: building the embedded model, loading a dataset, building the
generator's base for QLoRA, starting the engine, each held-out eval.

`stage(what, total)` is a context manager around the wait. On a terminal it draws a bar (a
spinner when `total` is None) that is cleared at the end and leaves one line; off a terminal
(a log, CI, nohup) it prints exactly two lines, one as the wait begins and one as it ends
("what: done in 12.3 s", or "what: failed after 3.1 s"). While the training bar is live, a stage
joins it as one more row (`Stage.attach`): rich draws one live display at a time.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import Any, Callable

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

from .errors import UserError

Fields = Callable[[float, float | None], dict[str, Any]]  # (completed, total) -> the live display's fields


def run_console() -> Console:
    """The console a run's status lines go to (stderr). On a terminal rich wraps a long line to
    its width; elsewhere (`make demo > log`, CI, nohup) nothing does, so each status line (a
    `mode:` decision with its reasons) stays one line instead of breaking at 80 columns."""
    console = Console(stderr=True)
    console.soft_wrap = not console.is_terminal
    return console


class Stage:
    """One wait, with `advance` as its parts finish (any thread)."""

    def __init__(self, what: str, total: float | None = None, console: Console | None = None,
                 unit: Callable[[float], str] | None = None) -> None:
        self.what = what
        self.total = total
        self.console = console or run_console()
        self.unit = unit
        self.completed = 0.0
        self._lock = threading.Lock()
        self._progress: Progress | None = None
        self._owned = False
        self._task: TaskID | None = None
        self._fields: Fields | None = None
        self._started = 0.0
        self._outcome = ""

    def attach(self, progress: Progress | None, fields: Fields) -> "Stage":
        """Draw as a row of `progress` (a live display already running), with its `fields`."""
        self._progress, self._fields = progress, fields
        return self

    def __enter__(self) -> "Stage":
        self._started = time.perf_counter()
        if self._progress is None and self.console.is_terminal:
            self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                      TextColumn("{task.fields[done]}"), TimeElapsedColumn(), console=self.console,
                                      transient=True)
            self._progress.start()
            self._owned = True
            self._fields = lambda done, _total: {"done": self._amount(done)}
        if self._progress is not None:
            fields = self._fields(0, self.total) if self._fields is not None else {}
            self._task = self._progress.add_task(self.what, total=self.total, **fields)
        else:
            size = f" ({self.unit(self.total)})" if self.unit is not None and self.total is not None else ""
            self.console.print(f"{self.what}{size} ...", highlight=False)
        return self

    def _amount(self, value: float) -> str:
        """`value` of the total, in the stage's unit (the bar's text)."""
        if self.total is None:
            return ""
        if self.unit is None:
            return f"{value:g}/{self.total or 0:g}"
        return f"{self.unit(value)} of {self.unit(self.total or 0)}"

    def set_total(self, total: float) -> None:
        """The total, once known (a stage may start before it is)."""
        with self._lock:
            self.total = total
            if self._progress is not None and self._task is not None:
                fields = self._fields(self.completed, total) if self._fields is not None else {}
                self._progress.update(self._task, total=total, **fields)

    def outcome(self, text: str) -> None:
        """What the wait gave, said on its last line ("eval main: accuracy 0.62, done in 9.1 s")."""
        self._outcome = f"{text}, "

    def phase(self, text: str) -> None:
        """Name the part now running (the bar's text; off a terminal, nothing is printed)."""
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, description=f"{self.what}: {text}")

    def advance(self, amount: float = 1) -> None:
        with self._lock:
            self.completed += amount
            if self._progress is not None and self._task is not None:
                fields = self._fields(self.completed, self.total) if self._fields is not None else {}
                self._progress.update(self._task, completed=self.completed, **fields)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        seconds = time.perf_counter() - self._started
        if self._progress is not None and self._task is not None:
            self._progress.remove_task(self._task)
            if self._owned:
                self._progress.stop()
        if kind is not None and issubclass(kind, UserError):
            return  # its one line says what went wrong
        verdict = "failed after" if kind is not None else "done in"
        outcome = self._outcome if kind is None else ""
        self.console.print(f"{self.what}: {outcome}{verdict} {seconds:.1f} s", highlight=False)


def stage(what: str, total: float | None = None, console: Console | None = None,
          unit: Callable[[float], str] | None = None) -> Stage:
    return Stage(what, total, console, unit)


def gigabytes(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB"
