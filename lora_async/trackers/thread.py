"""One background thread per tracker, so a slow or failing tracker never stalls a step.

The training loop only puts a row on the tracker's queue (`Tracker.put`). The thread opens the
tracker's run, sends the rows in order, and marks each row sent (`Marks`, kept in
OUT/trackers.json). A resumed run's thread first reads what the tracker's own store holds
(`Backend.held`; the marks where it cannot) and skips every row it already has. A failure is shown
once, at once, and then counted; it is never fatal. A tracker that cannot open its run takes
nothing more. On close the threads send what is left, all within one `DRAIN_S`.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..errors import error_line
from .backends import Backend

DRAIN_S = 60.0  # how long closing waits for a tracker to send what it still holds
Item = tuple[str, tuple[Any, ...]]  # (the backend's method, its arguments)


class Marks:
    """OUT/trackers.json: per tracker, the run it opened (`start`'s answer) and the last step
    sent under each prefix. Rewritten (atomically) after each row a tracker takes."""

    def __init__(self, path: Path, resumed: bool) -> None:
        self.path = path
        self._lock = threading.Lock()
        self.data: dict[str, dict[str, Any]] = {}
        if resumed and path.is_file():
            self.data = json.loads(path.read_text())

    def kept(self, tracker: str) -> dict[str, Any] | None:
        return self.data.get(tracker, {}).get("run")

    def last(self, tracker: str, prefix: str) -> int | None:
        return self.data.get(tracker, {}).get("sent", {}).get(prefix)

    def opened(self, tracker: str, run: dict[str, Any]) -> None:
        with self._lock:
            self.data.setdefault(tracker, {"sent": {}})["run"] = run
            self._write()

    def sent(self, tracker: str, prefix: str, step: int) -> None:
        with self._lock:
            sent = self.data.setdefault(tracker, {"sent": {}}).setdefault("sent", {})
            sent[prefix] = max(step, sent.get(prefix, step))
            self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, self.path)


class Tracker:
    """One tracker's queue and thread. `put` never blocks; `close` drains and finishes."""

    def __init__(self, backend: Backend, marks: Marks, say: Callable[[str], None]) -> None:
        self.backend = backend
        self.name = backend.name
        self.marks = marks
        self.say = say
        self.calls = 0
        self.failures = 0
        self.dead = False  # its run never opened: nothing more is sent
        self.held: dict[str, int] = {}  # the last step the tracker held of each prefix when the thread began
        self._queue: queue.SimpleQueue[Item | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=f"lora-async-{self.name}", daemon=True)
        self._thread.start()

    def put(self, method: str, *args: Any) -> None:
        self._queue.put((method, args))

    def pending(self) -> int:
        return self._queue.qsize()

    def _work(self) -> None:
        kept = self.marks.kept(self.name)
        try:
            self.held = self._held(kept) if kept else {}
            self.marks.opened(self.name, self.backend.start(kept))
        except Exception as exc:
            self.dead = True
            self.say(f"[yellow]{self.name}: could not open the run ({error_line(exc)}); nothing more goes to it, "
                     "the run goes on[/]")
        while (item := self._queue.get()) is not None:
            method, args = item
            if self.dead or (method == "log" and args[2] <= self.held.get(args[0], -1)):
                continue
            if method == "finish":
                self._call(method, args)
                continue
            if self._call(method, args) and method == "log":
                self.marks.sent(self.name, args[0], args[2])

    def _held(self, kept: dict[str, Any]) -> dict[str, int]:
        """What the tracker holds of the kept run: its own store's answer, else the marks."""
        held = self.backend.held(kept)
        return dict(self.marks.data.get(self.name, {}).get("sent", {})) if held is None else held

    def _call(self, method: str, args: tuple[Any, ...]) -> bool:
        self.calls += 1
        try:
            getattr(self.backend, method)(*args)
            return True
        except Exception as exc:
            self.failures += 1
            if self.failures == 1:
                self.say(f"[yellow]{self.name}: {method} failed ({error_line(exc)}); the run goes on, and further "
                         "failures are counted[/]")
            return False

    def stop(self, failed: bool) -> None:
        """Finish the tracker's run after what is queued; the thread then ends."""
        self.put("finish", failed)
        self._queue.put(None)

    def join(self, deadline: float) -> None:
        """Wait for the thread until `deadline` (`time.monotonic`); say what was left or failed."""
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            self.say(f"[yellow]{self.name}: {self.pending()} rows still unsent at the end; left behind[/]")
        elif self.failures:
            self.say(f"[yellow]{self.name}: {self.failures} of {self.calls} calls failed[/]")

    def close(self, failed: bool) -> None:
        self.stop(failed)
        self.join(time.monotonic() + DRAIN_S)
