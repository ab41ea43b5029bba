"""The reasoning-gym task: problems by index, the held-out split, extraction, its scorers, its
config errors; and one end-to-end run of the real CLI on the tiny model (`slow`)."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections import Counter
from typing import Any

import pytest

from lora_async.config import ReasoningGymTask
from lora_async.tasks import TaskDataError, check_task, make_task
from lora_async.tasks.reasoning_gym import (ReasoningGymProblems, check_reasoning_gym, default_system_prompt,
                                            extract_answer)

reasoning_gym = pytest.importorskip("reasoning_gym")

# 1-digit chain sums of 2 terms: 10 x 10 x 2 = 200 questions, so held-out and training would
# overlap without the skip.
SMALL_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def task_config(datasets: dict[str, dict[str, Any]] | None = None, **fields: Any) -> ReasoningGymTask:
    return ReasoningGymTask.model_validate({"datasets": datasets or {"chain_sum": dict(SMALL_SUM)},
                                            "heldout": 20, **fields})


def score(task: ReasoningGymProblems, problem: Any, completions: list[str]) -> list[float]:
    return asyncio.run(task.rewards.score(problem.batch(completions))).rewards


def first_of(task: ReasoningGymProblems, dataset: str) -> Any:
    return next(p for p in map(task.train_problem, range(1000)) if p.fields["dataset"] == dataset)


# --- scoring -------------------------------------------------------------------------------


def test_scores_with_the_datasets_own_scorers():
    task = make_task(task_config({"chain_sum": dict(SMALL_SUM), "spell_backward": {}}), seed=0)
    assert isinstance(task, ReasoningGymProblems)
    total = first_of(task, "chain_sum")
    # chain_sum's scorer compares numbers: sign, leading zeros and decimals are tolerated (an
    # exact-match reward would give the second 0).
    assert score(task, total, [total.answer, f"+0{total.answer}.00" if not total.answer.startswith("-")
                               else f"{total.answer}.00", "nothing"]) == [1.0, 1.0, 0.0]
    word = first_of(task, "spell_backward")
    # spell_backward's scorer ignores case and gives credit per letter in place.
    right, wrong = score(task, word, [word.answer.upper(), "zzzzzzzzzzzzzz"])
    assert right == 1.0 and wrong == 0.0
    partial = score(task, word, [word.answer[:-1] + ("x" if word.answer[-1] != "x" else "y")])[0]
    assert 0.0 < partial < 1.0
    assert task.stats.errors == 0 and task.stats.calls == 6


def test_the_scorer_gets_the_entry_back_with_its_metadata(monkeypatch):
    task = make_task(task_config(), seed=0)
    problem = task.train_problem(0)
    seen: list[tuple[str, dict]] = []
    dataset = task._train["chain_sum"]  # type: ignore[attr-defined]
    monkeypatch.setattr(dataset, "score_answer", lambda answer, entry: seen.append((answer, entry)) or 1.0)
    assert score(task, problem, ["Answer: 5"]) == [1.0]
    answer, entry = seen[0]
    assert answer == "5"
    assert entry["question"] == problem.prompt and entry["answer"] == problem.answer
    assert entry["metadata"]["source_dataset"] == "chain_sum" and "expression" in entry["metadata"]


# --- extraction ----------------------------------------------------------------------------


@pytest.mark.parametrize("completion, expected", [
    ("Let me add.\n3 + 4 = 7\n\n  7  \n\n", "7"),
    ("work\nAnswer: 7", "7"),
    ("work\nThe final answer is: 7", "7"),
    ("The answer is 7", "7"),
    ("The final answer to the given arithmetic problem is 12.", "12"),  # the sentence's period goes
    ("Here is the answer: noremopyh.", "noremopyh"),
    ("The cat sat on the mat.", "The cat sat on the mat."),  # no label: the line as it is
    ("answer", "answer"),  # a label needs a colon or "is": the word itself is an answer
    ("", ""),
])
def test_last_line(completion, expected):
    assert extract_answer(completion, "last_line") == expected


def test_tag_and_full():
    text = "<answer>1</answer> then <answer> 2 </answer>\nAnswer: 3"
    assert extract_answer(text, "tag") == "2"
    assert extract_answer("<final>x</final>", "tag", tag="final") == "x"
    assert extract_answer("no tag here: 7", "tag") == ""
    assert extract_answer("  a\nb  ", "full") == "a\nb"
    assert "<answer></answer>" in default_system_prompt("tag", "answer")
    assert "last line" in default_system_prompt("last_line", "answer")


def test_each_extraction_mode_decides_the_reward():
    problems = {mode: make_task(task_config(extract=mode), seed=0) for mode in ("last_line", "tag", "full")}
    problem = problems["tag"].train_problem(0)
    a = problem.answer
    expected = {  # the same completions read three ways
        "last_line": [1.0, 0.0, 0.0, 1.0],
        "tag": [0.0, 1.0, 0.0, 0.0],
        "full": [1.0, 0.0, 0.0, 0.0],
    }
    completions = [a, f"<answer>{a}</answer>\nnope", "", f"thinking\n{a}"]
    for mode, task in problems.items():
        got = score(task, problem, completions)
        assert [round(v) for v in got] == expected[mode], mode
        assert task.system_prompt == default_system_prompt(mode, "answer")
    assert make_task(task_config(system_prompt="Mine."), seed=0).system_prompt == "Mine."


# --- training problems and the held-out split ----------------------------------------------


def test_weights_decide_the_share_of_each_dataset():
    task = make_task(task_config({"chain_sum": {"weight": 3}, "spell_backward": {"weight": 1}}), seed=0)
    counts = Counter(task.train_problem(i).fields["dataset"] for i in range(2000))
    assert 0.70 < counts["chain_sum"] / 2000 < 0.80


def test_problems_are_a_function_of_seed_and_index():
    a, b, c = (make_task(task_config({"chain_sum": {}, "leg_counting": {}}), seed=s) for s in (7, 7, 8))
    indices = [0, 1, 5, 99, 12345]
    assert [a.train_problem(i) for i in reversed(indices)][::-1] == [b.train_problem(i) for i in indices]
    assert [a.train_problem(i).prompt for i in indices] != [c.train_problem(i).prompt for i in indices]
    assert len({a.train_problem(i).prompt for i in range(50)}) > 40  # entries differ by index


def test_heldout_is_drawn_with_its_own_seed_and_never_trained_on():
    config = task_config(heldout=60)
    task = make_task(config, seed=0)
    held = task.heldout()
    assert len(held) == 60 and len({p.prompt for p in held}) == 60
    # The datasets made with heldout_seed, entries in order (one dataset: no weights to draw).
    reference = reasoning_gym.create_dataset("chain_sum", seed=config.heldout_seed, size=100, **SMALL_SUM)
    in_order = list(dict.fromkeys(reference[i]["question"] for i in range(100)))
    assert [p.prompt for p in held] == in_order[:60]
    assert [p.prompt for p in make_task(config, seed=5).heldout()] == [p.prompt for p in held]  # run seed: no effect
    other = make_task(task_config(heldout=60, heldout_seed=3), seed=0).heldout()
    assert [p.prompt for p in other] != [p.prompt for p in held]
    # 200 questions, 60 held out: 2000 unfiltered draws would hit them hundreds of times.
    trained = {task.train_problem(i).prompt for i in range(2000)}
    assert not trained & {p.prompt for p in held}
    assert len(trained) == 200 - 60


def test_a_heldout_split_that_covers_everything_is_an_error():
    task = make_task(task_config({"chain_sum": {"min_terms": 1, "max_terms": 1, "min_digits": 1,
                                                "max_digits": 1}}, heldout=50), seed=0)
    assert len(task.heldout()) == 10  # "0" to "9": all there is
    with pytest.raises(TaskDataError, match="lower task.heldout"):
        task.train_problem(0)


def test_describe_names_datasets_weights_settings_heldout_and_extraction():
    line = make_task(task_config({"chain_sum": {"weight": 2, "max_terms": 3}, "leg_counting": {}},
                                 extract="tag", tag="final"), seed=0).describe()
    assert "\n" not in line
    for part in ("chain_sum (weight 2, max_terms=3)", "leg_counting (weight 1)", "20 held out", "<final>"):
        assert part in line


# --- failures of a scorer ------------------------------------------------------------------


def test_a_scorer_that_raises_scores_zero_and_is_counted(monkeypatch):
    task = make_task(task_config(), seed=0)
    problem = task.train_problem(0)

    def broken(answer: str, entry: dict) -> float:
        raise KeyError("boom")

    monkeypatch.setattr(task._train["chain_sum"], "score_answer", broken)  # type: ignore[attr-defined]
    scores = asyncio.run(task.rewards.score(problem.batch([problem.answer, "x", ""])))
    assert scores.rewards == [0.0, 0.0, 0.0]
    assert task.stats.errors == 2  # the empty answer is not asked
    assert scores.fault is not None and "chain_sum.score_answer raised KeyError" in scores.fault
    assert task.stats.functions["reasoning_gym"].failed == 2


def test_scorers_run_at_once_not_behind_a_pool(monkeypatch):
    """More completions than a default thread pool has threads, each scorer waiting for all the
    others: they must all run at once (one at a time, or a few, none would return)."""
    task = make_task(task_config(reward_timeout_s=60), seed=0)
    problem = task.train_problem(0)
    n = 40
    meet = threading.Barrier(n, timeout=60)

    def waits_for_all(answer: str, entry: dict) -> float:
        meet.wait()
        return 1.0

    monkeypatch.setattr(task._train["chain_sum"], "score_answer", waits_for_all)
    scores = asyncio.run(task.rewards.score(problem.batch([problem.answer] * n)))
    assert scores.rewards == [1.0] * n and task.stats.errors == 0


def test_a_scorer_past_its_time_scores_zero(monkeypatch):
    task = make_task(task_config(reward_timeout_s=0.2), seed=0)
    problem = task.train_problem(0)

    def slow(answer: str, entry: dict) -> float:
        time.sleep(1.0)
        return 1.0

    monkeypatch.setattr(task._train["chain_sum"], "score_answer", slow)  # type: ignore[attr-defined]
    scores = asyncio.run(task.rewards.score(problem.batch([problem.answer])))
    assert scores.rewards == [0.0] and task.stats.timeouts == 1 and task.stats.errors == 1
    assert "took over 0.2s" in str(scores.fault)


# --- config errors, before any model loads --------------------------------------------------


@pytest.mark.parametrize("datasets, message", [
    ({"chain_sum_x": {}}, "adapters.2.task.datasets.chain_sum_x: not a reasoning-gym dataset (did you mean chain_sum"),
    ({"chain_sum": {"min_termz": 2}},
     "adapters.2.task.datasets.chain_sum.min_termz: not a setting of chain_sum (did you mean min_terms?)"),
    ({"chain_sum": {"min_terms": 4, "max_terms": 2}},
     "adapters.2.task.datasets.chain_sum: AssertionError: max_terms must be >= min_terms"),
    ({"chain_sum": {"seed": 4}}, "adapters.2.task.datasets.chain_sum.seed: set by lora-async"),
    ({"leg_counting": {}, "spell_backward": {"min_word_len": "x"}}, "adapters.2.task.datasets.spell_backward"),
    # checked at the size a run uses, though the check makes only one problem
    ({"word_ladder": {"size": 30_000}}, "adapters.2.task.datasets.word_ladder: ValueError: Dataset size too large"),
])
def test_each_config_error_is_one_line_naming_the_field(datasets, message):
    with pytest.raises(TaskDataError) as caught:
        check_task(task_config(datasets), "adapters.2.task")
    assert str(caught.value).startswith(message), str(caught.value)
    assert "\n" not in str(caught.value)


def test_without_reasoning_gym_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` raises ImportError
    wanted = "task.type = \"reasoning-gym\" needs reasoning-gym: pip install 'lora-async[tasks]'"
    with pytest.raises(TaskDataError) as caught:
        check_reasoning_gym(task_config(), "task")
    assert str(caught.value) == wanted
    with pytest.raises(TaskDataError, match="needs reasoning-gym"):
        make_task(task_config(), seed=0)


def test_the_cli_refuses_a_bad_dataset_with_exit_2(tmp_path):
    from typer.testing import CliRunner

    from lora_async.cli import app

    path = tmp_path / "bad.toml"
    path.write_text('[task]\ntype = "reasoning-gym"\n[task.datasets.chain_sumx]\nweight = 1\n')
    result = CliRunner().invoke(app, ["train", str(path)])
    assert result.exit_code == 2, result.output
    assert "task.datasets.chain_sumx: not a reasoning-gym dataset (did you mean chain_sum" in result.output


# --- end to end ------------------------------------------------------------------------------


@pytest.mark.slow
def test_trains_through_the_cli_on_the_tiny_model(tmp_path, tiny_model):
    from typer.testing import CliRunner

    from lora_async.cli import app
    from lora_async.metrics import read_metrics

    out = tmp_path / "rg"
    config = tmp_path / "rg.toml"
    config.write_text(f"""
[model]
name = {json.dumps(str(tiny_model))}
[generator]
kv_cache_gb = 0.25
groups_in_flight = 4
max_model_len = 256
[sampling]
max_new_tokens = 8
samples_per_prompt = 4
[learner]
groups_per_step = 2
[run]
max_steps = 2
output_dir = {json.dumps(str(out))}
progress = false
eval_at_end = true
eval_max_tokens = 8
[task]
type = "reasoning-gym"
heldout = 4
[task.datasets.chain_sum]
weight = 2
max_terms = 2
max_digits = 1
[task.datasets.spell_backward]
weight = 1
""")
    result = CliRunner().invoke(app, ["train", str(config)])
    assert result.exit_code == 0, result.output
    rows = read_metrics(out / "metrics.jsonl")
    steps = [r for r in rows if "kind" not in r]
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:
        assert "reward/reasoning_gym" in row and row["reward_errors"] == 0
    evals = [r for r in rows if r.get("kind") == "eval"]
    assert evals and evals[-1]["accuracy"] is not None
