"""Run untrusted Python (a model's program) in a fresh, limited interpreter: `run_python`.

Two isolations, chosen by the run's `task.sandbox` (never fallen back from):
- **namespaces** (the default): the interpreter runs under bwrap (`namespaces.py`): its own
  user, PID, network, IPC, UTS and cgroup namespaces, uid 65534 without capabilities, a
  read-only view of only the interpreter and the system libraries, and a size-limited tmpfs
  as its working directory. The prelude's limits and audit hook are the second layer.
- **process**: the interpreter is a plain child process with the prelude's limits and audit hook
  only, in a fresh temporary working directory on the host (deleted afterwards).

Either way the interpreter runs in isolated mode (`-I -S -B`: no PYTHON* variables, no site
packages, no user site, no cwd on sys.path, no .pyc written) with an empty environment, in a
new session. `prelude.py` (a real file; bound read-only under namespaces) sets resource limits
(CPU seconds, address space, file size, open files, processes, no core dumps), installs the
audit hook, and runs the code as `main.py`.

The parent waits up to the wall-clock limit, then kills the whole process group (under
namespaces, bwrap: its PID namespace dies with it). stdout and stderr go to files outside the
working directory, bounded by RLIMIT_FSIZE (CPython ignores SIGXFSZ, so an over-long write
raises OSError "File too large"), and are cut to a number of characters with a marker.

With `tests` (assert statements, or input/output pairs), the prelude's harness runs them and
reports a verdict per test (`SandboxResult.tests`); see `prelude.py`.
Kept free of torch imports: it runs inside tool and reward workers.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any, Literal, Sequence

from .limits import KB, SandboxLimits, SandboxResult, TestReport, cut
from .namespaces import PRELUDE_FILE, PROBE_TIMEOUT_S, WORK, Cage, SandboxUnavailable, located, unavailable
from .namespaces import PRELUDE as PRELUDE_INSIDE

Isolation = Literal["namespaces", "process"]
ISOLATIONS: tuple[Isolation, ...] = ("namespaces", "process")
ISOLATION_ENV = "LORA_ASYNC_SANDBOX"  # how a run's `task.sandbox` reaches its tool and reward workers
MAIN_FILE = "main.py"  # the code's file name in its tracebacks, as if the user ran `python main.py`
INTERPRETER_FLAGS = ("-I", "-S", "-B")
OPEN_FILES = 64  # descriptors at once: the interpreter uses a handful
NEW_FILES = 64  # files and directories the code may create: with FILE_BYTES, bounds its disk use
# Process creation for a non-root user (RLIMIT_NPROC counts every task of the user, so any
# value below their current count means none; threads included). Root is exempt: the audit
# hook refuses process creation for everyone.
MAX_PROCESSES = 0
CPU_GRACE_S = 1  # the hard CPU limit (SIGKILL) this long after the soft one (SIGXCPU, which code may ignore)
POLL_S = 0.01  # the exit wait's polling step where pidfd_open is missing (Linux before 5.3)
MAX_SIGNAL = 64  # bwrap exits 128 + N for a child killed by signal N
Tests = Sequence[Any] | str


class InvalidTests(ValueError):
    """A `tests` value the harness cannot run (the message says what is expected)."""


def resolve_isolation(isolation: str | None) -> Isolation:
    """The isolation asked for, or the run's (its workers' environment), else namespaces."""
    chosen = isolation if isolation is not None else os.environ.get(ISOLATION_ENV) or "namespaces"
    for known in ISOLATIONS:
        if chosen == known:
            return known
    raise ValueError(f"sandbox isolation {chosen!r}: use one of {', '.join(ISOLATIONS)}")


def run_python(code: str, tests: Tests | None = None, limits: SandboxLimits = SandboxLimits(),
               isolation: Isolation | None = None) -> SandboxResult:
    """Run `code` as `main.py` in a fresh sandboxed interpreter; see the module docstring.

    `tests`: a list of assert statements (run after the code, in its namespace), or a list of
    `{"input": ..., "output": ...}` cases (the code runs once per case with that stdin; its
    stdout must match); `{"inputs": [...], "outputs": [...]}` and a JSON string of either form
    work too. The result's `tests` then says how many passed. Raises `SandboxUnavailable` where
    namespaces are refused (never falls back), `InvalidTests` for tests it cannot run."""
    payload = None if tests is None else test_payload(tests)
    if resolve_isolation(isolation) == "namespaces":
        return run_in_cage(cage(), code, limits, payload)
    return _run_in_process(code, limits, payload)


def test_payload(given: Tests) -> dict[str, Any]:
    """What the harness reads on stdin: the kind of tests, the tests, and a fresh nonce."""
    tests: Any = given
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError:
            tests = _statements(tests)
    if isinstance(tests, dict) and "inputs" in tests and "outputs" in tests:  # APPS' and TACO's form
        tests = [{"input": i, "output": o} for i, o in zip(tests["inputs"], tests["outputs"])]
    if not isinstance(tests, (list, tuple)) or not tests:
        raise InvalidTests(f"tests must be a non-empty list of assert statements or of {{'input', 'output'}} "
                         f"cases, not {str(tests)[:80]!r}")
    if all(isinstance(t, str) for t in tests):
        kind = "asserts"
    elif all(isinstance(t, dict) and "output" in t for t in tests):
        kind = "io"
        tests = [{"input": _text(t.get("input", "")), "output": _text(t["output"])} for t in tests]
    else:
        raise InvalidTests("tests must all be assert statements (strings) or all {'input', 'output'} cases")
    return {"nonce": secrets.token_hex(16), "kind": kind, "tests": list(tests)}


def _text(value: Any) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def _statements(block: str) -> list[str]:
    """A block of test code split into its top-level statements (one test each)."""
    tests: list[str] = []
    for line in block.splitlines():
        if line.strip() and not line[0].isspace() and not line.lstrip().startswith("#"):
            tests.append(line)
        elif tests and line.strip():
            tests[-1] += "\n" + line
    return tests


def cage() -> Cage:
    """This process's cage, probed once; raises `SandboxUnavailable` where it cannot work."""
    found = _probed()
    if isinstance(found, str):
        raise SandboxUnavailable(found)
    return found


