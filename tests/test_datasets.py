"""`task.type = "dataset"`: Hugging Face datasets through the `datasets` library. Local files of
every format, save_to_disk directories, columns reaching rewards as plain Python, held-out
splits and shares, chat prompts, and one-line errors naming the field (in the preflight: exit
code 2). The end-to-end run at the bottom is `slow`."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lora_async.config import DatasetTask, JsonlTask, load_config
from lora_async.tasks import TaskDataError, check_task, make_task

datasets = pytest.importorskip("datasets")

REPO = Path(__file__).resolve().parent.parent
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]

USER_MODULE = '''
import json
def by_fields(completion, answer, difficulty, tags, meta, solution):
    plain = (type(difficulty) is int and type(tags) is list and all(type(t) is str for t in tags)
             and type(meta) is dict and type(meta["w"]) is float and type(solution) is str)
    return float(plain) * difficulty
def batched(prompts, completions, answer, **kwargs):
    with open("batched_call.json", "w") as f:
        json.dump({"prompts": prompts, "completions": completions, "answer": answer, **kwargs}, f)
    return [float(c[0]["content"] == a) for c, a in zip(completions, answer)]
'''


def rows(n: int) -> list[dict]:
    return [{"question": f"What is {i} + 1?", "solution": str(i + 1), "difficulty": i % 3} for i in range(n)]


def write_rows(path: Path, records: list[dict]) -> Path:
    """`records` as a file of the suffix's format, or a save_to_disk directory (no suffix)."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif path.suffix == ".json":
        path.write_text(json.dumps(records))  # one JSON array
    elif path.suffix == ".parquet":
        datasets.Dataset.from_list(records).to_parquet(str(path))
    elif path.suffix == ".csv":
        datasets.Dataset.from_list(records).to_csv(str(path), index=False)
    else:
        datasets.Dataset.from_list(records).save_to_disk(str(path))
    return path


def task_of(path: Path, **settings) -> DatasetTask:
    return DatasetTask(path=str(path), **{"prompt_column": "question", "answer_column": "solution", **settings})


def training_set(task, n: int) -> list:
    return [task.train_problem(i) for i in range(n)]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "ds_rewards.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    return "ds_rewards"


@pytest.mark.parametrize("name", ["d.parquet", "d.json", "d.jsonl", "d.csv", "saved"])
def test_every_local_format_loads_alike(tmp_path, name):
    path = write_rows(tmp_path / name, rows(12))
    task = make_task(task_of(path), seed=0)
    try:
        epoch = training_set(task, 12)
        assert sorted(int(p.answer) for p in epoch) == list(range(1, 13))  # every row once per epoch
        first = min(epoch, key=lambda p: int(p.answer))
        assert first.prompt == "What is 0 + 1?" and first.answer == "1"
        # the answer column reaches rewards under its own name too (CSV reads it back as a number)
        assert first.fields == {"solution": 1 if name == "d.csv" else "1", "difficulty": 0}
        assert task.heldout() == []
        assert task.describe().startswith(f"{path}, split 'train': 12 training rows, 0 held out; reward exact")
    finally:
        task.close()


def test_a_jsonl_file_reads_alike_as_jsonl_and_as_dataset():
    """The two record readers share one row -> problem path and one training order."""
    path = REPO / "examples" / "data" / "addition.jsonl"
    jsonl = make_task(JsonlTask(path=str(path)), seed=3)
    dataset = make_task(DatasetTask(path=str(path)), seed=3)
    assert training_set(jsonl, 150) == training_set(dataset, 150)


def test_columns_reach_a_user_reward_as_plain_python(tmp_path, user_module):
    # Saved with a numpy format: read back as it is, lists would be arrays and ints numpy ints.
    records = [{"question": "q", "solution": "s", "difficulty": 3, "tags": ["a", "b"], "meta": {"w": 0.5}}]
    dataset = datasets.Dataset.from_list(records * 4).with_format("numpy")
    dataset.save_to_disk(str(tmp_path / "saved"))
    task = make_task(task_of(tmp_path / "saved", reward=f"{user_module}:by_fields"), seed=0)
    try:
        problem = task.train_problem(0)
        assert problem.fields == {"solution": "s", "difficulty": 3, "tags": ["a", "b"], "meta": {"w": 0.5}}
        assert asyncio.run(task.rewards.score(problem.batch(["x", "y"]))).rewards == [3.0, 3.0]
        assert task.stats.errors == 0
        assert "gets completion, answer, solution, difficulty, tags, meta (of prompt," in task.describe()
    finally:
        task.close()


