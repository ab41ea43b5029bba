"""Reward functions: builtins, and user functions that raise, hang or take keywords."""

import time

import pytest

from lora_async.config import ArithmeticTask, JsonlTask
from lora_async.tasks import Problem, RewardError, RewardStats, make_task
from lora_async.tasks.rewards import UserReward, final_number, make_reward, numeric_reward, safe_rewards

USER_MODULE = '''
import time
def good(prompt, completion, answer):
    return float(answer in completion)
def boom(prompt, completion, answer):
    raise RuntimeError("reward exploded")
def slow(prompt, completion, answer):
    if "hang" in completion:
        time.sleep(60)
    return 1.0
def junk(prompt, completion, answer):
    return "not a number"
def trl_style(completion, answer, **kwargs):
    return float(answer in completion) + 0.5 * (kwargs.get("source") == "web")
def by_difficulty(completion, difficulty):
    return float(difficulty) if "ok" in completion else 0.0
def needs_solution(completion, solution):
    return 1.0
class Scorers:
    @staticmethod
    def length(completion):
        return len(completion)
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    return "my_rewards"


def test_final_number_and_numeric():
    assert final_number("3 + 4 = 7.") == 7.0
    assert final_number("no digits") is None
    assert numeric_reward("The answer is 1,024", "1024") == 1.0
    assert numeric_reward("7 then 8", "7") == 0.0


def test_user_reward_that_raises_scores_zero_and_counts(user_module):
    stats = RewardStats()
    fn = UserReward(f"{user_module}:boom", 5.0, stats)
    try:
        problem = Problem(0, "p", "a")
        assert safe_rewards(fn, stats, problem, ["c"]) == [0.0]
        assert stats.errors == 1 and stats.calls == 1
        # The error text names the exception, its message and where it was raised.
        assert "RuntimeError: reward exploded (" in stats.last_error
        assert "my_rewards.py:6)" in stats.last_error  # line 6 of USER_MODULE: the raise
    finally:
        fn.close()


def test_user_reward_that_hangs_times_out_and_recovers(user_module):
    stats = RewardStats()
    fn = UserReward(f"{user_module}:slow", 1.0, stats)
    try:
        problem = Problem(0, "p", "a")
        started = time.time()
        assert safe_rewards(fn, stats, problem, ["please hang"]) == [0.0]
        assert time.time() - started < 10
        assert stats.timeouts == 1 and stats.errors == 1 and "timed out after 1s" in stats.last_error
        assert safe_rewards(fn, stats, problem, ["fine"]) == [1.0]  # a fresh worker took over
    finally:
        fn.close()


def test_jsonl_task_with_user_rewards(tmp_path, user_module):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "say x", "answer": "x"}\n{"prompt": "say y", "answer": "y"}\n'
                    '{"prompt": "say z", "answer": "z"}\n')
    task = make_task(JsonlTask(path=str(data), reward=f"{user_module}:good", heldout=1), seed=0)
    try:
        problem = task.train_problem(0)
        assert task.rewards(problem, [problem.answer, "nope"]) == [1.0, 0.0]
        assert [p.answer for p in task.heldout()] == ["z"]
        assert {task.train_problem(i).answer for i in range(4)} == {"x", "y"}
    finally:
        task.close()
    junk = make_task(JsonlTask(path=str(data), reward=f"{user_module}:junk"), seed=0)
    try:
        assert junk.rewards(junk.train_problem(0), ["a"]) == [0.0] and junk.stats.errors == 1
    finally:
        junk.close()


def test_unloadable_user_reward_is_a_clear_error(tmp_path, user_module):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "p", "answer": "a"}\n')
    with pytest.raises(RewardError, match="could not be loaded.*No module named 'no_such_module'"):
        make_task(JsonlTask(path=str(data), reward="no_such_module:fn"), seed=0)
    with pytest.raises(RewardError, match="could not be loaded.*has no attribute 'missing'"):
        make_task(JsonlTask(path=str(data), reward=f"{user_module}:missing"), seed=0)


def test_trl_style_reward_gets_keywords_and_extra_fields(user_module):
    stats = RewardStats()
    fn = make_reward(f"{user_module}:trl_style", 5.0, stats)
    try:
        problem = Problem(0, "say 7", "7", {"source": "web"})
        assert safe_rewards(fn, stats, problem, ["it is 7", "no"]) == [1.5, 0.5]
        assert stats.errors == 0
    finally:
        fn.close()


def test_static_method_by_dotted_name(user_module):
    stats = RewardStats()
    fn = make_reward(f"{user_module}:Scorers.length", 5.0, stats)
    try:
        assert safe_rewards(fn, stats, Problem(0, "p", "a"), ["abc"]) == [3.0]
    finally:
        fn.close()


def test_jsonl_fields_reach_the_reward_and_the_startup_line(tmp_path, user_module):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "p1", "answer": "a", "difficulty": 2, "source": "web"}\n'
                    '{"prompt": "p2", "answer": "b", "difficulty": 3, "source": "book"}\n')
    task = make_task(JsonlTask(path=str(data), reward=f"{user_module}:by_difficulty", heldout=1), seed=0)
    try:
        problem = task.train_problem(0)
        assert problem.fields == {"difficulty": 2, "source": "web"}
        assert task.heldout()[0].fields == {"difficulty": 3, "source": "book"}
        assert task.rewards(problem, ["ok", "bad"]) == [2.0, 0.0] and task.stats.errors == 0
        assert task.reward_line() == (f"reward {user_module}:by_difficulty gets completion, difficulty "
                                      "(of prompt, completion, answer, difficulty, source)")
    finally:
        task.close()
    trl = make_task(JsonlTask(path=str(data), reward=f"{user_module}:trl_style"), seed=0)
    try:
        assert trl.reward_line() == (f"reward {user_module}:trl_style gets prompt, completion, answer, "
                                     "difficulty, source (of prompt, completion, answer, difficulty, source)")
    finally:
        trl.close()
    needy = make_task(JsonlTask(path=str(data), reward=f"{user_module}:needs_solution"), seed=0)
    try:
        assert needy.reward_line().endswith("; it also needs solution, which no field provides")
        assert needy.rewards(needy.train_problem(0), ["x"]) == [0.0]
        assert "missing a required argument: 'solution'" in needy.stats.last_error
    finally:
        needy.close()
    builtin = make_task(JsonlTask(path=str(data), reward="exact"), seed=0)
    assert builtin.reward_line() == "reward exact gets completion, answer"
    p = builtin.train_problem(0)
    assert builtin.rewards(p, [p.answer, "zz"]) == [1.0, 0.0]
    regex = make_reward("regex:^ok", 1.0, RewardStats())
    assert regex.describe(["prompt", "completion", "answer"]) == "reward regex:^ok gets completion"


def test_arithmetic_split_is_fixed_and_disjoint():
    task = make_task(ArithmeticTask(digits=1, ops=["+"]), seed=0)
    other_seed = make_task(ArithmeticTask(digits=1, ops=["+"]), seed=7)
    held = {p.prompt for p in task.heldout()}
    assert held == {p.prompt for p in other_seed.heldout()} and 15 <= len(held) <= 40
    train = {task.train_problem(i).prompt for i in range(500)}
    assert not held & train and len(train) + len(held) == 100
    assert task.train_problem(3) == make_task(ArithmeticTask(), seed=0).train_problem(3)
    p = task.train_problem(0)
    assert task.rewards(p, [f"It is {p.answer}", "no"]) == [1.0, 0.0]
