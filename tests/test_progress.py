"""Progress where a person waits (`progress.py`): two lines off a terminal, a bar on one."""

from __future__ import annotations

import io
import threading

import pytest
from rich.console import Console
from rich.progress import Progress, TextColumn

from lora_async.errors import UserError
from lora_async.progress import Stage, gigabytes, stage


def log_console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=False, width=80, soft_wrap=True), out


def test_off_a_terminal_a_stage_is_one_line_as_it_begins_and_one_as_it_ends():
    console, out = log_console()
    what = "building the generator's base into /a/long/path/that/would/wrap/at/eighty/columns/otherwise"
    with stage(what, total=2.4e9, console=console, unit=gigabytes) as progress:
        for _ in range(3):
            progress.advance(0.8e9)
        progress.outcome("3 shards")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0] == f"{what} (2.40 GB) ..."
    assert lines[1].startswith(f"{what}: 3 shards, done in ") and lines[1].endswith(" s")
    assert progress.completed == pytest.approx(2.4e9)


def test_a_failed_stage_says_so_and_a_user_error_leaves_the_line_to_the_error():
    console, out = log_console()
    with pytest.raises(RuntimeError), stage("starting the vLLM engine (cpu)", console=console):
        raise RuntimeError("engine died")
    with pytest.raises(UserError), stage("task: loading and checking the dataset x", console=console):
        raise UserError("task.path: no such file")
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and lines[0] == "starting the vLLM engine (cpu) ..."
    assert lines[1].startswith("starting the vLLM engine (cpu): failed after ")
    assert lines[2] == "task: loading and checking the dataset x ..."  # the error's own line follows


def test_on_a_terminal_the_bar_counts_every_advance_from_any_thread_and_clears_itself():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    with stage("eval main", total=40, console=console) as progress:
        workers = [threading.Thread(target=lambda: [progress.advance() for _ in range(10)]) for _ in range(4)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    assert progress.completed == 40 and "eval main: done in" in out.getvalue()


def test_inside_the_training_bar_a_stage_is_a_row_of_it_with_the_bars_fields():
    console, out = log_console()
    live = Progress(TextColumn("{task.description} {task.fields[limit]}"), console=console)
    seen: list[str] = []
    with Stage("eval main", 4, console).attach(live, lambda done, total: {"limit": f"{done:g}/{total:g}"}) as progress:
        progress.advance()
        seen = [f"{t.description} {t.fields['limit']}" for t in live.tasks]
    assert seen == ["eval main 1/4"] and live.tasks == []  # the row goes when the eval ends