@functools.cache
def _probed() -> Cage | str:
    """The cage, checked by one run of a no-op; or why there is none (the line to show)."""
    found = located()
    if isinstance(found, str):
        return found
    try:
        result = run_in_cage(found, "pass", SandboxLimits(wall_s=PROBE_TIMEOUT_S))
    except OSError as exc:
        return unavailable(f"bwrap could not start: {exc}")
    if not result.ok:
        why = (result.stderr.strip().splitlines() or [result.reason or "it failed"])[-1]
        return unavailable(why)
    return found


def run_in_cage(found: Cage, code: str, limits: SandboxLimits, payload: dict[str, Any] | None = None,
                audit: bool = True) -> SandboxResult:
    """Run under bwrap (`namespaces.py`); the code reaches /work/main.py through a memfd. `audit`
    False leaves the audit hook out (the attack tests: the namespaces must hold alone)."""
    base = Path(tempfile.mkdtemp(prefix="lora-async-sandbox-"))  # the output files; never visible inside
    main_fd = os.memfd_create(MAIN_FILE)
    try:
        os.write(main_fd, code.encode("utf-8"))
        os.lseek(main_fd, 0, os.SEEK_SET)
        argv = [*found.argv(limits, main_fd), *INTERPRETER_FLAGS, PRELUDE_INSIDE, _settings(WORK, limits, payload, audit)]
        return _run(argv, base, None, limits, payload, "namespaces", pass_fds=(main_fd,))
    finally:
        os.close(main_fd)
        _remove(base)


def _run_in_process(code: str, limits: SandboxLimits, payload: dict[str, Any] | None) -> SandboxResult:
    base = Path(tempfile.mkdtemp(prefix="lora-async-sandbox-")).resolve()
    try:
        work = base / "work"  # the code's working directory; the output files stay outside it
        work.mkdir()
        (work / MAIN_FILE).write_text(code, encoding="utf-8")
        argv = [sys.executable, *INTERPRETER_FLAGS, PRELUDE_FILE, _settings(str(work), limits, payload)]
        return _run(argv, base, work, limits, payload, "process")
    finally:
        _remove(base)


def _settings(root: str, limits: SandboxLimits, payload: dict[str, Any] | None, audit: bool = True) -> str:
    """The prelude's one argument."""
    return json.dumps({"main": MAIN_FILE, "root": root, "cpu_s": limits.cpu_s, "cpu_grace_s": CPU_GRACE_S,
                       "memory_bytes": limits.memory_bytes, "file_bytes": limits.file_bytes,
                       "open_files": OPEN_FILES, "processes": MAX_PROCESSES, "new_files": NEW_FILES,
                       "tests": payload is not None, "audit": audit})


def _run(argv: list[str], outputs: Path, cwd: Path | None, limits: SandboxLimits, payload: dict[str, Any] | None,
         isolation: Isolation, pass_fds: Sequence[int] = ()) -> SandboxResult:
    """Start `argv`, wait for it up to the wall limit, kill its group, and read what it wrote
    (stdout and stderr go to files in `outputs`, which the caller removes)."""
    stdin: int | IO[bytes] = subprocess.DEVNULL
    try:
        if payload is not None:
            stdin = tempfile.TemporaryFile(dir=outputs)
            stdin.write(json.dumps(payload).encode("utf-8"))
            stdin.seek(0)
        with open(outputs / "stdout", "wb") as out, open(outputs / "stderr", "wb") as err:
            started = time.monotonic()
            proc = subprocess.Popen(argv, cwd=cwd, env={}, stdin=stdin, stdout=out, stderr=err,
                                    start_new_session=True, pass_fds=tuple(pass_fds))
            exited = False
            try:
                exited = _wait_exit(proc.pid, limits.wall_s)
            finally:
                # Until it is reaped, the child holds its pid, so the group id cannot be reused: this kills
                # what is left of its group (everything, at a timeout; strays after a normal exit).
                _kill_group(proc.pid)
                status = proc.wait()
            wall_s = time.monotonic() - started
        stdout = _read(outputs / "stdout", limits.file_bytes)
        report = None
        if payload is not None:
            stdout, report = _verdicts(stdout, payload)
        exit_code: int | None = status if status >= 0 else None
        signum: int | None = None if status >= 0 else -status
        if isolation == "namespaces" and exit_code is not None and 128 < exit_code <= 128 + MAX_SIGNAL:
            signum, exit_code = exit_code - 128, None
        return SandboxResult(
            stdout=cut(stdout, limits.output_chars),
            stderr=cut(_read(outputs / "stderr", limits.file_bytes), limits.output_chars),
            exit_code=exit_code, signal=signum, timed_out=not exited, wall_s=wall_s, pid=proc.pid, limits=limits,
            isolation=isolation, tests=report,
        )
    finally:
        if not isinstance(stdin, int):
            stdin.close()


def _verdicts(stdout: str, payload: dict[str, Any]) -> tuple[str, TestReport]:
    """The harness's verdict lines (those with this run's nonce) as a report; the rest of stdout."""
    nonce, total = payload["nonce"], len(payload["tests"])
    verdicts: dict[int, tuple[bool, str]] = {}
    rest = []
    for line in stdout.splitlines(keepends=True):
        fields = line.rstrip("\n").split(" ", 3)
        if len(fields) >= 3 and fields[0] == nonce and fields[1].isdigit() and int(fields[1]) < total:
            verdicts.setdefault(int(fields[1]), (fields[2] == "pass", fields[3] if len(fields) > 3 else ""))
        else:
            rest.append(line)
    failures = []
    for index in range(total):
        passed, why = verdicts.get(index, (False, "not reached (the program ended or hung first)"))
        if not passed:
            failures.append(f"test {index}: {why}")
    return "".join(rest), TestReport(total - len(failures), total, tuple(failures))


def _read(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        data = f.read(limit)  # RLIMIT_FSIZE bounds the file already; this costs nothing
    return data.decode("utf-8", errors="replace")


def _wait_exit(pid: int, timeout_s: float) -> bool:
    """Wait until `pid` exits, without reaping it; False at the timeout."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd: poll, still without reaping
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
            time.sleep(POLL_S)
        return False
    try:
        poll = select.poll()  # not select(): a trainer may hold more than FD_SETSIZE descriptors
        poll.register(fd, select.POLLIN)
        return bool(poll.poll(timeout_s * 1000))
    finally:
        os.close(fd)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is gone (or only a zombie leader is left)
        pass


def _remove(base: Path) -> None:
    """Delete the run's directory, whatever modes the code left on what it made."""
    for root, dirs, _ in os.walk(base):
        for name in dirs:
            try:
                os.chmod(os.path.join(root, name), 0o700)
            except OSError:
                pass
    shutil.rmtree(base, ignore_errors=True)


__all__ = ["ISOLATIONS", "ISOLATION_ENV", "KB", "Isolation", "InvalidTests", "resolve_isolation", "run_python"]
