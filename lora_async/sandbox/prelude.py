"""The sandboxed interpreter's first code: `python -I -S -B prelude.py SETTINGS` (a JSON object).

Not imported by lora_async: the runner starts it as a script, from its file in the package
(namespaces: bound read-only at /sandbox/prelude.py). Standard library only; nothing runs on
import.

It sets the resource limits, installs an audit hook (PEP 578) that refuses what a computation
has no business doing, then runs the code's file (`main.py`) as `__main__`. Under namespaces
the hook is the second layer; in `process` mode it is the only one besides the limits.

The hook takes everything it uses as default arguments, bound at install time: code that
patches `os`, `os.path` or `builtins` (or, through a traceback, this module's globals) cannot
change what the hook calls, and the hook holds nothing mutable (its counter, an
itertools.count, can only go up). Its messages are the code's PermissionErrors.

With tests (`"tests": true`), stdin carries `{"nonce", "kind", "tests"}`, read before the code
runs. The code runs once (kind "asserts": then each test statement runs in its namespace) or
once per case (kind "io": the case's input on stdin, its stdout compared with the case's
output). Each test's verdict is a line `NONCE INDEX pass|fail WHY`; the code's own output goes
to a bounded buffer. The code never sees the nonce: stdin is replaced by /dev/null once read,
the nonce is held only by the harness's locals, the hook refuses frame introspection, the gc's
object lists and threads, and all verdicts go to the real stdout in one write after the last
of the code has run, followed at once by the process's end (signals blocked, gc off). So a
program cannot print a verdict of its own; one that hangs or dies gets none.
"""

# mypy: ignore-errors
# (a script for the sandboxed interpreter: it binds builtins as default arguments on purpose)
import sys

FRAME_ATTRIBUTES = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back"})
SINK_CHARS = 100_000  # what the harness keeps of the code's own output (then discarded)


