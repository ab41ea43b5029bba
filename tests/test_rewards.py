"""Reward functions: builtins, user functions in three forms (per sample, batched TRL-style, async),
several with weights, and user functions that raise, hang or return junk."""

import asyncio
import json

import pytest

from lora_async.config import ArithmeticTask, JsonlTask
from lora_async.rewards import Batch, RewardError, make_rewards
from lora_async.rewards.builtin import final_number, numeric_reward
from lora_async.rewards.scoring import function_names
from lora_async.rollout import RewardStats
from lora_async.tasks import Problem, TaskDataError, make_task

USER_MODULE = '''
import asyncio, time
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
def gather(completion):
    # Mark this call's arrival, then wait until all 6 calls have arrived: only calls that run
    # at the same time can all return 1.0 (one at a time, the first would wait until cut off).
    import os, uuid
    os.makedirs("arrived", exist_ok=True)
    open(os.path.join("arrived", uuid.uuid4().hex), "w").close()
    while len(os.listdir("arrived")) < 6:
        time.sleep(0.01)
    return 1.0
async def async_nap(completion):
    await asyncio.sleep(60 if "hang" in completion else 1.0)
    return 1.0
def batched(prompts, completions, completion_ids, answer, **kwargs):
    with open("batched_call.json", "w") as f:
        json_fields = {k: v for k, v in kwargs.items()}
        import json
        json.dump({"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                   "answer": answer, **json_fields}, f)
    return [None if c == "skip" else float(c == a) for c, a in zip(completions, answer)]
def batched_short(completions, **kwargs):
    return [1.0] * (len(completions) - 1)
def batched_scalar(completions, **kwargs):
    return 1.0
def fmt(completion):
    return 1.0 if completion.startswith("<") else 0.0
def not_mine(completion):
    return None
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


def score(rewards, prompt, answer, completions, fields=None, ids=None):
    return asyncio.run(rewards.score(Batch(prompt, answer, completions, ids or [], fields or {})))


def rewards_of(specs, stats=None, weights=None, timeout_s=5.0, workers=8):
    return make_rewards(specs, weights, timeout_s, workers, stats if stats is not None else RewardStats())


def test_final_number_and_numeric():
    assert final_number("3 + 4 = 7.") == 7.0
    assert final_number("no digits") is None
    assert numeric_reward("The answer is 1,024", "1024") == 1.0
    assert numeric_reward("7 then 8", "7") == 0.0


def test_user_reward_that_raises_scores_zero_and_counts(user_module):
    stats = RewardStats()
    rewards = rewards_of([f"{user_module}:boom"], stats)
    try:
        scores = score(rewards, "p", "a", ["c"])
        assert scores.rewards == [0.0] and stats.errors == 1 and stats.calls == 1
        # The error text names the function, the exception, its message and where it was raised.
        assert scores.fault == stats.first_error
        assert stats.last_error.startswith(f"{user_module}:boom: RuntimeError: reward exploded (")
        assert "my_rewards.py:6)" in stats.last_error  # line 6 of USER_MODULE: the raise
        assert stats.never_worked() == stats.first_error
    finally:
        rewards.close()


def test_user_reward_that_hangs_is_cut_off_alone(user_module):
    """The hanging call times out; the group's other calls are scored, and the pool goes on."""
    stats = RewardStats()
    rewards = rewards_of([f"{user_module}:slow"], stats, timeout_s=1.0)
    try:
        scores = score(rewards, "p", "a", ["please hang", "fine", "fine too"])
        assert scores.rewards == [0.0, 1.0, 1.0]
        assert stats.timeouts == 1 and stats.errors == 1 and "timed out after 1s" in stats.last_error
        assert score(rewards, "p", "a", ["fine"]).rewards == [1.0]  # a fresh worker took the hung one's place
    finally:
        rewards.close()


def test_slow_rewards_overlap_in_time(user_module):
    """N calls of a reward run at once: each waits until all N have started, and every one
    returns its score (one call at a time, the first would be cut off at the timeout)."""
    stats = RewardStats()
    rewards = rewards_of([f"{user_module}:gather"], stats, timeout_s=120.0, workers=6)
    try:
        scores = score(rewards, "p", "a", ["x"] * 6)
        assert scores.rewards == [1.0] * 6 and len(scores.calls) == 6
        assert stats.timeouts == 0 and stats.errors == 0
    finally:
        rewards.close()


def test_async_rewards_overlap_and_a_hanging_one_is_cancelled(user_module):
    """An async def reward runs its calls concurrently in one worker; the one that hangs is cut
    off at the timeout while the others finish with their scores."""
    stats = RewardStats()
    rewards = rewards_of([f"{user_module}:async_nap"], stats, timeout_s=3.0)
    try:
        assert rewards.functions[0].is_async
        scores = score(rewards, "p", "a", ["a", "hang", "b", "c"])
        assert scores.rewards == [1.0, 0.0, 1.0, 1.0]
        assert stats.timeouts == 1 and "timed out after 3s" in stats.first_error
        done = [c for c, r in zip(scores.calls, scores.rewards) if r == 1.0]
        assert max(c.started for c in done) < min(c.ended for c in done)
        assert score(rewards, "p", "a", ["d"]).rewards == [1.0]  # the worker lives on
    finally:
        rewards.close()


def test_batched_reward_gets_lists_of_every_field(user_module, tmp_path):
    rewards = rewards_of([f"{user_module}:batched"])
    try:
        assert rewards.functions[0].batched
        scores = score(rewards, "say x", "x", ["x", "y", "skip"], fields={"source": "web"}, ids=[[1], [2, 3], [4]])
        # None: not scored by this function (counted as no reward, not as an error)
        assert scores.parts == {"batched": [1.0, 0.0, None]} and scores.rewards == [1.0, 0.0, 0.0]
        assert scores.fault is None and len(scores.calls) == 1
        got = json.loads((tmp_path / "batched_call.json").read_text())
        assert got == {"prompts": ["say x"] * 3, "completions": ["x", "y", "skip"], "completion_ids": [[1], [2, 3], [4]],
                       "answer": ["x"] * 3, "source": ["web"] * 3}
    finally:
        rewards.close()


def test_batched_reward_of_chat_prompt_gets_messages(user_module, tmp_path):
    rewards = rewards_of([f"{user_module}:batched"])
    chat = [{"role": "user", "content": "say x"}]
    try:
        score(rewards, chat, "x", ["x", "y"])
        got = json.loads((tmp_path / "batched_call.json").read_text())
        assert got["prompts"] == [chat, chat]
        assert got["completions"] == [[{"role": "assistant", "content": "x"}], [{"role": "assistant", "content": "y"}]]
    finally:
        rewards.close()


@pytest.mark.parametrize("spec, wanted", [
    ("batched_short", "returned 2 values for 3 completions; a batched reward returns one float or None per completion"),
    ("batched_scalar", "returned 1.0 (a float), not a list"),
])
def test_batched_reward_of_the_wrong_shape_is_a_clear_error(user_module, spec, wanted):
    stats = RewardStats()
    rewards = rewards_of([f"{user_module}:{spec}"], stats)
    try:
        scores = score(rewards, "p", "a", ["a", "b", "c"])
        assert scores.rewards == [0.0, 0.0, 0.0] and stats.errors == 3
        assert scores.fault.startswith(f"{user_module}:{spec}: ") and wanted in scores.fault
        assert stats.never_worked() == scores.fault  # every call failed: the run stops after its first step
    finally:
        rewards.close()


def test_weights_combine_and_each_function_keeps_its_values(user_module):
    stats = RewardStats()
    rewards = rewards_of([f"{user_module}:good", f"{user_module}:fmt", f"{user_module}:not_mine"], stats,
                         weights=[1.0, 0.2, 5.0])
    try:
        scores = score(rewards, "p", "x", ["<x>", "x", "<y>", "z"])
        assert scores.parts == {"good": [1.0, 1.0, 0.0, 0.0], "fmt": [1.0, 0.0, 1.0, 0.0],
                                "not_mine": [None] * 4}
        assert scores.rewards == pytest.approx([1.2, 1.0, 0.2, 0.0])
        assert stats.errors == 0 and stats.calls == 4
        line = rewards.describe(["prompt", "completion", "answer"])
        assert line.endswith("weights good 1, fmt 0.2, not_mine 5")
    finally:
        rewards.close()


def test_a_function_that_never_works_is_found_beside_one_that_does(user_module):
    stats = RewardStats()
    rewards = rewards_of([f"{user_module}:good", f"{user_module}:boom"], stats)
    try:
        score(rewards, "p", "a", ["a", "b"])
        assert stats.errors == 2 and stats.calls == 2  # every completion had a failure
        stats.calls += 10  # even when other completions scored fine, the broken function is named
        assert "reward exploded" in stats.never_worked()
    finally:
        rewards.close()


def test_metric_names():
    assert function_names(["numeric", "m:correct", "m:Scorers.length", "regex:a", "regex:b", "n:correct"]) == [
        "numeric", "correct", "length", "regex", "regex_2", "correct_2"]


def test_unloadable_user_reward_is_a_clear_error(tmp_path, user_module):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "p", "answer": "a"}\n')
    with pytest.raises(RewardError, match="could not be loaded.*No module named 'no_such_module'"):
        make_task(JsonlTask(path=str(data), reward="no_such_module:fn"), seed=0)
    with pytest.raises(RewardError, match="could not be loaded.*has no attribute 'missing'"):
        make_task(JsonlTask(path=str(data), reward=f"{user_module}:missing"), seed=0)


def test_trl_style_reward_gets_keywords_and_extra_fields(user_module):
    stats = RewardStats()
    rewards = rewards_of([f"{user_module}:trl_style"], stats)
    try:
        assert score(rewards, "say 7", "7", ["it is 7", "no"], fields={"source": "web"}).rewards == [1.5, 0.5]
        assert stats.errors == 0
    finally:
        rewards.close()


def test_static_method_by_dotted_name(user_module):
    rewards = rewards_of([f"{user_module}:Scorers.length"])
    try:
        assert score(rewards, "p", "a", ["abc"]).rewards == [3.0]
    finally:
        rewards.close()


def test_jsonl_task_with_user_rewards(tmp_path, user_module):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "say x", "answer": "x"}\n{"prompt": "say y", "answer": "y"}\n'
                    '{"prompt": "say z", "answer": "z"}\n')
    task = make_task(JsonlTask(path=str(data), reward=f"{user_module}:good", heldout=1), seed=0)
    try:
        problem = task.train_problem(0)
        assert asyncio.run(task.rewards.score(problem.batch([problem.answer, "nope"]))).rewards == [1.0, 0.0]
        assert [p.answer for p in task.heldout()] == ["z"]
        assert {task.train_problem(i).answer for i in range(4)} == {"x", "y"}
    finally:
        task.close()
    junk = make_task(JsonlTask(path=str(data), reward=f"{user_module}:junk"), seed=0)
    try:
        assert asyncio.run(junk.rewards.score(junk.train_problem(0).batch(["a"]))).rewards == [0.0]
        assert junk.stats.errors == 1 and "not a number" in junk.stats.first_error
    finally:
        junk.close()


def test_jsonl_fields_reach_the_reward_and_the_startup_line(tmp_path, user_module):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "p1", "answer": "a", "difficulty": 2, "source": "web"}\n'
                    '{"prompt": "p2", "answer": "b", "difficulty": 3, "source": "book"}\n')
    task = make_task(JsonlTask(path=str(data), reward=f"{user_module}:by_difficulty", heldout=1), seed=0, in_flight=4)
    try:
        problem = task.train_problem(0)
        assert problem.fields == {"difficulty": 2, "source": "web"}
        assert task.heldout()[0].fields == {"difficulty": 3, "source": "book"}
        assert asyncio.run(task.rewards.score(problem.batch(["ok", "bad"]))).rewards == [2.0, 0.0]
        assert task.stats.errors == 0
        assert task.reward_line() == (f"reward {user_module}:by_difficulty (4 at once) gets completion, difficulty "
                                      "(of prompt, completion, answer, difficulty, source)")
    finally:
        task.close()
    trl = make_task(JsonlTask(path=str(data), reward=f"{user_module}:trl_style"), seed=0)
    try:
        assert trl.reward_line() == (f"reward {user_module}:trl_style (1 at once) gets prompt, completion, answer, "
                                     "difficulty, source (of prompt, completion, answer, difficulty, source)")
    finally:
        trl.close()
    needy = make_task(JsonlTask(path=str(data), reward=f"{user_module}:needs_solution"), seed=0)
    try:
        assert needy.reward_line().endswith("; it also needs solution, which no field provides")
        assert asyncio.run(needy.rewards.score(needy.train_problem(0).batch(["x"]))).rewards == [0.0]
        assert "missing a required argument: 'solution'" in needy.stats.last_error
    finally:
        needy.close()
    batched = make_task(JsonlTask(path=str(data), reward=f"{user_module}:batched"), seed=0)
    try:
        assert batched.reward_line() == (
            f"reward {user_module}:batched (batched, 1 at once) gets prompts, completions, completion_ids, answer, "
            "difficulty, source (of prompts, completions, completion_ids, answer, difficulty, source)")
    finally:
        batched.close()
    builtin = make_task(JsonlTask(path=str(data), reward="exact"), seed=0)
    assert builtin.reward_line() == "reward exact gets completion, answer"
    p = builtin.train_problem(0)
    assert asyncio.run(builtin.rewards.score(p.batch([p.answer, "zz"]))).rewards == [1.0, 0.0]
    regex = rewards_of(["regex:^ok"])
    assert regex.describe(["prompt", "completion", "answer"]) == "reward regex:^ok gets completion"


def test_chat_prompts_and_the_answer_under_its_own_column(tmp_path, user_module):
    data = tmp_path / "d.jsonl"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    data.write_text(json.dumps({"prompt": chat, "solution": "4"}) + "\n" + json.dumps({"prompt": "p", "solution": "5"})
                    + "\n")
    task = make_task(JsonlTask(path=str(data), answer_field="solution", reward="numeric"), seed=0)
    problems = {p.answer: p for p in (task.train_problem(i) for i in range(2))}
    assert problems["4"].prompt == chat and problems["4"].text == "2+2?"
    assert problems["4"].fields == {"solution": "4"}  # TRL's accuracy_reward asks for `solution`
    data.write_text(json.dumps({"prompt": [{"role": "user"}], "answer": "4"}) + "\n")
    with pytest.raises(TaskDataError, match="d.jsonl:1: field 'prompt' is a list but not chat messages"):
        make_task(JsonlTask(path=str(data)), seed=0)


@pytest.mark.parametrize("line, says", [
    ('{"prompt": "2+2?", "answer": "4"', r"bad record, not JSON \(Expecting ',' delimiter"),
    ('["2+2?", "4"]', "bad record, a JSON list where a record is an object"),
    ('{"prompt": "2+2?", "solution": "4"}', "bad record, no field 'answer'"),
])
def test_a_bad_jsonl_record_is_task_data_error_naming_file_and_line(tmp_path, line, says):
    from lora_async.api import exit_code

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n\n" + line + "\n")
    with pytest.raises(TaskDataError, match=rf"^{data}:3: {says}") as info:
        make_task(JsonlTask(path=str(data), heldout=0), seed=0)
    assert "\n" not in str(info.value)
    assert exit_code(info.value) == 2  # the user fixes the file: a config mistake's code, not a failed run


def test_arithmetic_split_is_fixed_and_disjoint():
    task = make_task(ArithmeticTask(digits=1, ops=["+"]), seed=0)
    other_seed = make_task(ArithmeticTask(digits=1, ops=["+"]), seed=7)
    held = {p.prompt for p in task.heldout()}
    assert held == {p.prompt for p in other_seed.heldout()} and 15 <= len(held) <= 40
    train = {task.train_problem(i).prompt for i in range(500)}
    assert not held & train and len(train) + len(held) == 100
    assert task.train_problem(3) == make_task(ArithmeticTask(), seed=0).train_problem(3)
    p = task.train_problem(0)
    assert asyncio.run(task.rewards.score(p.batch([f"It is {p.answer}", "no"]))).rewards == [1.0, 0.0]
    assert task.stats.calls == 2


def test_reward_config_lists_and_weights():
    from lora_async.config import ConfigError, load_config

    assert JsonlTask(path="d", reward=["exact", "m:f"], reward_weights=[1.0, 0.2]).reward_list() == ["exact", "m:f"]
    assert JsonlTask(path="d").reward_list() == ["exact"]
    with pytest.raises(ValueError, match="reward_weights has 1 weights for 2 reward functions"):
        JsonlTask(path="d", reward=["exact", "m:f"], reward_weights=[1.0])
    with pytest.raises(ValueError, match="'nope' must be 'exact'"):
        JsonlTask(path="d", reward=["exact", "nope"])
    with pytest.raises(ConfigError, match=r"task\.reward"):
        load_config(None, overrides=['task={type="jsonl", path="d", reward=["exact", "bad spec"]}'])
