"""Run untrusted Python (a model's tool call) in a child process with limits: `run_code`.

The child is a fresh interpreter in isolated mode (`-I -S -B`: no PYTHON* variables, no site
packages, no user site, no cwd on sys.path, no .pyc written) with an empty environment, in a
new session (its own process group) and a fresh temporary working directory that is deleted
afterwards. Before the code runs, a prelude (`PRELUDE`, executed with `-c`) sets resource
limits (CPU seconds, address space, file size, open files, processes, no core dumps) and
installs an audit hook (PEP 578) that refuses, with a PermissionError, what a computation has
no business doing: starting processes, the network, changing files outside the working
directory, and the usual ways around the hook (ctypes, test and subinterpreter modules,
extension modules from anywhere but the standard library, tracing, the gc's object lists).

The parent waits up to the wall-clock limit, then kills the whole process group; it also kills
whatever is left in the group after a normal exit. stdout and stderr go to files outside the
working directory, bounded by RLIMIT_FSIZE (CPython ignores SIGXFSZ, so an over-long write
raises OSError "File too large"), and are cut to a number of characters with a marker.

This is a process with rlimits and an audit hook, not a container: see the README section
"What the sandbox does not protect against" (the code can read every file the user can; a
root parent is exempt from RLIMIT_NPROC; C code already importable can bypass audit hooks).
Kept free of torch imports: it runs inside tool workers.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

KB = 1024
MB = 1024 * KB
CUT_MARKER = "[output cut at {n} characters]"
MAIN_FILE = "main.py"  # the code's file name in its tracebacks, as if the user ran `python main.py`
DEFAULT_CPU_S = 2  # a short computation; an infinite loop costs this much CPU, then SIGXCPU
DEFAULT_WALL_S = 5.0  # a sleeping or blocked program is killed after this long
DEFAULT_MEMORY_BYTES = 256 * MB  # address space: the interpreter needs ~15 MB; a bomb stops here
DEFAULT_FILE_BYTES = 64 * KB  # any one file, stdout and stderr included
DEFAULT_OUTPUT_CHARS = 2000  # what comes back of each stream: a model's context is short
OPEN_FILES = 64  # descriptors at once: the interpreter uses a handful
NEW_FILES = 64  # files and directories the code may create: with FILE_BYTES, bounds its disk use
# Process creation for a non-root user (RLIMIT_NPROC counts every task of the user, so any
# value below their current count means none; threads included). Root is exempt: the audit
# hook refuses process creation for everyone.
MAX_PROCESSES = 0
CPU_GRACE_S = 1  # the hard CPU limit (SIGKILL) this long after the soft one (SIGXCPU, which code may ignore)
POLL_S = 0.01  # the exit wait's polling step where pidfd_open is missing (Linux before 5.3)


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. The defaults suit a short computation."""

    cpu_s: int = DEFAULT_CPU_S
    wall_s: float = DEFAULT_WALL_S
    memory_bytes: int = DEFAULT_MEMORY_BYTES
    file_bytes: int = DEFAULT_FILE_BYTES
    output_chars: int = DEFAULT_OUTPUT_CHARS


@dataclass(frozen=True)
class SandboxResult:
    """How one run ended, and its output (each stream cut to `limits.output_chars`)."""

    stdout: str
    stderr: str
    exit_code: int | None  # None: ended by a signal
    signal: int | None  # the signal that ended it, if one did
    timed_out: bool  # killed at the wall-clock limit
    wall_s: float
    pid: int  # the child's, which was also its process group's id
    limits: SandboxLimits

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


