"""Attacks on the namespaced sandbox (`lora_async/sandbox/namespaces.py`), as a model would try them.

Each test runs the attack and asserts two things: that it failed, and that its target (a victim
process, a secret file, a listener, the machine's disk) is untouched. Most run twice: with the
audit hook (the default: two layers) and without it (`audit=False`, reachable only from here),
so the namespaces are shown to hold on their own, even against code that gets past the hook.
After each attack, the next run works.

If this machine refuses namespaces, every test here FAILS with the probe's reason: a sandbox
that cannot be tested is not assumed to work (CI runs as root in a container, where they work).
Unit tier: real bwrap runs, no engine; each test takes a second or two at most.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from lora_async.sandbox import SandboxLimits, SandboxUnavailable, cage, run_python
from lora_async.sandbox.runner import run_in_cage

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="namespaces are Linux's")

QUICK = SandboxLimits(cpu_s=1, wall_s=15.0)  # a loaded machine never reaches the wall limit first
WALL = SandboxLimits(cpu_s=1, wall_s=1.5)  # the wall-limit test's
LAYERS = pytest.mark.parametrize("audit", [True, False], ids=["with-hook", "namespaces-alone"])


@pytest.fixture(scope="module", autouse=True)
def namespaces():
    """The cage, or a loud failure of every test here (never a skip)."""
    try:
        return cage()
    except SandboxUnavailable as exc:
        pytest.fail(f"NAMESPACES ARE REFUSED ON THIS MACHINE, so the sandbox's attack tests cannot run: {exc}",
                    pytrace=False)


def attack(code: str, audit: bool, limits: SandboxLimits = QUICK):
    """Run `code` in the cage; then check that the next run works."""
    result = run_in_cage(cage(), code, limits, audit=audit)
    after = run_python("print(6 * 7)")
    assert after.ok and after.stdout == "42\n", after.text()
    return result


@pytest.fixture
def victim():
    """A process of the test's own, as the trainer would be; `alive(victim)` asks it to answer."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys\nfor line in sys.stdin:\n    print(line.strip(), flush=True)"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    yield proc
    proc.kill()
    proc.wait()


def alive(proc) -> bool:
    """Whether `proc` still answers. A signal that got through was sent before the attack's run
    ended, so a killed victim never reads this line: its stdout ends instead."""
    try:
        proc.stdin.write("ping\n")
        proc.stdin.flush()
    except BrokenPipeError:
        return False
    return proc.stdout.readline() == "ping\n"


def marked(limits: SandboxLimits) -> tuple[SandboxLimits, bytes]:
    """`limits` with a memory limit no other run has (a few bytes over), and how it reads in the
    command lines of this run's processes (bwrap's and the program's): other runs on the machine
    (a training run's code rewards) have caged processes of their own."""
    memory = limits.memory_bytes + 1 + uuid.uuid4().int % 4000
    return dataclasses.replace(limits, memory_bytes=memory), b'"memory_bytes": %d,' % memory


