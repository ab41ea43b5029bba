"""TRL's own reward functions (`trl.rewards`), named in a task config as they are, score a group
as TRL's GRPOTrainer would: batched, chat completions as messages, None where a function does
not score, the weighted sum over the functions that did."""

import asyncio
import json
import math

import pytest

from lora_async.config import JsonlTask
from lora_async.tasks import make_task

trl_rewards = pytest.importorskip("trl.rewards")  # the dev extra installs trl[math-verify]

RECORDS = [
    {"prompt": [{"role": "user", "content": "What is 1/3 as a fraction?"}], "solution": r"$\frac{1}{3}$"},
    {"prompt": [{"role": "user", "content": "Name a colour."}], "solution": "blue"},  # no math: unparseable gold
]
COMPLETIONS = [
    "<think>\nOne third.\n</think>\nThe answer is $\\boxed{\\frac{1}{3}}$",
    "<think>\nHmm.\n</think>\n$\\boxed{\\frac{1}{2}}$",
    "The answer is $\\boxed{\\frac{1}{3}}$",  # right, but no think block
    "<think>unclosed",
]
WEIGHTS = [1.0, 0.5]


def trl_scores(record, completions):
    """What GRPOTrainer computes: each function called once with lists, None as NaN, weighted nansum."""
    messages = [[{"role": "assistant", "content": c}] for c in completions]
    n = len(completions)
    columns = {"solution": [record["solution"]] * n}
    parts = [trl_rewards.accuracy_reward(messages, **columns), trl_rewards.think_format_reward(messages, **columns)]
    totals = [sum(w * p[i] for w, p in zip(WEIGHTS, parts) if p[i] is not None) for i in range(n)]
    return parts, totals


def test_accuracy_and_think_format_score_as_trl_does(tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    config = JsonlTask(path=str(data), answer_field="solution",
                       reward=["trl.rewards:accuracy_reward", "trl.rewards:think_format_reward"],
                       reward_weights=WEIGHTS)
    task = make_task(config, seed=0, in_flight=8)
    try:
        assert "batched" in task.reward_line()
        by_solution = {p.answer: p for p in (task.train_problem(i) for i in range(2))}
        for record in RECORDS:
            problem = by_solution[record["solution"]]
            scores = asyncio.run(task.rewards.score(problem.batch(COMPLETIONS)))
            (accuracy, fmt), totals = trl_scores(record, COMPLETIONS)
            assert scores.parts == {"accuracy_reward": accuracy, "think_format_reward": fmt}
            assert scores.rewards == pytest.approx(totals)
            assert scores.fault is None
        # The math problem: right answers score, wrong ones do not; the colour: accuracy skips (None).
        assert accuracy == [None] * 4 and fmt == [1.0, 1.0, 0.0, 0.0]
        first = trl_scores(RECORDS[0], COMPLETIONS)[0][0]
        assert first == [1.0, 0.0, 1.0, 0.0]
        assert task.stats.errors == 0 and not any(math.isnan(x) for x in scores.rewards)
    finally:
        task.close()
