"""The code sandbox (`lora_async/sandbox/`) and the `sandbox` environment built on it.

Every fault a program can throw (a loop, a sleep, a memory or fork bomb, endless output, a
refused operation) ends as a failed result with a reason; through the real tool path (a
`ToolBox` worker process) it reaches the model as an error, and the next call still works.
Nothing a program does reaches outside its working directory, its environment or its process
group. Unit tier: real child interpreters, no engine; each test takes a few seconds at most.

The runner's tests run in both isolations (`run` is parametrized): the default `namespaces`
and the weaker `process` keep the same behaviour for everything the audit hook refuses. The
attacks only namespaces stop are in test_sandbox_attacks.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from lora_async.envs.base import Reply, ToolCall, ToolResult
from lora_async.envs.builtin import calculator, sandbox as env
from lora_async.sandbox import CUT_MARKER, SandboxLimits, run_python
from lora_async.envs.tools import ToolBox, parse_tool_calls, tool_schemas

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox uses Linux rlimits and /proc")

# The fault tests' limits: a CPU second, and a wall limit far enough off that a loaded machine
# never reaches it first; the wall-limit tests use WALL (each costs its 1.5 s).
QUICK = SandboxLimits(cpu_s=1, wall_s=15.0)
WALL = SandboxLimits(cpu_s=1, wall_s=1.5)


def children() -> list[int]:
    """Live processes whose parent is this test process."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            found.append(int(entry.name))
    return found


@pytest.fixture(params=["namespaces", "process"])
def run(request):
    """`run_python` in one isolation: run(code, limits)."""
    def run_(code: str, limits: SandboxLimits = SandboxLimits()):
        result = run_python(code, limits=limits, isolation=request.param)
        assert result.isolation == request.param
        return result

    run_.isolation = request.param
    return run_


