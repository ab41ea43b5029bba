"""One worker process of a `GuardedPool`, from the parent's side: starting it, its pipes, the
lines it reads and writes (`worker.py` has the protocol), ending it. Scheduling calls onto
workers is the pool's (`pool.py`)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from typing import IO, Any, Mapping

WORKER_MODULE = "lora_async.guarded.worker"
STDERR_TAIL_CHARS = 500  # how much of a dead child's stderr goes into its error message
READ_CHUNK = 65536


def _as_json(obj: object) -> object:
    """What JSON carries for an argument it cannot: a dataclass as its fields, a set as a list,
    anything else as its text (an env's `info` may hold arbitrary objects)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    return str(obj)


def request_line(call_id: int, kwargs: Mapping[str, object]) -> bytes:
    """The line that asks a worker for one call (ValueError: a circular structure)."""
    return json.dumps({"id": call_id, "kwargs": kwargs}, default=_as_json).encode() + b"\n"


@dataclasses.dataclass(eq=False)
class Call:
    """One call: its request line, its caller's future, and when it was queued and taken."""

    id: int
    request: bytes  # the JSON line
    future: concurrent.futures.Future
    submitted: float = dataclasses.field(default_factory=time.monotonic)
    deadline: float = 0.0  # set when a worker takes it
    started: float = 0.0  # wall clock, when a worker took it


@dataclasses.dataclass(eq=False)
class Worker:
    """A child running `worker.py`, and the calls it holds."""

    proc: subprocess.Popen
    stderr: IO[bytes]
    ready: bool = False  # its hello arrived
    hello_deadline: float = 0.0
    buffer: bytes = b""
    calls: dict[int, Call] = dataclasses.field(default_factory=dict)
    cancelling: dict[int, float] = dataclasses.field(default_factory=dict)  # call id -> kill deadline

    @classmethod
    def spawn(cls, spec: str, extra_paths: list[str], cwd: str, extra_env: Mapping[str, str] | None = None) -> "Worker":
        """Start a child that imports `spec`, from `cwd` (also first on its PYTHONPATH), with
        `extra_env` added to this process's environment."""
        env = {**os.environ, **(extra_env or {})}
        env["PYTHONPATH"] = os.pathsep.join(p for p in [cwd, env.get("PYTHONPATH", "")] if p)
        stderr = tempfile.TemporaryFile()  # a file, not a pipe: a chatty function never blocks on it
        proc = subprocess.Popen(
            [sys.executable, "-u", "-m", WORKER_MODULE, spec, *extra_paths],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=env, cwd=cwd,
            start_new_session=True,  # its own process group, so a kill also ends what it spawned
        )
        return cls(proc, stderr)

    @property
    def fd(self) -> int:
        assert self.proc.stdout is not None
        return self.proc.stdout.fileno()

    def read_hello(self, timeout_s: float) -> dict[str, Any] | None:
        """Block until the first line (None: nothing usable before the timeout or the end)."""
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self.fd, selectors.EVENT_READ)
            while b"\n" not in self.buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return None
                if not self.read():
                    return None
        return self.take_line()

    def read(self) -> bool:
        """What the child wrote so far, into the buffer; False once its output is closed."""
        try:
            chunk = os.read(self.fd, READ_CHUNK)
        except OSError:
            chunk = b""
        self.buffer += chunk
        return bool(chunk)

    def take_line(self) -> dict[str, Any] | None:
        """The first whole line of the buffer, parsed (None: not a JSON object)."""
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            message = json.loads(line)
        except ValueError:
            return None
        return message if isinstance(message, dict) else None

    def write(self, line: bytes) -> bool:
        """Send one line; False if the child is gone (a broken pipe)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line)
            self.proc.stdin.flush()
            return True
        except (OSError, ValueError):
            return False

    def cancel(self, call_id: int) -> None:
        """Ask an async worker to cancel call `call_id` (it answers when the call has ended)."""
        self.write(json.dumps({"cancel": call_id}).encode() + b"\n")

    def exit_code(self, wait_s: float) -> int | None:
        try:
            return self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self, gently: bool) -> None:
        """End the child and everything it spawned (SIGKILL, or SIGTERM first when `gently`)."""
        proc = self.proc
        if proc.poll() is None:
            self._signal(signal.SIGTERM if gently else signal.SIGKILL)
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                proc.wait()
        for stream in (proc.stdin, proc.stdout, self.stderr):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass

    def stderr_tail(self) -> str:
        try:
            self.stderr.seek(0, os.SEEK_END)
            self.stderr.seek(max(0, self.stderr.tell() - STDERR_TAIL_CHARS))
            return self.stderr.read().decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # the child leads its own group (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass
