"""Reward functions: builtins, and user functions that raise or hang."""

import time

import pytest

from lora_async.config import ArithmeticTask, JsonlTask
from lora_async.tasks import RewardError, RewardStats, make_task
from lora_async.tasks.rewards import UserReward, final_number, numeric_reward

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
        assert fn("p", "c", "a") == 0.0
        assert stats.errors == 1 and "reward exploded" in stats.last_error
    finally:
        fn.close()


def test_user_reward_that_hangs_times_out_and_recovers(user_module):
    stats = RewardStats()
    fn = UserReward(f"{user_module}:slow", 1.0, stats)
    try:
        started = time.time()
        assert fn("p", "please hang", "a") == 0.0
        assert time.time() - started < 10
        assert stats.timeouts == 1 and stats.errors == 1
        assert fn("p", "fine", "a") == 1.0  # a fresh worker took over
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
    with pytest.raises(RewardError, match="could not be loaded"):
        make_task(JsonlTask(path=str(data), reward="no_such_module:fn"), seed=0)


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
