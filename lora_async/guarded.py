"""Guarded calls of user functions: a `module:qualname` function run in a child process.

A user function (a reward, a tool) may raise, return junk, print, hang or crash its process;
none of that may take the training run down. `GuardedFunction` owns one child process
(`guarded_worker.py`) that imports the function once and answers calls over JSON lines. Every
failure becomes an `Outcome` with an error text; a call past its timeout kills the child, and
a dead child is started again on the next call.
"""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any, Iterable, Mapping

HELLO_TIMEOUT_S = 60.0  # importing a user module may pull in sympy, numpy, ...; only a hang is this slow
KILL_GRACE_S = 1.0  # a timed-out child gets SIGTERM, then SIGKILL after this; the call lock is held meanwhile
STDERR_TAIL_CHARS = 500  # how much of a dead child's stderr goes into its error message
READ_CHUNK = 65536


def _as_json(obj: Any) -> Any:
    """What JSON carries for an argument it cannot: a dataclass as its fields, a set as a list,
    anything else as its text (an env's `info` may hold arbitrary objects)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    return str(obj)


class GuardedError(ValueError):
    """The function cannot be used at all (import failure, not callable, no signature)."""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The result of one call: a value, or an error message (and where it was raised)."""

    value: Any = None
    message: str | None = None  # "ValueError: bad input"; None on success
    location: str | None = None  # "path/to/file.py:12", where the exception was raised
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.message is None

    @property
    def error(self) -> str | None:
        """The error text with its location, e.g. "TypeError: ... (file.py:3)"."""
        if self.message is None or self.location is None:
            return self.message
        return f"{self.message} ({self.location})"


class GuardedFunction:
    """One user function in one child process; calls are serialised by a lock.

    `extra_paths` go on the child's sys.path after its working directory (the parent's, as
    at construction), so a function in the user's project or next to a test imports."""

    def __init__(self, spec: str, timeout_s: float, extra_paths: Iterable[str] = ()) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        self.extra_paths = list(extra_paths)
        self._cwd = os.getcwd()  # a restart after a chdir must import the same module
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None
        self._buffer = b""
        self._lock = threading.Lock()  # producers call from several threads
        hello = self._start()  # import errors surface now, as a GuardedError
        self.params: tuple[str, ...] = tuple(hello["params"])
        self.required: tuple[str, ...] = tuple(hello["required"])
        self.var_kw: bool = bool(hello["var_kw"])

    def accepted(self, names: Iterable[str]) -> list[str]:
        """Which of `names` the function receives (all of them if it takes **kwargs)."""
        return [n for n in names if self.var_kw or n in self.params]

    def call(self, arguments: Mapping[str, Any] | None = None, /, *, strict: bool = False,
             **kwargs: Any) -> Outcome:
        """Call with keywords: `call(completion=...)`, or `call({...})` for names that could
        clash with `strict` (a tool's arguments, a record's fields). Not strict: keywords the
        function does not take are dropped (the reward rule). Strict: they are an error, as
        are missing ones (the tool rule: the model's mistake, told back to it). Never raises."""
        merged = {**(arguments or {}), **kwargs}
        if not strict:
            merged = {k: v for k, v in merged.items() if self.var_kw or k in self.params}
        with self._lock:
            return self._call(merged)

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _call(self, kwargs: dict[str, Any]) -> Outcome:
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            try:
                self._start()
            except GuardedError as exc:
                return Outcome(message=f"could not restart: {exc}")
        assert self._proc is not None and self._proc.stdin is not None
        try:
            request = json.dumps({"kwargs": kwargs}, default=_as_json)
        except ValueError as exc:  # a circular structure
            return Outcome(message=f"arguments are not JSON: {exc}")
        try:
            self._proc.stdin.write(request.encode() + b"\n")
            self._proc.stdin.flush()
            reply = self._read_line(time.monotonic() + self.timeout_s)
        except (OSError, EOFError, ValueError):  # broken pipe, closed output, a garbled line
            return self._died()
        if reply is None:
            self._kill()
            return Outcome(message=f"timed out after {self.timeout_s:g}s", timed_out=True)
        if "error" in reply:
            return Outcome(message=reply["error"], location=reply.get("where"))
        return Outcome(value=reply.get("value"))

    def _start(self) -> dict[str, Any]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in [self._cwd, env.get("PYTHONPATH", "")] if p)
        self._stderr = tempfile.TemporaryFile()  # a file, not a pipe: a chatty function never blocks on it
        self._buffer = b""
        self._proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "lora_async.guarded_worker", self.spec, *self.extra_paths],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=env, cwd=self._cwd,
            start_new_session=True,  # its own process group, so a kill also ends what it spawned
        )
        try:
            hello = self._read_line(time.monotonic() + HELLO_TIMEOUT_S)
        except (OSError, EOFError, ValueError):
            hello = None
        if hello is None or not hello.get("ready"):
            error = (hello or {}).get("error") or self._stderr_tail() or "the worker exited without a word"
            self._kill()
            raise GuardedError(f"{self.spec} could not be loaded: {error}")
        return hello

    def _died(self) -> Outcome:
        """The child ended mid-call (os._exit, a crash, out of memory): say how, then drop it."""
        assert self._proc is not None
        try:
            code: int | None = self._proc.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            code = None
        message = f"worker died (exit code {code}): {self._stderr_tail() or 'no output'}"
        self._kill()
        return Outcome(message=message)

    def _read_line(self, deadline: float) -> dict[str, Any] | None:
        """The next JSON line from the child, or None at the deadline; EOFError if it closed."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return None
                chunk = os.read(fd, READ_CHUNK)
                if not chunk:
                    raise EOFError("the worker closed its output")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        try:
            self._stderr.seek(0, os.SEEK_END)
            self._stderr.seek(max(0, self._stderr.tell() - STDERR_TAIL_CHARS))
            return self._stderr.read().decode(errors="replace").strip()
        except OSError:
            return ""

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            self._signal(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                self._signal(proc, signal.SIGKILL)
                proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    @staticmethod
    def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)  # the child leads its own group (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass
