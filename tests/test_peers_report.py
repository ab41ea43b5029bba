"""The peer benchmark's report (bench/peers/report.py) and the run summary it reads
(`lora_async.bench.proc.summarize_run`): medians over seeds where a run that never reached a
mark counts as not reached, the time breakdown, and the chart's one-colour-per-system grouping."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lora_async.bench.proc import summarize_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "peers"))
import report  # noqa: E402


def test_a_run_that_did_not_reach_a_mark_counts_as_not_reached():
    # two of three seeds never reached 0.8: the median is "not reached", not the lucky seed
    assert report.seed_median([120.0, None, None], late_if_missing=True) is None
    assert report.seed_median([120.0, 200.0, None], late_if_missing=True) == 200.0
    assert report.seed_median([0.7, None, 0.9], late_if_missing=False) == pytest.approx(0.8)


def entry(system, seed, to80, startup=10.0):
    return {"system": system, "seed": seed, "time_to_acc_0.8_s": to80, "time_to_acc_0.5_s": 50.0,
            "launch_to_acc_0.8_s": None if to80 is None else to80 + startup, "startup_s": startup}


def test_medians_spread_and_head_to_head():
    runs = {f"{s}-s{k}": entry(s, k, t) for s, times in (("async", (100.0, 120.0, 140.0)),
                                                           ("trl", (300.0, None, 390.0)))
            for k, t in enumerate(times)}
    runs["sync-s0"] = {"system": "sync", "seed": 0, "error": "failed"}  # a failed run is left out
    systems = report.summarise(runs)
    assert set(systems) == {"async", "trl"}
    fig = systems["trl"]["time_to_acc_0.8_s"]
    assert fig["median"] == 390.0 and fig["min"] == 300.0 and fig["max"] == 390.0 and fig["not_reached"] == 1
    ratios = report.head_to_head(systems)
    assert ratios["trl/async time_to_acc_0.8_s"] == pytest.approx(390.0 / 120.0, abs=1e-3)
    assert "sync/async time_to_acc_0.8_s" not in ratios
    text = report.table(systems)
    # a figure nobody logged is "-"; only the late-if-missing ones say "not reached"
    assert next(line for line in text.splitlines() if line.startswith("| accuracy at the end")) == \
        "| accuracy at the end | - | - |"
    assert "390.0 (300.0-390.0), 1 of 3 not reached" in text
    runs["trl-s2"]["time_to_acc_0.8_s"] = None  # now the median trl run did not get there
    assert "not reached (1 of 3 did: 300.0)" in report.table(report.summarise(runs))


def test_summary_reads_startup_marks_and_where_the_time_went(tmp_path):
    rows = [{"kind": "start", "startup_s": 12.5},
            {"step": 1, "wall_s": 10.0, "gen_idle_frac": 0.5, "learner_s": 4.0, "sync_ms": 20.0, "reward_mean": 0.1},
            {"step": 2, "wall_s": 30.0, "gen_idle_frac": 0.0, "learner_s": 6.0, "sync_ms": 30.0, "reward_mean": 0.4},
            {"kind": "eval", "step": 0, "wall_s": 0.0, "accuracy": 0.1},
            {"kind": "eval", "step": 2, "wall_s": 30.0, "accuracy": 0.85}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = summarize_run(tmp_path, budget=60)
    assert s["startup_s"] == 12.5 and s["time_to_first_step_s"] == pytest.approx(22.5)
    assert s["time_to_acc_0.5_s"] == 30.0 and s["time_to_acc_0.8_s"] == 30.0
    assert s["gen_s"] == pytest.approx(10 * 0.5 + 20 * 1.0)  # busy share of each step's span
    assert s["learner_s"] == pytest.approx(10.0) and s["sync_s"] == pytest.approx(0.05)


def test_throughput_is_measured_up_to_the_target_once_a_run_reaches_it(tmp_path):
    # 100 tokens a step until the target at step 2 (20 s), then flat groups: 10 a step
    rows = [{"step": s, "wall_s": 10.0 * s, "tokens_trained": 100 if s <= 2 else 10,
             "tokens_generated_total": 400 * s} for s in range(1, 7)]
    rows += [{"kind": "eval", "step": 2, "wall_s": 20.0, "accuracy": 0.9}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = summarize_run(tmp_path, budget=60, target=0.8)
    assert s["throughput_until"] == "target" and s["trained_tokens_per_s"] == pytest.approx(10.0)
    assert s["gen_tokens_per_s"] == pytest.approx(40.0)
    assert s["trained_tokens_per_s_all"] == pytest.approx(240 / 60)  # what the whole budget would have said
    never = summarize_run(tmp_path, budget=60, target=0.95)
    assert never["throughput_until"] == "end" and never["trained_tokens_per_s"] == pytest.approx(240 / 60)


def test_a_trl_run_reports_its_generation_seconds(tmp_path):
    rows = [{"step": 1, "wall_s": 8.0, "gen_s": 3.0, "learner_s": 5.0},
            {"step": 2, "wall_s": 16.0, "gen_s": 2.5, "learner_s": 5.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = summarize_run(tmp_path, budget=60)
    assert s["gen_s"] == pytest.approx(5.5) and s["startup_s"] is None and s["sync_s"] is None


def test_plot_groups_seeds_of_a_system(tmp_path):
    from lora_async.plot import legend_styles, plot_runs

    styles = legend_styles(["async-s0", "async-s1", "trl-s0", "async-stale2-s0"], group_seeds=True)
    assert styles == {"async-s0": ("async", 0), "async-s1": (None, 0), "trl-s0": ("trl", 1),
                      "async-stale2-s0": ("async-stale2", 2)}
    assert legend_styles(["a-s0", "a-s1"], group_seeds=False) == {"a-s0": ("a-s0", None), "a-s1": ("a-s1", None)}

    for name in ("async-s0", "async-s1", "trl-s0"):
        d = tmp_path / name
        d.mkdir()
        (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "wall_s": 1.0, "reward_mean": 0.2}) + "\n" +
                                         json.dumps({"kind": "eval", "wall_s": 1.0, "accuracy": 0.3}) + "\n")
    out = plot_runs([tmp_path / n for n in ("async-s0", "async-s1", "trl-s0")], tmp_path / "c.png",
                    group_seeds=True)
    assert out.stat().st_size > 0