def install(root, cpu_s, cpu_grace_s, memory_bytes, file_bytes, open_files, processes, new_files, frames, audit):
    """The limits and the hook; `frames` False also refuses reaching any frame (the tests' harness).
    `audit` False leaves the hook out: only the attack tests do, to show the namespaces hold alone."""
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
    if not frames:
        refused_events.update({"sys._getframe": "no frames", "sys._current_frames": "no frames"})
    refused_modules = frozenset(({"_thread"} if not frames else set()) | {
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
    frame_attributes = frozenset() if frames else FRAME_ATTRIBUTES

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
             frame_attributes=frame_attributes, isinstance=isinstance, str=str, int=int, next=next, OSError=OSError,
             PermissionError=PermissionError):
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
        elif event == "object.__getattr__":
            if isinstance(args[1], str) and "".join((args[1],)) in frame_attributes:
                raise PermissionError("sandbox: reaching a frame is not allowed")
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

    import builtins  # -S skips `site`, which defines exit() and quit()
    builtins.exit = builtins.quit = sys.exit
    if audit and not frames:  # the tests' harness: no thread may run beside its last write
        import _thread

        def start_new_thread(*args, PermissionError=PermissionError):
            raise PermissionError("sandbox: threads are not allowed while tests run")

        _thread.start_new_thread = start_new_thread
        if "threading" in sys.modules:
            sys.modules["threading"]._start_new_thread = start_new_thread
    if audit:
        stand_in.fork_exec = fork_exec
        sys.modules["_posixsubprocess"] = stand_in
        sys.addaudithook(hook)


def excepthook(kind, value, tb, show=sys.__excepthook__, prelude=__file__):
    """The default display, without this file's frames (the hook's included): a traceback starts
    in the code's file, as if it ran alone."""
    kept = []
    while tb is not None:
        if tb.tb_frame.f_code.co_filename != prelude:
            kept.append(tb)
        tb = tb.tb_next
    for entry in reversed(kept):
        tb = type(entry)(tb, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    show(kind, value.with_traceback(tb), tb)


def fresh_main(main_file):
    """A new `__main__` module for the code (this file's globals stay out of its reach)."""
    main = type(sys)("__main__")
    main.__file__ = main_file
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    sys.argv = [main_file]
    return main


def harness(main_file, source, payload, fresh_main=fresh_main):
    """Run the code against its tests; see the module docstring. Verdicts go to the real stdout.
    Everything it calls after the code starts is bound here (locals and default arguments): code
    that patches `builtins` or this module's globals does not change how a test is judged."""
    import io, os

    nonce, kind, tests = str(payload["nonce"]), payload["kind"], list(payload["tests"])
    real_stdout = os.dup(1)
    code = compile(source, main_file, "exec")
    StringIO, str_, len_, range_, exec_, compile_ = io.StringIO, str, len, range, exec, compile
    BaseException_ = BaseException

    class Sink(StringIO):
        """The code's own output, kept to SINK_CHARS (a flood must not reach the verdicts' file)."""

        def write(self, text, limit=SINK_CHARS, StringIO=StringIO, len=len):
            if StringIO.tell(self) < limit:
                StringIO.write(self, text[:limit])
            return len(text)

    verdicts = []

    def verdict(index, passed, why, verdicts=verdicts, str=str):
        why = str.replace(str.__str__(why), "\n", " ")[:100]
        verdicts.append("%s %d %s %s\n" % (nonce, index, "pass" if passed else "fail", why))

    def report(verdicts=verdicts, write=os.write, fd=real_stdout, exit=os._exit, join="".join, gc=__import__("gc"),
               signal=__import__("signal")):
        """All verdicts in one write, then the end: no program code runs between (no threads, no
        signal handlers, no finalizers), so none can read the nonce off the file and forge more."""
        gc.disable()
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        write(fd, join(verdicts).encode("utf-8", "replace"))
        exit(0)

    def describe(exc, type=type, str=str, BaseException=BaseException):
        try:
            text = str.__str__(str(exc))
        except BaseException:
            text = ""
        return type(exc).__name__ + (": " + text if text else "")

    def run(namespace, stdin_text, exec=exec, code=code, StringIO=StringIO, Sink=Sink, SystemExit=SystemExit,
            BaseException=BaseException, describe=describe, sys=sys, getvalue=StringIO.getvalue):
        """Run the code once: (its output, None), or (its output, why it failed)."""
        out = Sink()
        sys.stdin, sys.stdout, sys.stderr = StringIO(stdin_text), out, Sink()
        try:
            exec(code, namespace)
        except SystemExit as stop:
            if stop.code not in (None, 0):
                return getvalue(out), "exit code %r" % (stop.code,)
        except BaseException as exc:
            return getvalue(out), describe(exc)
        return getvalue(out), None

    def lines(text, str=str):
        """Text as lines, trailing spaces and blank lines at the end ignored."""
        return [str.rstrip(line) for line in str.splitlines(str.rstrip(text))]

    if kind == "io":
        cases = [(str_(case.get("input", "")), str_(case.get("output", ""))) for case in tests]
        for index in range_(len_(cases)):
            stdin_text, want = cases[index]
            got, error = run(fresh_main(main_file).__dict__, stdin_text)
            passed = error is None and lines(got) == lines(want)
            verdict(index, passed, error or ("" if passed else "wrong output"))
        report()
    statements = [compile_(str_(test), "test", "exec") for test in tests]
    namespace = fresh_main(main_file).__dict__
    _, error = run(namespace, "")
    for index in range_(len_(statements)):
        if error is not None:
            verdict(index, False, "the program failed: " + error)
            continue
        try:
            exec_(statements[index], namespace)
        except BaseException_ as exc:
            verdict(index, False, describe(exc))
        else:
            verdict(index, True, "")
    report()


def main():
    import json

    settings = json.loads(sys.argv[1])
    payload = None
    if settings["tests"]:  # before the hook: the tests and the nonce; then fd 0 leads nowhere
        import os

        payload = json.loads(sys.stdin.read())
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    main_file = settings["main"]
    install(settings["root"], settings["cpu_s"], settings["cpu_grace_s"], settings["memory_bytes"],
            settings["file_bytes"], settings["open_files"], settings["processes"], settings["new_files"],
            frames=payload is None, audit=settings.get("audit", True))
    with open(main_file, encoding="utf-8") as f:
        source = f.read()
    if payload is not None:
        harness(main_file, source, payload)
        return
    sys.excepthook = excepthook
    del settings
    exec(compile(source, main_file, "exec"), fresh_main(main_file).__dict__)


if __name__ == "__main__":
    main()