def assert_group_gone(pgid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


# ---- the runner


def test_ordinary_code_runs_and_returns_its_output(run):
    result = run("import fractions, itertools, math\n"
                      "print(math.factorial(10), list(itertools.accumulate([1, 2, 3])))\n"
                      "print(fractions.Fraction(1, 3) + 1, 'é')\n")
    assert result.ok and result.reason is None and result.exit_code == 0 and result.stderr == ""
    assert result.stdout == "3628800 [1, 3, 6]\n4/3 é\n"
    assert result.text() == "3628800 [1, 3, 6]\n4/3 é"
    assert run("x = 6 * 7").text() == "(no output: print the result)"


def test_the_interpreter_is_isolated_and_the_working_directory_is_fresh_and_removed(run):
    result = run("import os, sys\nprint(sys.flags.isolated, sys.flags.no_site, sys.argv, __name__)\n"
                      "print(os.getcwd())\nprint(sorted(os.listdir('.')))")
    flags, cwd, listing = result.stdout.splitlines()
    assert flags == "1 1 ['main.py'] __main__"
    assert listing == "['main.py']"
    if run.isolation == "namespaces":
        assert cwd == "/work"  # a tmpfs inside the namespaces, gone with them
    else:
        assert not Path(cwd).exists()  # deleted


def test_a_traceback_starts_in_main_py_at_the_right_line(run):
    result = run("x = 1\n\ny = x / 0\n")
    assert not result.ok and result.exit_code == 1 and result.reason == "exit code 1"
    assert result.stderr.startswith('Traceback (most recent call last):\n  File "main.py", line 3, in <module>\n')
    assert result.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "prelude" not in result.stderr  # the prelude's frames are not shown
    assert run("def f(:\n").stderr.startswith('  File "main.py", line 1\n')
    assert run("import sys\nsys.exit(3)").exit_code == 3
    assert run("exit(4)").exit_code == 4  # -S skips `site`; the prelude still provides exit()


def test_no_environment_variable_of_the_parent_is_visible(run, monkeypatch):
    monkeypatch.setenv("LORA_ASYNC_SANDBOX_SECRET", "hunter2")
    monkeypatch.setenv("PYTHONSTARTUP", "/nonexistent/evil.py")
    result = run("import os\nprint(sorted(os.environ))")
    assert result.ok
    assert "LORA_ASYNC_SANDBOX_SECRET" not in result.stdout and "PYTHON" not in result.stdout
    # what Python itself sets (PEP 538 locale coercion), and bwrap's PWD (/work) under namespaces
    assert set(eval(result.stdout)) <= {"LC_CTYPE", "PWD"}
    # nor through /proc: another process's environment (and memory) is refused
    result = run("import os\nprint(open(f'/proc/{os.getppid()}/environ').read())")
    assert "hunter2" not in result.stdout and "other processes' files are not allowed" in result.stderr


def test_an_infinite_loop_is_killed_at_the_cpu_limit(run):
    result = run("while True:\n    pass", QUICK)
    assert result.signal == signal.SIGXCPU and not result.timed_out
    assert result.reason == "killed: CPU time limit (1s)"
    assert_group_gone(result.pid)


def test_a_sleeping_loop_is_killed_at_the_wall_clock_limit(run):
    result = run("import time\nprint('started', flush=True)\nwhile True:\n    time.sleep(0.1)", WALL)
    assert result.timed_out and result.signal == signal.SIGKILL and result.reason == "timed out after 1.5s"
    assert result.wall_s >= WALL.wall_s
    assert result.stdout == "started\n"  # what it printed before is kept
    assert_group_gone(result.pid)


def test_a_program_that_ignores_sigxcpu_dies_at_the_hard_cpu_limit(run):
    result = run("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass",
                      QUICK)
    assert result.signal == signal.SIGKILL and not result.timed_out  # CPU_GRACE_S after the soft limit
    assert result.reason == "killed: CPU time limit (1s)"


@pytest.mark.parametrize("code", [
    "x = bytearray(10**10)",
    "x = [0]\nwhile True:\n    x += x",
    "x = []\nwhile True:\n    x.append(' ' * 10**6)",
])
def test_a_memory_bomb_fails_with_memory_error(run, code):
    # CPU to spare: faulting 256 MB in can cost a loaded machine's process a second of system time
    result = run(code, SandboxLimits(cpu_s=10, wall_s=30.0))
    assert not result.ok and result.exit_code == 1
    assert result.stderr.rstrip().endswith("MemoryError")
    assert result.reason == "failed: memory limit (256 MB)"


def test_a_fork_bomb_is_refused_and_leaves_no_process(run):
    before = children()
    result = run("import os\nwhile True:\n    os.fork()", QUICK)
    assert not result.ok and result.exit_code == 1 and not result.timed_out
    assert "PermissionError: sandbox: os.fork is not allowed (no new processes)" in result.stderr
    assert_group_gone(result.pid)
    assert children() == before


@pytest.mark.parametrize("code, refused", [
    ("import subprocess\nsubprocess.run(['echo', 'ran'])", "subprocess.Popen is not allowed"),
    ("import os\nos.system('echo ran')", "os.system is not allowed"),
    ("import os\nprint(os.popen('echo ran').read())", "subprocess.Popen is not allowed"),
    ("import os\nos.posix_spawn('/bin/echo', ['echo', 'ran'], {})", "os.posix_spawn is not allowed"),
    ("import os\nos.execv('/bin/echo', ['echo', 'ran'])", "os.exec is not allowed"),
    ("import os\nos.forkpty()", "os.forkpty is not allowed"),
    ("import pty\npty.fork()", "os.fork is not allowed"),  # pty falls back to os.fork when forkpty fails
    # fork_exec raises no audit event of its own: the prelude puts a refusing stand-in in its place
    ("import _posixsubprocess\n_posixsubprocess.fork_exec()", "_posixsubprocess.fork_exec is not allowed"),
    ("import sys\ndel sys.modules['_posixsubprocess']\nimport _posixsubprocess", "importing _posixsubprocess"),
    ("import os\nos.kill(os.getppid(), 0)", "os.kill is not allowed"),  # signal 0: harmless if it got through
])
def test_starting_or_signalling_processes_is_refused(run, code, refused):
    before = children()
    result = run(code, QUICK)
    assert not result.ok and "ran" not in result.stdout
    assert f"PermissionError: sandbox: {refused}" in result.stderr
    assert_group_gone(result.pid)
    assert children() == before


@pytest.mark.parametrize("template", [
    "open({path!r}, 'w').write('x')",
    "open({path!r}, 'a').write('x')",
    "import os\nos.close(os.open({path!r}, os.O_WRONLY | os.O_CREAT))",
    "import pathlib\npathlib.Path({path!r}).write_text('x')",
    "import os\nos.mkdir({path!r})",
    "import os\nopen('inside', 'w').close()\nos.rename('inside', {path!r})",
    "import shutil\nopen('inside', 'w').close()\nshutil.copy('inside', {path!r})",
])
def test_writing_outside_the_working_directory_is_refused(run, tmp_path, template):
    target = tmp_path / "escaped"
    result = run(template.format(path=str(target)), QUICK)
    assert not result.ok and "PermissionError: sandbox:" in result.stderr
    assert not target.exists()


def test_relative_escapes_and_directory_descriptors_are_refused(run, tmp_path):
    if run.isolation == "namespaces":
        pytest.skip("process mode only: under namespaces the host's directory does not exist inside "
                    "(test_sandbox_attacks.py)")
    result = run("import os\ntry:\n    open('../x', 'w')\nexcept PermissionError as e:\n    print(e)\n"
                      "print(os.path.exists('../x'))")
    assert result.stdout == "sandbox: writing outside the working directory is not allowed: '../x'\nFalse\n"
    # a descriptor of an outside directory would let os.open(..., dir_fd=fd) write there
    result = run(f"import os\nfd = os.open({str(tmp_path)!r}, os.O_RDONLY)\n"
                      "os.open('escaped', os.O_WRONLY | os.O_CREAT, dir_fd=fd)")
    assert "opening a directory outside the working directory is not allowed" in result.stderr
    assert not (tmp_path / "escaped").exists()


@pytest.mark.parametrize("template", [
    "import os\nos.remove({path!r})",
    "import os\nos.rename({path!r}, 'mine')",
    "import os\nos.truncate({path!r}, 0)",
    "import os\nos.chmod({path!r}, 0)",
    "import os\nos.link({path!r}, 'mine')",
    "import os\nos.symlink({path!r}, 'mine')",
    "import os\nos.chdir({parent!r})\nopen('kept.txt', 'w')",
])
def test_files_outside_are_not_changed(run, tmp_path, template):
    kept = tmp_path / "kept.txt"
    kept.write_text("precious")
    mode = kept.stat().st_mode
    result = run(template.format(path=str(kept), parent=str(tmp_path)), QUICK)
    assert not result.ok and "PermissionError: sandbox:" in result.stderr
    assert kept.read_text() == "precious" and kept.stat().st_mode == mode


def test_writing_inside_the_working_directory_works(run):
    result = run("import os, pathlib, shutil, tempfile\n"
                      "open('out.txt', 'w').write('hello')\n"
                      "os.makedirs('a/b')\nos.rename('out.txt', 'a/b/out.txt')\n"
                      "pathlib.Path('a/b/more.txt').write_text(open('a/b/out.txt').read() + ' again')\n"
                      "with tempfile.TemporaryFile() as f:\n    f.write(b'temp')\n"
                      "print(sorted(os.listdir('a/b')), open('a/b/more.txt').read())\n"
                      "shutil.rmtree('a')\nprint(os.listdir('.'))")
    assert result.ok, result.text()
    assert result.stdout == "['more.txt', 'out.txt'] hello again\n['main.py']\n"


def test_creating_many_files_is_refused_at_the_cap(run):
    result = run("for i in range(1000):\n    open(f'f{i}', 'w').close()", QUICK)
    assert "PermissionError: sandbox: at most 64 new files" in result.stderr


@pytest.mark.parametrize("code", ['print("x" * 10**7)', 'while True:\n    print("x" * 80)'])
def test_huge_output_comes_back_cut_with_a_marker(run, code):
    result = run(code, QUICK)
    marker = CUT_MARKER.format(n=QUICK.output_chars)
    assert result.stdout.endswith("\n" + marker)
    assert len(result.stdout) == QUICK.output_chars + 1 + len(marker)
    assert set(result.stdout[:QUICK.output_chars]) <= {"x", "\n"}
    # RLIMIT_FSIZE stopped the writes: CPython ignores SIGXFSZ, so print raised OSError
    assert not result.ok and "File too large" in result.stderr
    assert result.reason == "failed: output or file size limit (64 KB)" and not result.timed_out
    assert result.text().startswith("failed: output or file size limit (64 KB)\nxxx")


def test_the_network_is_refused(run, listener):
    port = listener.getsockname()[1]
    result = run(f"import socket\nsocket.socket().connect(('127.0.0.1', {port}))", QUICK)
    assert "PermissionError: sandbox: socket.connect is not allowed (no network)" in result.stderr
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing arrived
    assert "socket.getaddrinfo is not allowed" in run("import socket\nsocket.getaddrinfo('localhost', 80)").stderr
    assert "socket.bind is not allowed" in run("import socket\nsocket.socket().bind(('127.0.0.1', 0))").stderr


@pytest.mark.parametrize("code, refused", [
    ("import ctypes", "importing ctypes is not allowed"),
    ("import _ctypes", "importing _ctypes is not allowed"),
    ("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))", "resource.setrlimit is not allowed"),
    ("import sys\nsys.settrace(lambda *a: None)", "sys.settrace is not allowed"),
    ("import gc\ngc.get_objects()", "gc.get_objects is not allowed"),
    # _ctypes loaded under another name
    ("import importlib.util, os, _socket\nlib = os.path.dirname(_socket.__file__)\n"
     "name = next(n for n in os.listdir(lib) if n.startswith('_ctypes.'))\n"
     "spec = importlib.util.spec_from_file_location('mine', os.path.join(lib, name))\n"
     "importlib.util.module_from_spec(spec)", "loading"),
    # an extension module from anywhere but the standard library (a copy of a harmless one)
    ("import os, shutil, sys, _typing\nshutil.copy(_typing.__file__, os.path.basename(_typing.__file__)"
     ".replace('_typing', 'mine'))\nsys.path.insert(0, '.')\nimport mine", "loading"),
])
def test_the_usual_ways_around_the_hook_are_refused(run, code, refused):
    result = run(code, QUICK)
    assert not result.ok and "PermissionError: sandbox:" in result.stderr
    if refused is not None:
        assert refused in result.stderr


def test_patching_os_does_not_change_the_hook(run, tmp_path):
    target = tmp_path / "escaped"
    result = run(f"import os, os.path, builtins\nos.path.realpath = os.path.abspath = lambda p: os.getcwd()\n"
                      f"os.stat = os.readlink = os.getcwd = lambda *a: None\nbuiltins.isinstance = lambda *a: False\n"
                      f"open({str(target)!r}, 'w')", QUICK)
    assert "PermissionError: sandbox: writing outside" in result.stderr
    assert not target.exists()


# ---- the tool, through the real tool path (a guarded worker process)


@pytest.fixture(scope="module")
def toolbox():
    box = ToolBox([env.run_python], timeout_s=10.0, workers=1)  # 10 s: the config's task.tool_timeout_s default
    yield box
    box.close()


def call(box: ToolBox, code: str) -> ToolResult:
    return asyncio.run(box.run(ToolCall("run_python", {"code": code})))


def test_the_tool_returns_what_the_program_prints(toolbox):
    result = call(toolbox, "print(59 * 63)")
    assert not result.error and result.content == "3717"
    assert call(toolbox, "import sys\nprint(1)\nprint('warn', file=sys.stderr)").content == "1\nstderr:\nwarn"


@pytest.mark.parametrize("code, says", [
    ("print(1 / 0)", ["exit code 1", 'File "main.py", line 1', "ZeroDivisionError: division by zero"]),
    ("import os\nwhile True:\n    os.fork()", ["PermissionError: sandbox: os.fork is not allowed (no new processes)"]),
    ("import os\nos.system('echo hi')", ["PermissionError: sandbox: os.system is not allowed"]),
    ("x = bytearray(10**10)", ["failed: memory limit (256 MB)", "MemoryError"]),
    ("open('/tmp/lora-async-sandbox-test-escape', 'w')", ["writing outside the working directory is not allowed"]),
    ('print("x" * 10**7)', ["failed: output or file size limit (64 KB)", "[output cut at 2000 characters]"]),
    # whichever limit the program meets first: on a loaded machine it may get under CPU_S of CPU
    # in WALL_S (the CPU limit alone is tested above, with a wall limit it never reaches)
    ("while True:\n    pass", [(f"killed: CPU time limit ({env.CPU_S}s)", f"timed out after {env.WALL_S:g}s")]),
])
def test_a_fault_is_an_error_the_model_reads_and_the_next_call_works(toolbox, code, says):
    errors = toolbox.errors
    result = call(toolbox, code)
    assert result.error and result.content.startswith("error: ProgramError: ")
    for text in says:  # a tuple: any one of them
        assert any(option in result.content for option in (text if isinstance(text, tuple) else (text,))), text
    assert len(result.content) < 2 * env.OUTPUT_CHARS + 500  # cut: a context stays short
    assert toolbox.errors == errors + 1 and toolbox.timeouts == 0  # the sandbox cut it off, not the toolbox
    assert not Path("/tmp/lora-async-sandbox-test-escape").exists()
    after = call(toolbox, "print(12 * 34)")
    assert not after.error and after.content == "408"


def test_the_tool_wall_limit_is_under_the_example_configs_tool_timeout():
    from lora_async.config import load_config

    (spec,) = load_config(Path(__file__).resolve().parent.parent / "examples" / "sandbox.toml").adapter_specs
    assert spec.task.env == "lora_async.envs.builtin.sandbox:make"
    assert env.WALL_S + 1 < spec.task.tool_timeout_s  # the sandbox cuts a program off, and says why


# ---- the environment


def test_problems_are_pure_and_the_splits_disjoint():
    assert [(e.a, e.b) for e in map(lambda i: env.make(i, "train"), range(50))] == \
        [(e.a, e.b) for e in map(lambda i: env.make(i, "train"), range(50))]
    train = {(e.a, e.b) for e in (env.make(i, "train") for i in range(400))}
    heldout = {(e.a, e.b) for e in (env.make(i, "eval") for i in range(400))}
    assert train and heldout and not train & heldout
    assert all(calculator.is_heldout(a, b) for a, b in heldout) and not any(calculator.is_heldout(a, b) for a, b in train)
    assert not (train | heldout) & set(calculator.EXAMPLES)
    assert env.make(3, "train").reset() == env.make(3, "train").reset()


def test_the_opening_shows_worked_examples_that_the_real_tool_answers():
    problem = env.make(0, "eval")
    messages = problem.reset()
    assert messages[0]["role"] == "system" and "run_python" in messages[0]["content"]
    assert [m["role"] for m in messages[1:]] == ["user", "assistant", "tool", "assistant"] * 2 + ["user"]
    assert messages[-1]["content"] == f"Compute {problem.a} times {problem.b}."
    for question, call_message, tool, answer in zip(*[iter(messages[1:-1])] * 4):
        calls, errors = parse_tool_calls(call_message["content"])
        assert errors == [] and len(calls) == 1 and calls[0].name == "run_python"
        assert env.run_python(**calls[0].arguments) == tool["content"] == answer["content"]
    (schema,) = tool_schemas(env.Program.tools)
    assert schema["function"]["name"] == "run_python"
    assert schema["function"]["parameters"]["required"] == ["code"]


def reply(text: str, turn: int, results: list[ToolResult] = ()) -> Reply:
    calls, _ = parse_tool_calls(text)
    content = text if not calls else ""
    return Reply(text=text, content=content, tool_calls=calls, tool_results=list(results), turn=turn)


def test_step_rewards_the_right_final_number_only():
    problem = env.make(5, "eval")
    code_call = '<tool_call>{"name": "run_python", "arguments": {"code": "print(%d * %d)"}}</tool_call>' % (
        problem.a, problem.b)
    call_ = parse_tool_calls(code_call)[0][0]
    first = problem.step(reply(code_call, 1, [ToolResult(call_, str(problem.answer))]))
    assert not first.done and first.reward == 0.0
    right = problem.step(reply(f"{problem.answer}", 2))
    assert right.done and right.reward == 1.0
    assert right.info == {"success": True, "answer": problem.answer, "used_tool": True}
    wrong = env.make(5, "eval").step(reply(f"{problem.answer + 1}", 1))
    assert wrong.done and wrong.reward == 0.0 and wrong.info["success"] is False and not wrong.info["used_tool"]
    assert env.make(5, "eval").step(reply("I cannot say.", 1)).reward == 0.0


# ---- the `programs` environment: questions whose programs need a loop


def test_programs_are_pure_take_turns_by_kind_and_keep_their_splits_apart():
    from lora_async.envs.builtin import programs

    assert [(p.kind.name, p.args) for p in map(lambda i: programs.make(i, "train"), range(40))] == \
        [(p.kind.name, p.args) for p in map(lambda i: programs.make(i, "train"), range(40))]
    assert [programs.make(i, "eval").kind.name for i in range(4)] == [k.name for k in programs.KINDS]
    train = {(p.kind.name, p.args) for p in (programs.make(i, "train") for i in range(400))}
    heldout = {(p.kind.name, p.args) for p in (programs.make(i, "eval") for i in range(400))}
    assert len(heldout) > 300 and train and not train & heldout  # over 100 distinct held-out questions
    shown = {(name, args) for name, examples in programs.EXAMPLE_ARGS.items() for args in examples}
    assert not (train | heldout) & shown


@pytest.mark.parametrize("index", range(4))
def test_each_kinds_worked_examples_run_to_their_answers_and_the_question_is_reworded(index):
    from lora_async.envs.builtin import programs

    problem = programs.make(index, "eval")
    messages = problem.reset()
    assert [m["role"] for m in messages[1:]] == ["user", "assistant", "tool", "assistant"] * 2 + ["user"]
    for (question, call_message, tool, answer), args in zip(zip(*[iter(messages[1:-1])] * 4),
                                                           programs.EXAMPLE_ARGS[problem.kind.name]):
        calls, errors = parse_tool_calls(call_message["content"])
        assert errors == [] and calls[0].name == "run_python" and "range(" in calls[0].arguments["code"]
        assert programs.run_python(**calls[0].arguments) == tool["content"] == answer["content"]
        assert question["content"] == problem.kind.example.format(*args)
    assert messages[-1]["content"] == problem.kind.question.format(*problem.args) != \
        problem.kind.example.format(*problem.args)
    # the example's program with the question's numbers computes the question's answer
    code = problem.kind.program.format(*problem.args)
    assert programs.run_python(code) == str(problem.answer)
    right = problem.step(reply(str(problem.answer), 1))
    assert right.done and right.reward == 1.0 and right.info["kind"] == problem.kind.name
