"""What the console shows: a one-line summary without a terminal, a bar on the nearer limit."""

import io
import json

from rich.console import Console

from lora_async.config import RunConfig
from lora_async.metrics import MetricsWriter


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