def test_heldout_split_is_never_trained_on_and_capped(tmp_path):
    train, test = rows(10), [{**r, "solution": f"t{r['solution']}"} for r in rows(5)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "test": datasets.Dataset.from_list(test)}).save_to_disk(str(tmp_path / "dd"))
    task = make_task(task_of(tmp_path / "dd", heldout_split="test", heldout_limit=3), seed=0)
    assert [(p.index, p.answer) for p in task.heldout()] == [(0, "t1"), (1, "t2"), (2, "t3")]
    assert sorted(int(p.answer) for p in training_set(task, 20)) == sorted(list(range(1, 11)) * 2)
    assert task.describe().startswith(f"{tmp_path / 'dd'}, split 'train': 10 training rows, 3 held out")


def test_heldout_share_is_drawn_by_its_seed_removed_from_training_and_capped(tmp_path):
    path = write_rows(tmp_path / "d.parquet", rows(40))
    task = make_task(task_of(path, heldout_share=0.25, heldout_limit=4), seed=0)
    held = [p.answer for p in task.heldout()]
    trained = [p.answer for p in training_set(task, 30)]
    assert len(held) == 4 and len(set(trained)) == 30  # 10 held out, 4 of them evaluated, 30 trained on
    assert not set(held) & set(trained)
    assert [p.answer for p in training_set(task, 60)[30:]] != trained  # each epoch its own order
    # The draw follows heldout_seed, not the run's seed (which orders training).
    other_run = make_task(task_of(path, heldout_share=0.25, heldout_limit=4), seed=1)
    assert [p.answer for p in other_run.heldout()] == held
    assert set(p.answer for p in training_set(other_run, 30)) == set(trained)
    assert [p.answer for p in training_set(other_run, 30)] != trained
    other_draw = make_task(task_of(path, heldout_share=0.25, heldout_limit=4, heldout_seed=1), seed=0)
    assert [p.answer for p in other_draw.heldout()] != held


def test_chat_prompts_become_messages_and_batched_rewards_get_message_completions(tmp_path, user_module):
    records = [{"prompt": CHAT, "answer": "4", "source": "web"},
               {"prompt": [{"role": "user", "content": "3+3?"}], "answer": "6", "source": "book"}]
    path = write_rows(tmp_path / "chat.parquet", records)
    task = make_task(DatasetTask(path=str(path), reward=f"{user_module}:batched"), seed=0)
    try:
        problem = next(p for p in training_set(task, 2) if p.answer == "4")
        assert problem.prompt == CHAT and problem.text == "2+2?" and problem.fields == {"source": "web"}
        scores = asyncio.run(task.rewards.score(problem.batch(["4", "5"])))
        assert scores.rewards == [1.0, 0.0] and task.stats.errors == 0
        got = json.loads((tmp_path / "batched_call.json").read_text())
        assert got["completions"] == [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]]
        assert got["prompts"] == [CHAT, CHAT] and got["source"] == ["web", "web"]
    finally:
        task.close()
    # text and chat prompts mixed in one JSONL file (a column of JSON values to arrow), as JSONL takes them
    mixed = write_rows(tmp_path / "mixed.jsonl", [{"prompt": CHAT, "answer": "4"}, {"prompt": "3+3?", "answer": "6"}])
    prompts = {p.answer: p.prompt for p in training_set(make_task(DatasetTask(path=str(mixed)), seed=0), 2)}
    assert prompts == {"4": CHAT, "6": "3+3?"}


def error_of(config: DatasetTask, where: str = "adapters.2.task") -> str:
    with pytest.raises(TaskDataError) as err:
        check_task(config, where)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_each_data_mistake_is_one_line_naming_the_field(tmp_path):
    path = write_rows(tmp_path / "d.parquet", rows(3))
    columns = "(its columns: question, solution, difficulty)"
    assert error_of(task_of(path, prompt_column="q")) == \
        f"adapters.2.task.prompt_column: 'q' is not a column of {path} {columns}"
    assert error_of(task_of(path, answer_column="a")) == \
        f"adapters.2.task.answer_column: 'a' is not a column of {path} {columns}"
    assert error_of(task_of(path, split="validation")) == \
        f"adapters.2.task.split: 'validation' is not a split of {path} (its splits: train)"
    assert error_of(task_of(path, heldout_split="test")) == \
        f"adapters.2.task.heldout_split: 'test' is not a split of {path} (its splits: train)"
    assert error_of(task_of(path, heldout_share=0.9)) == (
        f"adapters.2.task.heldout_share: 0.9 of the 3 rows of {path} holds out 3; nothing would be left to train "
        "on (lower it, or use heldout_split)")
    assert error_of(task_of(path, name="main")).startswith("adapters.2.task.name: ")
    # the columns of a held-out split are checked too
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows(3)),
                          "test": datasets.Dataset.from_list([{"q": "x", "solution": "1"}])}
                         ).save_to_disk(str(tmp_path / "dd"))
    assert error_of(task_of(tmp_path / "dd", heldout_split="test"), "task").startswith(
        f"task.prompt_column: 'question' is not a column of the 'test' split of {tmp_path / 'dd'} (its columns: q,")


