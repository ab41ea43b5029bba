"""Code rewards with unit tests: `run_python(code, tests=...)` and the builtin `code_tests` reward.

The tests run in the sandbox's harness (`lora_async/sandbox/prelude.py`), which reports a
verdict per test under a nonce the program never sees: a program that prints verdicts of its
own, exits early or patches builtins cannot score what it did not pass. The reward runs in the
reward pool, so a group's programs run at once. Unit tier: real sandboxes, no engine.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys

import pytest

from lora_async.config import JsonlTask
from lora_async.rewards import Batch, make_rewards
from lora_async.rewards.code import last_python_block
from lora_async.rollout import RewardStats
from lora_async.sandbox import SandboxLimits, InvalidTests, describe, run_python
from lora_async.tasks import make_task

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux's")

ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'",
             "assert add(2, 2) == 5"]  # the last one is wrong on purpose: 3 of 4 pass
SUM_IO = [{"input": "2 3\n", "output": "5"}, {"input": "10 -4\n", "output": "6\n"}, {"input": "1 1", "output": "3"}]


@pytest.fixture(params=["namespaces", "process"])
def isolation(request):
    return request.param


def fraction(code: str, tests, isolation: str, limits: SandboxLimits = SandboxLimits()) -> float:
    result = run_python(code, tests=tests, limits=limits, isolation=isolation)
    assert result.tests is not None
    return result.tests.fraction


def test_asserts_score_the_fraction_that_pass(isolation):
    result = run_python(ADD, tests=ADD_TESTS, isolation=isolation)
    assert result.ok and result.tests is not None
    assert (result.tests.passed, result.tests.total) == (3, 4) and result.tests.fraction == 0.75
    assert result.tests.failures == ("test 3: AssertionError",)
    assert result.stdout == ""  # the verdicts are not the program's output
    # the same tests as one block of code, or as a JSON string, as a dataset column may hold them
    assert fraction(ADD, "\n".join(ADD_TESTS), isolation) == 0.75
    assert fraction(ADD, json.dumps(ADD_TESTS), isolation) == 0.75


def test_input_output_cases_compare_stdout(isolation):
    program = "a, b = map(int, input().split())\nprint(a + b)\n"
    result = run_python(program, tests=SUM_IO, isolation=isolation)
    assert result.tests is not None and result.tests.passed == 2
    assert result.tests.failures == ("test 2: wrong output",)
    apps_form = {"inputs": [c["input"] for c in SUM_IO], "outputs": [c["output"] for c in SUM_IO]}
    assert fraction(program, apps_form, isolation) == pytest.approx(2 / 3)
    # each case is a fresh run of the program: state does not leak from one to the next
    counter = "import sys\nseen = globals().setdefault('seen', [])\nseen.append(1)\nprint(len(seen))"
    assert fraction(counter, [{"input": "", "output": "1"}] * 3, isolation) == 1.0


def test_a_program_that_fails_or_hangs_passes_nothing(isolation):
    assert fraction("def add(a, b):\n    return a +\n", ADD_TESTS, isolation) == 0.0  # a syntax error
    assert fraction("raise SystemExit(3)\n" + ADD, ADD_TESTS, isolation) == 0.0
    # the verdicts are written once, after the last test: a run cut off at a limit has none
    loops = ADD + "def spin():\n    while True:\n        pass\n"
    result = run_python(loops, tests=["assert add(1, 1) == 2", "spin()", "assert add(1, 2) == 3"],
                        limits=SandboxLimits(cpu_s=1, wall_s=15.0), isolation=isolation)
    assert result.tests is not None and result.tests.passed == 0 and result.tests.total == 3
    assert result.reason == "killed: CPU time limit (1s)"
    assert all("not reached" in failure for failure in result.tests.failures)


@pytest.mark.parametrize("cheat", [
    # a verdict of its own, in the harness's format, with guessed nonces
    "import os\nfor n in ('0' * 32, 'x'):\n    for i in range(4):\n        os.write(1, f'{n} {i} pass \\n'.encode())",
    # leave before the tests run, with success
    "import os\nos._exit(0)",
    # look for the nonce in the frames that called it, or in the gc's lists
    "import sys\nf = sys._getframe(1)\nprint(f.f_locals)",
    "try:\n    1 / 0\nexcept Exception as e:\n    print(e.__traceback__.tb_frame.f_back.f_locals)",
    "import gc\nprint([o for o in gc.get_objects() if isinstance(o, str) and len(o) == 32])",
    # patch what the harness uses to judge
    "import builtins\nbuiltins.str = lambda *a: 'x'\nbuiltins.len = lambda *a: 0\nbuiltins.BaseException = KeyError",
    # read the tests and the nonce from stdin (the harness has read them, and fd 0 is /dev/null)
    "import sys\nprint(sys.stdin.read())",
    "import os\nos.lseek(0, 0, 0)\nprint(os.read(0, 100000))\nprint(open('/proc/self/fd/0').read())",
    # a thread, or a signal handler, that waits for the real verdicts and rewrites them
    "import threading\nthreading.Thread(target=print).start()",
    "import os, signal\n"
    "def forge(*_):\n"
    "    data = open('/proc/self/fd/1', 'rb').read()\n"
    "    if b' 0 ' in data:\n"
    "        nonce = data.split()[0]\n"
    "        os.ftruncate(1, 0)\n"
    "        os.write(1, b''.join(b'%s %d pass x\\n' % (nonce, i) for i in range(4)))\n"
    "signal.signal(signal.SIGALRM, forge)\nsignal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)",
])
def test_a_program_cannot_forge_its_verdicts(isolation, cheat):
    result = run_python(cheat, tests=ADD_TESTS, isolation=isolation)
    assert result.tests is not None and result.tests.passed == 0, result
    assert "assert add" not in result.stdout


def test_bad_tests_are_a_clear_error():
    with pytest.raises(InvalidTests, match="non-empty list"):
        run_python(ADD, tests=[])
    with pytest.raises(InvalidTests, match="all be assert statements"):
        run_python(ADD, tests=["assert True", {"input": "", "output": ""}])


def test_the_last_fenced_python_block_is_the_program():
    assert last_python_block("no code here") is None
    assert last_python_block("```python\nx = 1\n```\nthen\n```py\ny = 2\n```") == "y = 2\n"
    assert last_python_block("```\nplain = 1\n```") == "plain = 1\n"
    assert last_python_block("text\n```python\ncut = 1\nat the token limit") == "cut = 1\nat the token limit"


def score(rewards, completions, fields):
    return asyncio.run(rewards.score(Batch("Write add.", "", completions, [], fields)))


def test_the_reward_scores_a_group_at_once_in_the_pool():
    stats = RewardStats()
    rewards = make_rewards(["code_tests"], None, timeout_s=10.0, workers=4, stats=stats)
    try:
        fenced = f"Here it is:\n```python\n{ADD}```"
        napping = f"```python\nimport time\ntime.sleep(2)\n{ADD}```"
        # workers start on demand, when calls queue: a first group of naps starts three, so the
        # naps measured below wait for no worker to start
        assert score(rewards, [napping] * 3, {"tests": ADD_TESTS}).rewards == [0.75] * 3
        scores = score(rewards, [fenced, "def add(a, b): return a + b  (no fence)", napping, napping, napping],
                       {"tests": ADD_TESTS})
        assert scores.rewards == [0.75, 0.0, 0.75, 0.75, 0.75] and scores.fault is None
        # the three 2-second programs ran at the same time: their calls overlap
        naps = sorted((c.started, c.ended) for c in scores.calls[2:])
        assert all(later[0] < earlier[1] for earlier, later in zip(naps, naps[1:]))
        # a record without tests is an error, counted and shown (not a silent 0)
        scores = score(rewards, [fenced], {})
        assert scores.rewards == [0.0] and "needs a `tests` column" in scores.fault
        assert stats.errors == 1
    finally:
        rewards.close()


def test_the_start_line_names_the_isolation_and_the_workers_use_it(tmp_path):
    assert describe("namespaces").startswith("namespaces (bwrap ")
    assert describe("process").startswith("a process with rlimits and an audit hook, no namespaces")
    data = tmp_path / "code.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Write add ({i}).", "answer": ADD, "tests": ADD_TESTS}) + "\n"
                            for i in range(3)))
    for sandbox in ("namespaces", "process"):
        task = make_task(JsonlTask(path=str(data), reward="code_tests", heldout=1, sandbox=sandbox), seed=0)
        try:
            assert "programs run in " + describe(sandbox) in task.describe()
            problem = task.train_problem(0)
            assert asyncio.run(task.rewards.score(problem.batch([f"```python\n{ADD}```"]))).rewards == [0.75]
            # the setting reaches the reward's workers: only namespaces have /work as the working directory
            where = "```python\nimport os\ncwd = os.getcwd()\n```"
            batch = Batch(problem.prompt, "", [where], [], {"tests": ["assert cwd == '/work'"]})
            assert asyncio.run(task.rewards.score(batch)).rewards == [1.0 if sandbox == "namespaces" else 0.0]
        finally:
            task.close()


def test_the_example_problems_are_what_the_script_writes_and_their_answers_pass(tmp_path):
    """examples/data/code_tests.jsonl: regenerated byte for byte by its script; every reference
    answer passes all its tests in the sandbox; the held-out records' functions are never trained."""
    import shutil
    import subprocess
    from pathlib import Path

    from lora_async.config import load_config

    data = Path(__file__).resolve().parent.parent / "examples" / "data"
    shutil.copy(data / "make_code_tests.py", tmp_path)
    subprocess.run([sys.executable, str(tmp_path / "make_code_tests.py")], check=True, capture_output=True)
    assert (tmp_path / "code_tests.jsonl").read_bytes() == (data / "code_tests.jsonl").read_bytes()
    records = [json.loads(line) for line in (data / "code_tests.jsonl").read_text().splitlines()]
    (spec,) = load_config(data.parent / "code_tests.toml").adapter_specs
    assert spec.task.reward == "code_tests" and spec.task.sandbox == "namespaces"
    heldout = records[-spec.task.heldout:]
    assert len(records) >= 40 + len(heldout)
    name = re.compile(r"`(\w+)\(")
    assert not {name.search(r["prompt"]).group(1) for r in heldout} & \
        {name.search(r["prompt"]).group(1) for r in records[:-spec.task.heldout]}
    for record in records:
        result = run_python(record["answer"], tests=record["tests"])
        assert result.tests is not None and result.tests.fraction == 1.0, (record, result.tests)
