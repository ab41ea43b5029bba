"""What the console shows: a one-line summary without a terminal, a bar on the nearer limit, and
status lines that stay one line off a terminal."""

import asyncio
import io
import json

import pytest
from rich.console import Console

from lora_async.config import RunConfig
from lora_async.metrics import MetricsWriter, read_metrics
from lora_async.progress import run_console
from lora_async.orchestrator import train

from .fakes import FakeParts
from .test_orchestrator import config as fake_run_config

TERMINAL_ENV = ("FORCE_COLOR", "FORCE_TERMINAL", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLUMNS")


@pytest.fixture
def off_a_terminal(monkeypatch):
    """stderr as `make demo > log` has it (pytest captures it: not a TTY), rich's overrides unset."""
    for name in TERMINAL_ENV:
        monkeypatch.delenv(name, raising=False)


def row(step, wall_s, **extra):
    return {"step": step, "adapter": "main", "version": step, "wall_s": wall_s, "reward_mean": 0.5,
            "policy_lag_mean": 1.0, "sync_ms": 12.5, "tokens_generated_total": 100 * step, **extra}


def test_without_a_terminal_a_summary_line_follows_the_nearer_limit(tmp_path):
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    writer = MetricsWriter(tmp_path, ["main"], RunConfig(max_steps=1000, time_budget_s=300, log_interval_s=0),
                           console)
    writer.event({"kind": "eval", "adapter": "main", "step": 0, "accuracy": 0.25})
    writer.step(row(1, 30.0))  # 999 more steps at 30 s each: the time budget ends the run first
    writer.step(row(2, 60.0))
    writer.event({"kind": "eval", "adapter": "main", "step": 2, "accuracy": 0.75})
    writer.step(row(3, 90.0))
    writer.close()
    first, second, third = out.getvalue().strip().splitlines()[-3:]
    assert first.startswith("step 1 (30/300 s) v1") and "reward 0.500" in first
    # a held-out figure says which step's eval it is, until a newer eval replaces it
    assert "accuracy 0.25 (step 0)" in first and "accuracy 0.25 (step 0)" in second
    assert "accuracy 0.75 (step 2)" in third
    line = first
    assert "lag 1.0" in line and "sync 12.5 ms" in line and "tok/s" in line
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 3


def test_lines_are_throttled_and_the_last_step_always_shows(tmp_path):
    out = io.StringIO()
    writer = MetricsWriter(tmp_path, ["main"], RunConfig(max_steps=3, log_interval_s=3600),
                           Console(file=out, force_terminal=False, width=200))
    for step in (1, 2, 3):
        writer.step(row(step, float(step)))
    writer.close()
    shown = [line.split()[1] for line in out.getvalue().splitlines() if line.startswith("step")]
    assert shown == ["1", "3"]  # the first line at once, then none within the interval, then the last
    assert "(3/3 steps)" in out.getvalue()


def test_the_progress_bar_follows_the_time_budget_when_it_is_nearer(tmp_path):
    console = Console(file=io.StringIO(), force_terminal=True, width=200)
    writer = MetricsWriter(tmp_path, ["main"], RunConfig(max_steps=1000, time_budget_s=300), console)
    writer.step(row(10, 100.0))
    task = writer._progress.tasks[0]
    assert (task.completed, task.total, task.fields["limit"]) == (100.0, 300, "100/300 s")
    writer.step(row(999, 200.0))  # one step left: the step limit is nearer now
    assert (task.completed, task.total, task.fields["limit"]) == (999, 1000, "999/1000 steps")
    writer.close()


def test_off_a_terminal_a_long_status_line_stays_one_line(off_a_terminal, capsys):
    line = ("mode (opened, step 2): async (max_staleness 2; generator and learner on their own cores): async at "
            "k2 took 3.1s a step after the fill (x1.15 for lag); the sync step it implies: 5.2s")
    console = run_console()
    assert not console.is_terminal
    console.print(line, highlight=False)
    assert capsys.readouterr().err == line + "\n"
    Console(stderr=True).print(line, highlight=False)  # what a run printed before: broken at 80 columns
    assert capsys.readouterr().err.count("\n") > 1


def test_a_runs_mode_lines_reach_a_log_whole(off_a_terminal, capsys, tmp_path):
    cfg = fake_run_config(tmp_path, buffer={"mode": "auto", "max_staleness": 2}, run={"max_steps": 2, "canary_every": 0})
    asyncio.run(train(cfg, parts=FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.01)))  # the run's own console
    lines = capsys.readouterr().err.splitlines()
    modes = [r for r in read_metrics(tmp_path / "out" / "metrics.jsonl") if r.get("kind") == "mode"]
    assert [m["mode_kind"] for m in modes][:1] == ["opening"] and len(modes) == 2  # then what its steps decide
    for mode in modes:  # each decision's line, with its whole reason (longer than a terminal's 80 columns)
        line = next(line for line in lines if line.startswith(f"mode ({mode['mode_kind']}, "))
        assert line.endswith(mode["mode_reason"]) and len(line) > 80, lines
    start = next(line for line in lines if line.startswith("mode: auto: "))
    assert start.endswith("otherwise 2 sync steps measure and it decides")  # the start line, whole