def run_code(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` as `main.py` in a fresh sandboxed interpreter; see the module docstring."""
    base = Path(tempfile.mkdtemp(prefix="lora-async-sandbox-")).resolve()
    try:
        work = base / "work"  # the code's working directory; the output files stay outside it
        work.mkdir()
        (work / MAIN_FILE).write_text(code, encoding="utf-8")
        with open(base / "stdout", "wb") as out, open(base / "stderr", "wb") as err:
            started = time.monotonic()
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", "-c", PRELUDE, *_prelude_args(work, limits)],
                cwd=work, env={}, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
            )
            exited = False
            try:
                exited = _wait_exit(proc.pid, limits.wall_s)
            finally:
                # Until it is reaped, the child holds its pid, so the group id cannot be reused: this kills
                # what is left of its group (everything, at a timeout; strays after a normal exit).
                _kill_group(proc.pid)
                code_or_signal = proc.wait()
            wall_s = time.monotonic() - started
        return SandboxResult(
            stdout=_read(base / "stdout", limits), stderr=_read(base / "stderr", limits),
            exit_code=code_or_signal if code_or_signal >= 0 else None,
            signal=-code_or_signal if code_or_signal < 0 else None,
            timed_out=not exited, wall_s=wall_s, pid=proc.pid, limits=limits,
        )
    finally:
        _remove(base)


def cut(text: str, limit: int) -> str:
    """`text`, or its first `limit` characters and a marker saying so."""
    if len(text) <= limit:
        return text
    return text[:limit] + "\n" + CUT_MARKER.format(n=limit)


def _read(path: Path, limits: SandboxLimits) -> str:
    with open(path, "rb") as f:
        data = f.read(limits.file_bytes)  # RLIMIT_FSIZE bounds the file already; this costs nothing
    return cut(data.decode("utf-8", errors="replace"), limits.output_chars)


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


# The child's first code, run as `python -I -S -B -c PRELUDE ARGS` (`_prelude_args`). The audit
# hook takes everything it uses as default arguments, bound at install time: code that patches
# `os`, `os.path` or `builtins` (or, through a traceback, the prelude's globals) cannot change
# what the hook calls, and the hook holds nothing mutable (its counter, an itertools.count, can
# only go up). Its messages are the code's PermissionErrors, so they say what was refused.
PRELUDE = r'''
import sys


def _install(root, cpu_s, cpu_grace_s, memory_bytes, file_bytes, open_files, processes, new_files):
    import itertools, os, resource

    limits = [(resource.RLIMIT_CPU, cpu_s, cpu_s + cpu_grace_s), (resource.RLIMIT_AS, memory_bytes, memory_bytes),
              (resource.RLIMIT_FSIZE, file_bytes, file_bytes), (resource.RLIMIT_NOFILE, open_files, open_files),
              (resource.RLIMIT_NPROC, processes, processes), (resource.RLIMIT_CORE, 0, 0)]
    for which, soft, hard in limits:
        ceiling = resource.getrlimit(which)[1]  # a non-root parent's hard limit cannot be raised
        if ceiling != resource.RLIM_INFINITY:
            soft, hard = min(soft, ceiling), min(hard, ceiling)
        resource.setrlimit(which, (soft, hard))

    dynload = os.path.dirname(resource.__file__) + "/"  # the standard library's extension modules
    no_processes = "no new processes"
    network = "no network"
    refused_events = {
        "os.fork": no_processes, "os.forkpty": no_processes, "os.posix_spawn": no_processes, "os.exec": no_processes,
        "os.spawn": no_processes, "os.system": no_processes, "subprocess.Popen": no_processes,
        "os.killpg": "no signals to other processes", "socket.connect": network, "socket.bind": network,
        "socket.sendto": network, "socket.sendmsg": network, "socket.getaddrinfo": network,
        "socket.gethostbyname": network, "socket.gethostbyaddr": network, "socket.getnameinfo": network,
        "os.symlink": "no links", "os.link": "no links", "os.chdir": "the working directory is fixed",
        "resource.setrlimit": "the limits are fixed", "resource.prlimit": "the limits are fixed",
        "sys.settrace": "no tracing", "sys.setprofile": "no tracing", "gc.get_objects": "no object lists",
        "gc.get_referrers": "no object lists", "gc.get_referents": "no object lists",
        "fcntl.ioctl": "no device control", "cpython.PyInterpreterState_New": "no subinterpreters",
    }
    refused_modules = frozenset({
        "ctypes", "_ctypes", "_ctypes_test", "_posixsubprocess", "_posixshmem", "_multiprocessing", "_sqlite3",
        "_xxsubinterpreters", "_xxtestfuzz", "_testcapi", "_testinternalcapi", "_testbuffer", "_testmultiphase",
        "_testclinic", "_testimportmultiple", "_tkinter", "nis", "syslog", "ossaudiodev",
    })
    # The events that change the file system: where their paths are, and each path's dir_fd.
    changes = {"os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),), "os.chmod": ((0, 2),),
               "os.chown": ((0, 3),), "os.utime": ((0, 3),), "os.truncate": ((0, None),),
               "os.rename": ((0, 2), (1, 3)), "os.setxattr": ((0, None),), "os.removexattr": ((0, None),)}
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    write_modes = frozenset("wax+")

    def resolve(path, dir_fd, root=root, readlink=os.readlink, isinstance=isinstance, str=str, bytes=bytes,
                int=int, OSError=OSError):
        """The absolute, normalised path an event names (an fd: its file), or None if unknown."""
        try:
            if isinstance(path, int):
                path = readlink("/proc/self/fd/%d" % int.__index__(path))
            elif isinstance(path, bytes):
                path = bytes.decode(b"".join((path,)), "utf-8", "surrogateescape")
            elif isinstance(path, str):
                path = "".join((path,))  # an exact str: a subclass could answer its methods differently
            else:
                return None
            if not path.startswith("/"):
                if dir_fd is not None and dir_fd >= 0:
                    path = readlink("/proc/self/fd/%d" % int.__index__(dir_fd)) + "/" + path
                else:
                    path = root + "/" + path
        except OSError:
            return None
        parts = []
        for part in path.split("/"):  # lexical: the code cannot make links, so none lead out
            if part == "..":
                if parts:
                    parts.pop()
            elif part and part != ".":
                parts.append(part)
        return "/" + "/".join(parts)

    def inside(path, root=root):
        return path is not None and (path == root or path.startswith(root + "/"))

    def hook(event, args, refused_events=refused_events, refused_modules=refused_modules, changes=changes,
             write_flags=write_flags, write_modes=write_modes, resolve=resolve, inside=inside, root=root,
             made=itertools.count(1), new_files=new_files, stat=os.stat, getpid=os.getpid, dynload=dynload,
             isinstance=isinstance, str=str, int=int, next=next, OSError=OSError, PermissionError=PermissionError):
        if event in refused_events:
            raise PermissionError("sandbox: %s is not allowed (%s)" % (event, refused_events[event]))
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int):  # an open descriptor: it was checked when it was opened
                return
            writes = flags & write_flags or (isinstance(mode, str) and not write_modes.isdisjoint("".join((mode,))))
            target = resolve(path, None)
            try:
                status = stat(target) if target is not None else None
            except OSError:
                status = None
            if target is not None and target.startswith("/proc/") and target[6:].partition("/")[0].isdigit() \
                    and int(target[6:].partition("/")[0]) != getpid():
                raise PermissionError("sandbox: other processes' files are not allowed (their environment, memory)")
            if not inside(target):
                if writes:
                    raise PermissionError("sandbox: writing outside the working directory is not allowed: %r" % (path,))
                if status is not None and status.st_mode & 0o170000 == 0o040000:  # a dir_fd from it would lead out
                    raise PermissionError("sandbox: opening a directory outside the working directory is not allowed")
            elif writes and status is not None and status.st_mode & 0o170000 not in (0o100000, 0o040000):
                raise PermissionError("sandbox: writing to a device, pipe or socket is not allowed")
            elif writes and status is None and next(made) > new_files:
                raise PermissionError("sandbox: at most %d new files" % new_files)
        elif event in changes:
            for at, dir_at in changes[event]:
                target = resolve(args[at], None if dir_at is None else args[dir_at])
                if not inside(target) or target == root:
                    raise PermissionError("sandbox: %s is only allowed inside the working directory: %r"
                                          % (event, args[at]))
            if event == "os.mkdir" and next(made) > new_files:
                raise PermissionError("sandbox: at most %d new files" % new_files)
        elif event == "os.kill":
            if args[0] != getpid():
                raise PermissionError("sandbox: os.kill is not allowed (no signals to other processes)")
        elif event == "import":
            name, filename = args[0], args[1]
            if isinstance(name, str) and str.partition("".join((name,)), ".")[0] in refused_modules:
                raise PermissionError("sandbox: importing %s is not allowed" % name)
            if filename is not None:  # an extension module, loaded from this file
                filename = "".join((filename,)) if isinstance(filename, str) else ""
                if filename.rpartition("/")[2].partition(".")[0] in refused_modules or not filename.startswith(dynload):
                    raise PermissionError("sandbox: loading %s is not allowed" % filename)

    # subprocess imports _posixsubprocess, whose fork_exec raises no audit event: a stand-in
    # that refuses (and the hook refuses importing the real one).
    stand_in = type(sys)("_posixsubprocess")

    def fork_exec(*args, PermissionError=PermissionError):
        raise PermissionError("sandbox: _posixsubprocess.fork_exec is not allowed (no new processes)")

    stand_in.fork_exec = fork_exec
    sys.modules["_posixsubprocess"] = stand_in
    import builtins  # -S skips `site`, which defines exit() and quit()
    builtins.exit = builtins.quit = sys.exit
    sys.addaudithook(hook)


def _excepthook(kind, value, tb, show=sys.__excepthook__):
    """The default display, without the prelude's frames (the hook's included): a traceback
    starts in the code's file, as if it ran alone."""
    kept = []
    while tb is not None:
        if tb.tb_frame.f_code.co_filename != "<string>":
            kept.append(tb)
        tb = tb.tb_next
    for entry in reversed(kept):
        tb = type(entry)(tb, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    show(kind, value.with_traceback(tb), tb)


_main_file = sys.argv[1]
_install(sys.argv[2], *(int(value) for value in sys.argv[3:]))
sys.excepthook = _excepthook
with open(_main_file, encoding="utf-8") as _f:
    _source = _f.read()
_main = type(sys)("__main__")
_main.__file__ = _main_file
_main.__builtins__ = __builtins__
sys.modules["__main__"] = _main
sys.argv = [_main_file]
del _install, _f
exec(compile(_source, _main_file, "exec"), _main.__dict__)
'''


def _prelude_args(work: Path, limits: SandboxLimits) -> list[str]:
    """PRELUDE's arguments, in the order it reads them."""
    values = [limits.cpu_s, CPU_GRACE_S, limits.memory_bytes, limits.file_bytes, OPEN_FILES, MAX_PROCESSES, NEW_FILES]
    return [MAIN_FILE, str(work), *(str(int(v)) for v in values)]
