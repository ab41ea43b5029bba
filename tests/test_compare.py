"""`lora-async compare`: runs side by side from their files (the bench's runs: test_staleness_run.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lora_async.cli import app
from lora_async.compare import CompareError, compare_table, figures, read_runs


def write_run(out: Path, lr: float, accuracies: list[float], adapters: tuple[str, ...] = ("main",),
              seconds_per_step: float = 10.0) -> Path:
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({"learner": {"lr": lr, "groups_per_step": 4},
                                                 "run": {"output_dir": str(out), "seed": 0}}))
    rows = []
    for step in range(1, len(accuracies)):
        for adapter in adapters:
            rows.append({"step": step, "adapter": adapter, "wall_s": step * seconds_per_step,
                         "tokens_generated_total": 100 * step, "tokens_trained": 40})
    for step, accuracy in enumerate(accuracies):
        for adapter in adapters:
            rows.append({"kind": "eval", "adapter": adapter, "step": step, "wall_s": step * seconds_per_step + 1,
                         "accuracy": accuracy, "n": 20})
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "summary.json").write_text(json.dumps({"training_s": 100.0, "gen_compute_s": 80.0, "gen_idle_s": 20.0,
                                                  "learner_compute_s": 30.0, "learner_wait_s": 70.0}))
    return out


def test_the_table_shows_only_settings_that_differ_and_the_time_to_each_target(tmp_path):
    slow = write_run(tmp_path / "slow", 1e-4, [0.1, 0.3, 0.55, 0.6, 0.72])
    fast = write_run(tmp_path / "fast", 1e-3, [0.1, 0.6, 0.85, 0.8], seconds_per_step=20.0)
    columns = read_runs([slow, fast])
    by = {c.label: figures(c, (0.5, 0.7, 0.8)) for c in columns}
    assert by["slow"]["accuracy_final"] == 0.72 and by["slow"]["accuracy_best_step"] == 4
    # timed when step 2's weights were trained (its row: 20 s), not when they were scored (21 s)
    assert (by["slow"]["time_to_0.5_s"], by["slow"]["step_to_0.5"]) == (20.0, 2)
    assert by["slow"]["time_to_0.8_s"] is None
    assert (by["fast"]["accuracy_best"], by["fast"]["accuracy_best_step"]) == (0.85, 2)
    assert (by["fast"]["time_to_0.8_s"], by["fast"]["step_to_0.8"]) == (40.0, 2)
    assert by["fast"]["steps"] == 3 and by["fast"]["tokens_generated_per_s"] == 300 / 60
    assert by["fast"]["share_learner_waiting_for_data"] == 0.7

    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(compare_table(columns, (0.5, 0.8)))
    text = console.export_text()
    assert "learner.lr" in text and "groups_per_step" not in text and "output_dir" not in text
    assert "40.0 (2)" in text and "not reached" in text


def test_a_directory_of_runs_is_its_runs_and_a_fleet_is_one_column_per_adapter(tmp_path):
    write_run(tmp_path / "bench" / "a-s0", 1e-4, [0.0, 0.5])
    write_run(tmp_path / "bench" / "b-s0", 1e-4, [0.0, 0.25], adapters=("x", "y"))
    labels = [c.label for c in read_runs([tmp_path / "bench"])]
    assert labels == ["a-s0", "b-s0/x", "b-s0/y"]
    with pytest.raises(CompareError, match="is not a run directory"):
        read_runs([tmp_path / "bench" / "a-s0" / "nothing"])


def test_the_cli_prints_the_table_writes_the_plot_and_refuses_a_bad_target(tmp_path):
    runs = [str(write_run(tmp_path / name, lr, [0.1, 0.4, 0.9])) for name, lr in (("one", 1e-4), ("two", 2e-4))]
    shown = CliRunner().invoke(app, ["compare", *runs, "--plot", str(tmp_path / "c.png")])
    assert shown.exit_code == 0, shown.output
    assert "one" in shown.output and "two" in shown.output and (tmp_path / "c.png").stat().st_size > 10_000
    bad = CliRunner().invoke(app, ["compare", *runs, "--targets", "half"])
    assert bad.exit_code == 2 and "--targets" in bad.output
    missing = CliRunner().invoke(app, ["compare", str(tmp_path / "none")])
    assert missing.exit_code == 2 and "not a run directory" in missing.output