def processes_with(marker: bytes) -> list[int]:
    """Host pids of the processes whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def wait_gone(marker: bytes, deadline_s: float = 10.0) -> list[int]:
    """Wait until no process of the marked run is left (a PID namespace dies with its init,
    asynchronously); what is left at the deadline."""
    end = time.monotonic() + deadline_s
    while processes_with(marker) and time.monotonic() < end:
        time.sleep(0.05)
    return processes_with(marker)


# ---- other processes


@LAYERS
def test_a_victim_signalled_through_pidfd_and_kill_stays_alive(victim, audit):
    code = (f"import os, signal\n"
            f"for how in ('pidfd', 'kill'):\n"
            f"    try:\n"
            f"        if how == 'pidfd':\n"
            f"            signal.pidfd_send_signal(os.pidfd_open({victim.pid}), signal.SIGKILL)\n"
            f"        else:\n"
            f"            os.kill({victim.pid}, signal.SIGKILL)\n"
            f"        print(how, 'sent')\n"
            f"    except Exception as e:\n"
            f"        print(how, type(e).__name__)\n")
    result = attack(code, audit)
    assert "sent" not in result.stdout, result.text()
    assert "pidfd ProcessLookupError" in result.stdout  # no such process in its PID namespace
    assert ("kill PermissionError" if audit else "kill ProcessLookupError") in result.stdout
    assert alive(victim)


@LAYERS
def test_a_victim_reniced_keeps_its_priority(victim, audit):
    before = os.getpriority(os.PRIO_PROCESS, victim.pid)
    result = attack(f"import os\nos.setpriority(os.PRIO_PROCESS, {victim.pid}, 19)", audit)
    assert not result.ok and "ProcessLookupError" in result.stderr
    assert os.getpriority(os.PRIO_PROCESS, victim.pid) == before and alive(victim)
    # nor the trainer's group or user
    result = attack("import os\nos.setpriority(os.PRIO_USER, 0, 19)\nprint(os.getpriority(os.PRIO_PROCESS, 0))",
                    audit)
    assert os.getpriority(os.PRIO_PROCESS, os.getpid()) == os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, victim.pid) == before


@LAYERS
def test_the_parents_proc_is_not_visible(audit):
    code = ("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
            f"print(os.path.exists('/proc/{os.getpid()}'))\nprint(os.getpid(), os.getppid())")
    result = attack(code, audit)
    pids, visible, own = result.stdout.splitlines()
    assert visible == "False"  # the test process (the trainer) is not there
    assert eval(pids) == [1, 2] and own == "2 1"  # bwrap's init and the program: nothing else


# ---- files


@LAYERS
def test_secrets_in_home_and_tmp_are_neither_readable_nor_listed(audit):
    name = f"lora-async-secret-{uuid.uuid4().hex}"
    secrets = [Path.home() / name, Path("/tmp") / name]
    for path in secrets:
        path.write_text("hunter2")
    try:
        for path in secrets:
            code = (f"import os\n"
                    f"try:\n    print(open({str(path)!r}).read())\nexcept OSError as e:\n    print(type(e).__name__)\n"
                    f"try:\n    print(os.listdir({str(path.parent)!r}))\nexcept OSError as e:\n    print(type(e).__name__)\n"
                    f"for root, dirs, files in os.walk('/'):\n"
                    f"    if {name!r} in files:\n        print('found', root)\n")
            result = attack(code, audit, SandboxLimits(cpu_s=2, wall_s=30.0))  # a loaded machine never reaches the wall
            assert result.ok, result.text()
            assert "hunter2" not in result.stdout and "found" not in result.stdout
            assert result.stdout.splitlines()[0] == "FileNotFoundError"
            assert name not in result.stdout
        # $HOME holds at most the way to the interpreter (when it is installed under $HOME)
        listing = attack(f"import os\ntry:\n    print(os.listdir({str(Path.home())!r}))\n"
                         f"except FileNotFoundError:\n    print([])", audit).stdout
        assert set(eval(listing)) <= {Path(p).relative_to(Path.home()).parts[0] for p in cage().binds
                                      if Path(p).is_relative_to(Path.home())}
    finally:
        for path in secrets:
            path.unlink()


@LAYERS
def test_etc_shadow_and_the_hosts_files_are_not_there(audit):
    code = ("import os\nfor path in ('/etc/shadow', '/etc/passwd', '/root/.bashrc', os.path.expanduser('~/.cache')):\n"
            "    try:\n        open(path).read(1)\n        print(path, 'read')\n"
            "    except OSError as e:\n        print(path, type(e).__name__)\n"
            "print(sorted(os.listdir('/')))")
    result = attack(code, audit)
    assert result.ok and "read" not in result.stdout, result.text()
    *lines, root = result.stdout.splitlines()
    assert all(line.endswith(("FileNotFoundError", "IsADirectoryError")) for line in lines)
    # only the interpreter, the system libraries, the prelude, /proc, /dev and the working directory
    allowed = {Path(p).parts[1] for p in cage().binds} | {"lib", "lib64", "lib32", "libx32", "proc", "dev", "work",
                                                          "sandbox"}
    assert set(eval(root)) <= allowed and "etc" not in eval(root) and "tmp" not in eval(root)


@LAYERS
def test_the_disk_fill_is_cut_by_the_tmpfs(audit):
    limits = SandboxLimits(cpu_s=2, wall_s=30.0, disk_bytes=1024 * 1024, file_bytes=64 * 1024)
    code = ("import os\nwritten = 0\ntry:\n    for i in range(1000):\n        with open(f'f{i}', 'wb') as f:\n"
            "            for _ in range(64):\n                f.write(b'x' * 1024)\n                f.flush()\n"
            "                written += 1024\nexcept OSError as e:\n    print(type(e).__name__, e.strerror)\n"
            "print(written)")
    result = attack(code, audit, limits)
    reason, written = result.stdout.splitlines()
    # 1 MB of tmpfs comes before the hook's cap (64 files of 64 KB) and the file-size limit
    assert reason == "OSError No space left on device"
    assert 0 < int(written) <= limits.disk_bytes


# ---- the kernel's own levers


@LAYERS
def test_mknod_chroot_mount_unshare_and_setns_all_fail(audit):
    code = r'''
import os, stat
def attempt(name, fn):
    try:
        fn()
        print(name, "worked")
    except Exception as e:
        print(name, type(e).__name__)
attempt("mknod", lambda: os.mknod("null2", stat.S_IFCHR | 0o666, os.makedev(1, 3)))
attempt("chroot", lambda: os.chroot("."))
try:
    import ctypes
except Exception as e:
    print("ctypes", type(e).__name__)
else:
    libc = ctypes.CDLL(None, use_errno=True)
    def call(name, *args):
        def fn():
            if getattr(libc, name)(*args) != 0:
                raise OSError(ctypes.get_errno(), name)
        return fn
    attempt("mount", call("mount", b"none", b"/work", b"tmpfs", 0, None))
    attempt("unshare-user", call("unshare", 0x10000000))
    attempt("unshare-mount", call("unshare", 0x00020000))
    attempt("setns", lambda: call("setns", os.open("/proc/1/ns/mnt", os.O_RDONLY), 0)())
print(os.path.exists("null2"))
'''
    result = attack(code, audit)
    assert result.ok, result.text()
    assert "worked" not in result.stdout
    lines = result.stdout.splitlines()
    assert lines[0] == "mknod PermissionError" and lines[1] == "chroot PermissionError"
    if audit:
        assert lines[2] == "ctypes PermissionError"  # the hook refuses ctypes before the kernel is asked
    else:
        assert [line.split()[0] for line in lines[2:6]] == ["mount", "unshare-user", "unshare-mount", "setns"]
    assert lines[-1] == "False"


@LAYERS
def test_a_listener_on_the_hosts_loopback_gets_no_connection(audit, listener):
    port = listener.getsockname()[1]
    result = attack(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)", audit)
    assert not result.ok
    assert ("PermissionError" if audit else "ConnectionRefusedError") in result.stderr
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing arrived


# ---- bombs and floods


def test_a_fork_bomb_and_a_thread_bomb_are_contained():
    limits, marker = marked(QUICK)
    result = attack("import os\nwhile True:\n    os.fork()", True, limits)
    assert "PermissionError: sandbox: os.fork is not allowed" in result.stderr
    result = attack("import threading, time\nthreads = []\nwhile True:\n"
                    "    t = threading.Thread(target=time.sleep, args=(60,))\n    t.start()\n    threads.append(t)",
                    True, limits)
    assert not result.ok and ("can't start new thread" in result.stderr or "MemoryError" in result.stderr)
    assert wait_gone(marker) == []


@LAYERS
def test_a_thread_bomb_is_cut_by_the_limits_alone(audit):
    limits, marker = marked(QUICK)
    result = attack("import threading, time\nn = 0\ntry:\n    while True:\n"
                    "        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n        n += 1\n"
                    "except (RuntimeError, MemoryError) as e:\n    print(type(e).__name__, n)", audit, limits)
    kind, started = result.stdout.split()
    assert kind in ("RuntimeError", "MemoryError") and int(started) < 100  # the address-space limit holds them
    assert wait_gone(marker) == []


@LAYERS
@pytest.mark.parametrize("code", ["x = bytearray(10**10)", "x = [0]\nwhile True:\n    x += x"])
def test_a_memory_bomb_fails_with_memory_error(audit, code):
    # CPU to spare: faulting 256 MB in can cost a loaded machine's process a second of system time
    result = attack(code, audit, SandboxLimits(cpu_s=10, wall_s=30.0))
    assert not result.ok and result.reason == "failed: memory limit (256 MB)"


@LAYERS
def test_an_output_flood_is_cut(audit):
    result = attack('import os\nwhile True:\n    os.write(1, b"x" * 4096)', audit)
    assert not result.ok and result.reason == "failed: output or file size limit (64 KB)"
    assert len(result.stdout) < QUICK.output_chars + 100


@LAYERS
def test_a_program_that_ignores_sigterm_dies_at_the_wall_limit(audit):
    code = ("import signal, time\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):\n"
            "    signal.signal(s, signal.SIG_IGN)\nprint('ignoring', flush=True)\nwhile True:\n    time.sleep(0.05)")
    limits, marker = marked(WALL)
    result = attack(code, audit, limits)
    assert result.timed_out and result.stdout == "ignoring\n"
    assert result.wall_s >= WALL.wall_s
    assert wait_gone(marker) == []  # nothing of it is left


# ---- failing closed


UNSHARE = ["unshare", "--user", "--map-root-user", "sh", "-c",
           'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"', "refuse"]


def test_where_namespaces_are_refused_a_run_stops_before_any_model_in_one_line(tmp_path):
    """A host that refuses user namespaces, made real: the probe runs where none may be created."""
    examples = Path(__file__).resolve().parent.parent / "examples"
    out = tmp_path / "run"
    proc = subprocess.run([*UNSHARE, sys.executable, "-m", "lora_async", "train", str(examples / "sandbox.toml"),
                           "--set", f"run.output_dir={out}"], capture_output=True, text=True, timeout=300)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = [line for line in lines if "task.sandbox" in line]
    assert 'task.sandbox = "process"' in line and "namespace" in line and "ENOSPC" in line
    assert not (out / "checkpoints").exists() and not any(out.glob("*.safetensors"))
    # the same refusal in-process: the runner never falls back, and the weaker mode is a choice
    check = ("from lora_async.sandbox import run_python, SandboxUnavailable\n"
             "try:\n    run_python('print(1)')\nexcept SandboxUnavailable as e:\n    print('refused')\n"
             "print(run_python('print(1)', isolation='process').stdout.strip())")
    proc = subprocess.run([*UNSHARE, sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["refused", "1"], proc.stderr
