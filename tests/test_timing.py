"""Where every second goes (lora_async/timing.py) and its readers: the board's idle split, per-call
waits, the summary block, the plot's stacked panel and the bench's shares.

No assertion here is about speed (shared, noisy machines): the board is driven with explicit
ticks, and the sampler's test only waits until it has attributed something.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from lora_async.bench.e2e import split_table
from lora_async.bench.proc import SPLIT_SHARES, summarize_run
from lora_async.metrics import STEP_KEYS, summary_table, where_the_time_went
from lora_async.plot import TIME_PARTS, plot_runs, time_shares
from lora_async.timing import (
    IDLE_CAUSES, NO_WAITS, CallTimes, IdleSplit, LearnerClock, TimeBoard, Wait, Waits, call_figures, call_waits,
    quantile,
)


def test_the_board_splits_idle_time_over_what_waits_and_the_parts_sum_to_the_idle_time():
    board = TimeBoard()
    a, b = board.waits(), board.waits()  # two adapters' waits on one run's board
    board.tick(0.5)  # nothing in flight, nothing waiting: other
    with a.waiting(Wait.TOOL):
        board.tick(0.3)
        with b.waiting(Wait.REWARD):  # two kinds at once share the tick evenly
            board.tick(0.4)
    with b.waiting(Wait.ADMISSION), b.waiting(Wait.ADMISSION):  # two producers held back: one kind
        board.tick(0.2)
    board.request_started()  # a request in flight: the generator is not idle, whatever waits
    with a.waiting(Wait.ENV):
        board.tick(1.0)
    board.request_finished()
    with NO_WAITS.waiting(Wait.ENV):  # an eval's waits mark nothing
        board.tick(0.1)
    split = board.snapshot()
    assert split == pytest.approx(IdleSplit(admission=0.2, reward=0.2, tool=0.5, env=0.0, other=0.6))
    assert split.total == pytest.approx(0.5 + 0.3 + 0.4 + 0.2 + 0.1)  # every idle tick, once
    assert list(split.parts()) == list(IDLE_CAUSES)
    # a step takes the difference over its interval
    before = board.snapshot()
    with a.waiting(Wait.ENV):
        board.tick(0.25)
    assert board.snapshot().minus(before) == pytest.approx(IdleSplit(env=0.25))


@pytest.mark.parametrize("idle_s", [0.0, 0.3, 1.2, 5.0])
def test_a_fitted_split_sums_to_the_engines_idle_time(idle_s):
    sampled = IdleSplit(admission=0.4, reward=0.2, env=0.2, other=0.4)  # 1.2 s sampled
    fitted = sampled.fitted(idle_s)
    assert fitted.total == pytest.approx(idle_s)
    assert all(v >= 0 for v in fitted.parts().values())
    if 0 < idle_s < sampled.total:  # the samples found more: every cause scaled alike
        assert fitted.admission / fitted.reward == pytest.approx(2.0)
    elif idle_s >= sampled.total:  # they found less: the rest is "other"
        assert fitted.other == pytest.approx(0.4 + idle_s - 1.2) and fitted.admission == 0.4


def test_the_sampler_attributes_a_wait_on_the_event_loop():
    board = TimeBoard()
    waits = board.waits()

    async def scenario() -> IdleSplit:
        sampler = asyncio.create_task(board.sample(every_s=0.01))
        try:
            with waits.waiting(Wait.ENV):
                for _ in range(1000):  # until it has seen the wait (no speed assumed)
                    await asyncio.sleep(0.01)
                    if board.snapshot().env > 0:
                        break
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        return board.snapshot()

    split = asyncio.run(scenario())
    assert split.env > 0 and split.reward == split.tool == split.admission == 0


def test_waits_record_calls_per_step_and_per_run():
    board = TimeBoard()
    waits = board.waits()
    for seconds in (0.1, 0.2, 0.3, 0.4):
        waits.record(Wait.REWARD, seconds)
    with waits.timed(Wait.TOOL):
        with waits.timed(Wait.TOOL):  # two calls at once: both recorded
            board.tick(0.5)  # ... and the wait marked while they run
    board.tick(0.25)  # ... and no longer after
    with waits.waiting(Wait.ENV):  # a mark, not a call
        board.tick(0.125)
    assert board.snapshot() == IdleSplit(tool=0.5, env=0.125, other=0.25)
    step = waits.take()
    assert step[Wait.REWARD] == [0.1, 0.2, 0.3, 0.4] and len(step[Wait.TOOL]) == 2 and step[Wait.ENV] == []
    figures = call_figures(call_waits(step))
    assert set(figures) == {"reward_wait_s_p50", "reward_wait_s_p95", "tool_wait_s_p50", "tool_wait_s_p95"}
    assert figures["reward_wait_s_p50"] == pytest.approx(0.25) and figures["reward_wait_s_p95"] == pytest.approx(0.385)
    assert all(v == [] for v in waits.take().values())  # taken once: the next step starts empty
    run = waits.run_figures()  # the whole run's, after the take
    assert run["reward_wait_calls"] == 4 and run["tool_wait_calls"] == 2 and "env_wait_calls" not in run
    assert run["reward_wait_s_p50"] == pytest.approx(0.2, rel=0.02)  # a bucket's width (1%) of the run's
    NO_WAITS.record(Wait.REWARD, 1.0)
    assert NO_WAITS.take()[Wait.REWARD] == [] and NO_WAITS.run_figures() == {}


def test_run_long_quantiles_stay_within_a_bucket_of_the_exact_ones():
    rng = random.Random(0)
    values = [rng.lognormvariate(-2.0, 1.0) for _ in range(5000)]
    times = CallTimes()
    for v in values:
        times.add(v)
    assert times.count == 5000
    for q in (0.5, 0.95):
        assert times.quantile(q) == pytest.approx(quantile(values, q), rel=0.02)
    assert quantile([3.0], 0.95) == 3.0 and quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5


def test_the_learner_clock_counts_compute_and_each_wait():
    clock = LearnerClock()
    clock.start()
    clock.batch_ready()
    first = clock.waited_s
    clock.trained(2.0)
    clock.step_done()
    clock.batch_ready()
    assert clock.compute_s == 2.0 and clock.wait_s == pytest.approx(first + clock.waited_s)


# ------------------------------------------------------------------ the readers


def split_summary(**extra) -> dict:
    return {"steps": 10, "wall_s": 105.0, "training_s": 100.0, "gen_compute_s": 60.0, "gen_idle_s": 40.0,
            "gen_idle_admission_s": 25.0, "gen_idle_reward_s": 10.0, "gen_idle_tool_s": 0.0, "gen_idle_env_s": 0.0,
            "gen_idle_other_s": 5.0, "learner_compute_s": 70.0, "learner_wait_s": 20.0, "learner_other_s": 10.0,
            **extra}


def test_the_summary_prints_where_the_time_went():
    summary = split_summary(reward_wait_s_p50=0.012, reward_wait_s_p95=0.25, reward_wait_calls=640,
                            **{"b.env_wait_s_p50": 1.5, "b.env_wait_s_p95": 4.25, "b.env_wait_calls": 3})
    text = where_the_time_went(summary)
    lines = text.splitlines()
    assert lines[0] == "where the time went (100.0 s of training)"
    assert "generator compute" in lines[1] and "60.0 s" in lines[1] and "60.0%" in lines[1]
    assert "admission" in lines[3] and "25.0%" in lines[3]
    assert any("learner waiting for data" in line and "20.0%" in line for line in lines)
    assert lines[-2].strip() == "reward calls: 640, wait p50 12 ms, p95 250 ms"
    assert lines[-1].strip() == "b.env calls: 3, wait p50 1.5 s, p95 4.25 s"  # a fleet's adapter
    # the table leaves those figures to the block
    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(summary_table(summary))
    table = console.export_text()
    assert "steps" in table and "gen_idle" not in table and "reward_wait" not in table
    assert where_the_time_went({"steps": 0}) is None  # training never began


def step_rows(n: int) -> list[dict]:
    rows = []
    for i in range(1, n + 1):
        idle = {"admission": 0.1 * i, "reward": 0.05, "tool": 0.0, "env": 0.2, "other": 0.05}
        rows.append({"step": i, "wall_s": float(i), "step_s": 1.0, "gen_compute_s": 1.0 - sum(idle.values()),
                     "gen_idle_s": sum(idle.values()), **{f"gen_idle_{c}_s": v for c, v in idle.items()},
                     "learner_s": 0.6, "learner_wait_s": 0.3, "reward_mean": 0.5})
    return rows


def test_the_plot_stacks_the_split_as_shares_and_older_runs_plot_as_before(tmp_path):
    from PIL import Image

    xs, shares = time_shares(step_rows(5))
    assert xs == [1.0, 2.0, 3.0, 4.0, 5.0] and list(shares) == [key for key, _ in TIME_PARTS]
    assert all(sum(column) == pytest.approx(1.0) for column in zip(*shares.values()))
    assert time_shares([{"step": 1, "wall_s": 1.0, "reward_mean": 0.1}]) == ([], {key: [] for key, _ in TIME_PARTS})
    heights = {}
    for name, rows in (("old", [{"step": 1, "wall_s": 1.0, "reward_mean": 0.1}]), ("new", step_rows(5))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        out = plot_runs([tmp_path / name], tmp_path / f"{name}.png")
        heights[name] = Image.open(out).size[1]
    assert heights["new"] > heights["old"]  # a row of time panels below the four


def test_bench_reports_the_split_per_mode(tmp_path):
    rows = step_rows(4)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = summarize_run(tmp_path, budget=10)
    assert set(SPLIT_SHARES) <= set(s)
    assert s["gen_compute_share"] + s["gen_idle_share"] == pytest.approx(1.0)
    causes = [s[f"gen_idle_{c}_share"] for c in IDLE_CAUSES]
    assert sum(causes) == pytest.approx(s["gen_idle_share"])
    assert s["gen_idle_admission_share"] == pytest.approx(sum(0.1 * i for i in range(1, 5)) / 4)
    assert s["learner_compute_share"] == pytest.approx(0.6) and s["learner_wait_share"] == pytest.approx(0.3)
    table = split_table({"modes": ["async", "sync"], "async": s, "sync": {**s, "gen_idle_admission_share": None},
                         "budget_s": 10})
    lines = table.splitlines()
    assert lines[0] == "| time share | async | sync |"
    assert len(lines) == 2 + len(SPLIT_SHARES)
    assert next(line for line in lines if "admission" in line).endswith("| 25.0% | - |")
    # a run whose rows lack the split (an older run, TRL's) reports None
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "wall_s": 1.0, "gen_s": 0.5}) + "\n")
    assert all(summarize_run(tmp_path, budget=10)[key] is None for key in SPLIT_SHARES)


def test_every_step_key_of_the_split_is_listed_for_tensorboard():
    keys = {"step_s", "gen_compute_s", "gen_idle_s", "learner_s", "learner_wait_s",
            *(f"gen_idle_{c}_s" for c in IDLE_CAUSES)}
    assert keys <= set(STEP_KEYS)


def test_bench_e2e_medians_and_ratios_over_seeds():
    from lora_async.bench.e2e import medians, ratios

    def seed(time, tokens):
        return {"time_to_target_s": time, "trained_tokens_per_s": tokens, "gen_idle_frac": 0.1}

    sync = medians([seed(100.0, 10.0), seed(120.0, 12.0)])
    fast = medians([seed(50.0, 30.0), seed(70.0, 20.0)])
    missed = medians([seed(40.0, 30.0), seed(None, 30.0)])  # one seed never reached the target
    assert sync["time_to_target_s"] == 110.0 and sync["reached"] == "2/2"
    assert missed["time_to_target_s"] is None and missed["reached"] == "1/2"
    report = {"sync": sync, "async-partial": fast, "auto": fast, "async": missed}
    r = ratios(report, ["sync", "async", "async-partial", "auto"])
    assert r["async-partial_sooner_than_sync"] == pytest.approx(110 / 60)
    assert r["async-partial_tokens_per_s_over_sync"] == pytest.approx(25 / 11)
    assert r["async_sooner_than_sync"] is None
    assert r["auto_time_over_best"] == pytest.approx(1.0)
