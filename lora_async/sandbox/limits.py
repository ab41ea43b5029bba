"""What one sandboxed run may use (`SandboxLimits`) and how it ended (`SandboxResult`)."""

from __future__ import annotations

import signal
from dataclasses import dataclass

KB = 1024
MB = 1024 * KB
CUT_MARKER = "[output cut at {n} characters]"
DEFAULT_CPU_S = 2  # a short computation; an infinite loop costs this much CPU, then SIGXCPU
DEFAULT_WALL_S = 5.0  # a sleeping or blocked program is killed after this long
DEFAULT_MEMORY_BYTES = 256 * MB  # address space: the interpreter needs ~15 MB; a bomb stops here
DEFAULT_FILE_BYTES = 64 * KB  # any one file, stdout and stderr included
DEFAULT_DISK_BYTES = 16 * MB  # the working directory's tmpfs (namespaces)
DEFAULT_OUTPUT_CHARS = 2000  # what comes back of each stream: a model's context is short


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. The defaults suit a short computation."""

    cpu_s: int = DEFAULT_CPU_S
    wall_s: float = DEFAULT_WALL_S
    memory_bytes: int = DEFAULT_MEMORY_BYTES
    file_bytes: int = DEFAULT_FILE_BYTES
    disk_bytes: int = DEFAULT_DISK_BYTES
    output_chars: int = DEFAULT_OUTPUT_CHARS


@dataclass(frozen=True)
class TestReport:
    """How a program did on its tests: which passed, and why each other one failed."""

    passed: int
    total: int
    failures: tuple[str, ...]  # "test 3: AssertionError", in test order; a test never reached says so

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


@dataclass(frozen=True)
class SandboxResult:
    """How one run ended, and its output (each stream cut to `limits.output_chars`)."""

    stdout: str
    stderr: str
    exit_code: int | None  # None: ended by a signal
    signal: int | None  # the signal that ended it, if one did
    timed_out: bool  # killed at the wall-clock limit
    wall_s: float
    pid: int  # the child's (namespaces: bwrap's), which was also its process group's id
    limits: SandboxLimits
    isolation: str = "namespaces"  # "namespaces" or "process"
    tests: TestReport | None = None  # with tests: how it did on them (stdout then holds no verdicts)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def reason(self) -> str | None:
        """Why the run failed, in a few words (None when it did not)."""
        if self.timed_out:
            return f"timed out after {self.limits.wall_s:g}s"
        if self.signal == signal.SIGXCPU or self.signal == signal.SIGKILL:  # SIGKILL: the hard CPU limit
            return f"killed: CPU time limit ({self.limits.cpu_s}s)"
        if self.signal is not None:
            try:
                return f"killed by {signal.Signals(self.signal).name}"
            except ValueError:  # a real-time signal has no name
                return f"killed by signal {self.signal}"
        if self.exit_code == 0:
            return None
        last = self.stderr.rstrip().rsplit("\n", 1)[-1]
        if last.startswith("MemoryError"):
            return f"failed: memory limit ({self.limits.memory_bytes // MB} MB)"
        if "File too large" in last:
            return f"failed: output or file size limit ({self.limits.file_bytes // KB} KB)"
        if "No space left on device" in last:
            return f"failed: disk limit ({self.limits.disk_bytes // MB} MB)"
        return f"exit code {self.exit_code}"

    def text(self) -> str:
        """What a model sees: the output (stderr after stdout, labelled), after the reason of a failure."""
        parts = [] if self.reason is None else [self.reason]
        if self.stdout:
            parts.append(self.stdout.rstrip("\n"))
        if self.stderr:
            parts.append("stderr:\n" + self.stderr.rstrip("\n"))
        if not parts:
            parts.append("(no output: print the result)")
        return "\n".join(parts)


def cut(text: str, limit: int) -> str:
    """`text`, or its first `limit` characters and a marker saying so."""
    if len(text) <= limit:
        return text
    return text[:limit] + "\n" + CUT_MARKER.format(n=limit)