def test_prompts_that_are_lists_but_not_chats_are_refused(tmp_path):
    numbers = write_rows(tmp_path / "n.parquet", [{"prompt": [1, 2], "answer": "3"}])
    assert error_of(DatasetTask(path=str(numbers)), "task") == (
        f"task.prompt_column: row 0 of {numbers}: 'prompt' is a list but not chat messages "
        '([{"role": ..., "content": ...}, ...])')
    # a message without content: arrow types the column as chats with a hole, or as mixed JSON
    for name, hole in (("h.parquet", {"role": "user", "content": None}), ("h.jsonl", {"role": "user"})):
        holes = write_rows(tmp_path / name, [{"prompt": CHAT, "answer": "4"}, {"prompt": [hole], "answer": "5"}])
        assert error_of(DatasetTask(path=str(holes)), "task") == (
            f"task.prompt_column: row 1 of {holes}: 'prompt' is a list but not chat messages "
            '([{"role": ..., "content": ...}, ...])')


def test_a_hub_id_that_cannot_be_fetched_says_what_to_do(monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # as without a network, but at once
    message = error_of(DatasetTask(path="nobody/no-such-dataset", name="main"), "task")
    assert message.startswith("task.path: 'nobody/no-such-dataset' could not be fetched from the Hugging Face Hub (")
    assert message.endswith("or save the dataset where the Hub is reachable (save_to_disk, or to_parquet) and "
                            "point task.path at the copy")


def test_without_the_datasets_library_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    assert error_of(DatasetTask(path="openai/gsm8k"), "task") == \
        "task.type = \"dataset\" needs the datasets library: pip install 'lora-async[tasks]'"


def test_the_shipped_example_loads_through_the_preflight():
    from lora_async.preflight import check_tasks

    config = load_config(REPO / "examples" / "dataset.toml")
    check_tasks(config)
    task = make_task(config.task, seed=0)
    assert len(task.heldout()) == 10 and task.describe().startswith(
        f"{REPO / 'examples' / 'data' / 'addition.jsonl'}, split 'train': 90 training rows, 10 held out")


def test_train_exits_2_with_one_line_for_a_missing_column(tmp_path):
    path = write_rows(tmp_path / "data.parquet", [{"q": "1+1?", "a": "2"}])
    config = tmp_path / "c.toml"
    config.write_text(f'[task]\ntype = "dataset"\npath = "data.parquet"\nprompt_column = "question"\n'
                      f'[run]\noutput_dir = "{tmp_path / "out"}"\n')
    result = subprocess.run([sys.executable, "-m", "lora_async", "train", str(config)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = (result.stdout + result.stderr).strip().splitlines()
    # the check's status line as it began, then the error in one line (in place of "done")
    assert lines == [f"task: loading and checking the dataset {path} ...",
                     f"error: task.prompt_column: 'question' is not a column of {path} (its columns: q, a)"]
    assert not (tmp_path / "out").exists()


KINDS_MODULE = '''
import json
def kinds(completions, **kwargs):
    with open({record!r}, "a") as f:
        f.write(json.dumps({{"type": type(completions[0]).__name__, "first": completions[0]}}) + "\\n")
    texts = [c[0]["content"] for c in completions]
    return [sum(ch in "aeiou" for ch in t) / max(1, len(t)) for t in texts]
'''


@pytest.mark.slow
def test_a_chat_dataset_trains_through_the_cli(tmp_path, monkeypatch, tiny_model):
    from typer.testing import CliRunner

    from lora_async.cli import app
    from lora_async.metrics import read_metrics

    from .test_train import make_config

    monkeypatch.chdir(tmp_path)  # the reward module is imported from the working directory
    record = tmp_path / "kinds.jsonl"
    (tmp_path / "chat_rewards.py").write_text(KINDS_MODULE.format(record=str(record)))
    chats = [{"prompt": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": f"Say something about item {i}."}], "answer": "-"}
             for i in range(16)]
    data = write_rows(tmp_path / "chats.parquet", chats)
    config = make_config(tmp_path, tiny_model, "chat", run={"max_steps": 2, "canary_every": 0},
                         replace={"task": {"type": "dataset", "path": str(data), "reward": "chat_rewards:kinds",
                                           "heldout_share": 0.25}})
    result = CliRunner().invoke(app, ["train", str(config)])
    assert result.exit_code == 0, result.output
    steps = [r["step"] for r in read_metrics(tmp_path / "chat" / "metrics.jsonl") if "kind" not in r]
    assert steps == [1, 2]
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(calls) >= 2 * 2  # groups_per_step = 2 groups in each of 2 steps
    assert all(c["type"] == "list" and c["first"][0]["role"] == "assistant" for c in calls)
