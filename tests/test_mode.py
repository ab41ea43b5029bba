"""Sync or async (`buffer.mode`): the model's choice from measured figures, weighed by lag's cost
in steps; and auto runs on fakes that decide after one sync step, confirm with one async step,
go back where the confirmation disagrees, decide again when steps drift from the prediction,
and resume in their chosen mode without measuring again."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from lora_async import lag_cost
from lora_async.config import ConfigError, TrainConfig, load_config
from lora_async.generator.types import GenResult, GenStatus
from lora_async.metrics import read_metrics
from lora_async.mode import (LEARNER_SPLIT_SLOWDOWN, MARGIN, Choice, EngineCurve, Mode, Model, StepFigures, candidates,
                             async_beats_implied, async_still_sooner, decide, decide_opened, implied_sync,
                             initial_choice, off_prediction, opening_choice, scaled_step_s)
from lora_async.orchestrator.auto_state import Auto
from lora_async.orchestrator import train

from .fakes import FakeParts

M2PO = lag_cost.builtin("m2po")


def sync_step(step_s: float, learner_s: float, gen_s: float, wait_s: float, batch: float | None = 16.0,
              aborted: int = 0) -> StepFigures:
    return StepFigures(step_s=step_s, learner_s=learner_s, gen_compute_s=gen_s, wait_s=wait_s, engine_batch=batch,
                       engine_steps=100.0, samples=32, groups=4, samples_pulled=32, aborted_groups=aborted)


FLAT = EngineCurve(((1, 100.0), (128, 100.0)), ((32, 60.0), (128, 60.0)))  # no gain from batching
BATCHING = EngineCurve(((1, 30.0), (8, 100.0), (32, 200.0), (128, 300.0)), ((32, 140.0), (128, 220.0)))


def model(step: StepFigures, curve: EngineCurve | None = FLAT, split: bool = True) -> Model:
    return Model(step, split, batch_cap=128, curve=curve)


# ---------------------------------------------------------------- the choice from figures


def test_nothing_waits_and_no_batching_gain_stays_sync():
    # the demo's shape on 2 cores: generation 74% of the step, the learner 25%, no waits; the engine
    # gains nothing from a bigger batch and loses 40% on its share of the cores
    demo = sync_step(9.5, 2.4, 7.0, 0.0)
    choice = decide(model(demo), [0, 1, 2, 4], M2PO, "measured", 1)
    assert choice.mode is Mode.SYNC and choice.staleness == 0 and choice.kind == "measured"
    assert choice.predicted_step_s == pytest.approx(9.5)
    assert "waits 0%" in choice.reason and "k1" in choice.reason


def test_batching_makes_async_worth_it_where_nothing_waits():
    # the same step, but the engine's throughput grows with its batch (as vLLM's does on a CPU):
    # async keeps (k + 1) steps' worth of sequences in flight
    demo = sync_step(9.5, 2.4, 7.0, 0.0)
    choice = decide(model(demo, BATCHING), [0, 1, 2, 4], M2PO, "measured", 1)
    assert choice.mode is Mode.ASYNC and choice.staleness >= 1 and choice.split
    assert choice.predicted_step_s is not None and choice.predicted_step_s < 9.5 / 1.05
    assert model(demo, BATCHING).gen_s(1) < model(demo, FLAT).gen_s(1)


def test_waits_turn_async_and_lag_cost_picks_the_staleness():
    # tool waits are 83% of a sync step: more staleness hides more of them
    tools = sync_step(60.0, 3.0, 5.0, 50.0)
    m = model(tools)
    assert m.step_s(1) > m.step_s(2) > m.step_s(4)
    cheap = lag_cost.LagCosts("cheap", {0: 1.0, 2: 1.05, 4: 1.1}, "test")
    dear = lag_cost.LagCosts("dear", {0: 1.0, 2: 1.05, 4: 2.0}, "test")
    assert decide(m, [0, 1, 2, 4], cheap, "measured", 1).staleness == 4
    # where lag 4 costs twice the steps, its shorter step does not pay: k = 2
    assert decide(m, [0, 1, 2, 4], dear, "measured", 1).staleness == 2
    # capped by buffer.max_staleness
    assert decide(m, candidates(1), cheap, "measured", 1).staleness == 1


def test_aborted_groups_are_work_async_does_not_redo():
    # sync aborted 4 groups mid-generation (half done) beside the 4 it took: a third of its compute
    wasteful = sync_step(10.0, 2.0, 8.0, 0.0, aborted=4)
    assert wasteful.useful_share == pytest.approx(4 / 6)
    assert model(wasteful).gen_s(1) == pytest.approx(model(replace(wasteful, aborted_groups=0)).gen_s(1) * 4 / 6)


def test_a_confirming_step_corrects_the_learners_cost_and_the_engines_rate():
    step = sync_step(10.0, 2.0, 6.0, 2.0)
    m = model(step, BATCHING)
    # measured on its share: the learner took 3x (not the assumed 1.7x); the engine ran its
    # batch at half the rate the curve promised
    assumed = BATCHING.rate(16, False) / BATCHING.rate(32, True)
    async_rate = step.engine_rate / assumed / 2  # type: ignore[operator]
    measured = replace(step, learner_s=6.0, engine_batch=32.0,
                       gen_compute_s=32.0 * 100.0 / async_rate)
    fixed = m.confirmed([measured, measured])
    assert fixed.learner_share_cost == pytest.approx(3.0)
    assert fixed.gen_correction == pytest.approx(2.0)
    assert fixed.step_s(1) > m.step_s(1)
    # an async step that ran a smaller batch than the model expects (the generator was ahead and
    # waited), at exactly the curve's rate for that batch: the curve was right, nothing to correct
    small = 8.0
    on_curve = step.engine_rate * BATCHING.rate(small, True) / BATCHING.rate(16, False)  # type: ignore[operator]
    assert m.confirmed([replace(step, engine_batch=small, gen_compute_s=small * 100.0 / on_curve)]).gen_correction \
        == pytest.approx(1.0)
    # steps differ in length: the learner's cost compares per token it computed on
    counted = model(replace(step, learner_tokens=1000), BATCHING)
    longer = replace(measured, learner_s=4.0, learner_tokens=2000)  # twice the time for twice the tokens
    assert counted.confirmed([longer]).learner_share_cost == pytest.approx(1.0)
    assert counted.confirmed([replace(longer, learner_s=6.0)]).learner_share_cost == pytest.approx(1.5)
    # the step that filled the pipeline (its learner the first on one core, 2.5x a steady one)
    # and the next: the better of the two is the steady cost, and it keeps a choice the slow
    # step alone would have reverted
    slow = replace(longer, learner_s=10.0)
    assert counted.confirmed([slow, replace(longer, learner_s=5.0)]).learner_share_cost == pytest.approx(1.25)
    assert counted.confirmed([slow]).learner_share_cost == pytest.approx(2.5)


def test_the_learners_calibrated_split_cost_replaces_the_assumed_one():
    # calibrated at start-up: the learner on its one core as fast per token as on both (a small
    # model's step is much serial dispatch), and async is worth it; the assumed 1.7x says sync
    step = sync_step(10.0, 6.0, 4.0, 0.0)
    calibrated = Auto(M2PO, [0, 1, 2, 4], True, 128, curve=BATCHING, learner_split=1.05)
    assumed = Auto(M2PO, [0, 1, 2, 4], True, 128, curve=BATCHING)
    assert calibrated.measure(step).learner_share_cost == 1.05
    assert assumed.measure(step).learner_share_cost == LEARNER_SPLIT_SLOWDOWN
    assert decide(calibrated.measure(step), [0, 1, 2, 4], M2PO, "measured", 1).mode is Mode.ASYNC
    assert decide(assumed.measure(step), [0, 1, 2, 4], M2PO, "measured", 1).mode is Mode.SYNC
    # it is part of what a checkpoint keeps
    again = Auto(M2PO, [0, 1, 2, 4], True, 128)
    again.restore(json.loads(json.dumps(calibrated.to_json())))
    assert again.learner_split == 1.05


def async_step(step_s: float, learner_s: float, gen_s: float, wait_s: float = 0.0, calls_s: float = 0.0,
               batch: float = 48.0) -> StepFigures:
    return StepFigures(step_s=step_s, learner_s=learner_s, gen_compute_s=gen_s, wait_s=wait_s, engine_batch=batch,
                       engine_steps=100.0, samples=32, groups=4, samples_pulled=32, aborted_groups=0,
                       call_wait_s=calls_s)


OPENED = Choice(Mode.ASYNC, 2, True, "opens async", "opening")


def opened_model(share_cost: float = 1.1) -> Model:
    # the opening's model: its `sync` is not read
    return Model(async_step(1.0, 1.0, 1.0), True, batch_cap=128, curve=BATCHING, learner_share_cost=share_cost)


def test_the_sync_step_an_async_step_implies():
    step = async_step(10.0, 4.0, 9.0, wait_s=0.5, calls_s=3.0)
    floor = implied_sync(step, True, BATCHING, 1.1, 48.0)
    # the learner on every core, the generation on every core (here at the same batch), the
    # longer of the hidden waits and one median call of each kind
    assert floor.learner_s == pytest.approx(4.0 / 1.1)
    assert floor.gen_compute_s == pytest.approx(9.0 * BATCHING.rate(48, True) / BATCHING.rate(48, False))
    assert floor.wait_s == 3.0 and floor.step_s == pytest.approx(floor.learner_s + floor.gen_compute_s + 3.0)
    # a smaller batch on every core is slower per token; halves that cannot split add up as measured
    assert implied_sync(step, True, BATCHING, 1.1, 16.0).gen_compute_s > floor.gen_compute_s
    assert implied_sync(step, False, None, 1.1, 48.0).step_s == pytest.approx(4.0 + 9.0 + 3.0)
    # an async step whose groups were all scored during the step before made no calls: the
    # opening's median call comes from the steps that did
    assert StepFigures.mean([step, replace(step, call_wait_s=0.0)]).call_wait_s == 3.0
    # the generator's share is calibrated at large batches only: below them it runs at the
    # every-core curve times the share's ratio at its smallest, not at that batch's rate
    assert BATCHING.rate(16, True) == pytest.approx(BATCHING.rate(16, False) * 140.0 / 200.0)
    assert BATCHING.rate(256, True) == pytest.approx(BATCHING.rate(256, False) * 220.0 / 300.0)


def test_an_opening_sooner_than_the_sync_step_it_implies_stays_async_without_a_sync_step():
    # rewards wait 3 s a call: a sync step waits on one with nothing to generate meanwhile,
    # async hides them behind the other groups in flight. The first step filled the pipeline
    # (40 s: any mode pays it once) and does not count
    steps = [async_step(40.0, 12.0, 39.0, calls_s=3.0), async_step(10.0, 4.0, 8.0, calls_s=3.0)]
    choice = decide_opened(steps, OPENED, opened_model(), M2PO, [0, 1, 2, 4], 2)
    assert choice.mode is Mode.ASYNC and choice.kind == "opened" and choice.decided_at_step == 2
    assert choice.sync is not None and choice.sync.step_s > 10.0 * M2PO.at(2) * MARGIN
    # the staleness measured predicts what it measured (the model's ratios are anchored there)
    assert {p.staleness: p.step_s for p in choice.predictions}[2] == pytest.approx(10.0)
    assert choice.predicted_step_s == {p.staleness: p.step_s for p in choice.predictions}[choice.staleness]
    assert "async at k2 took 10.0s a step after the fill" in choice.reason


def test_an_opening_that_a_sync_step_might_beat_measures_sync():
    # nothing waits, the learner is most of the step, and on every core it is 1.7x as fast:
    # sync could be sooner, so it is measured rather than guessed
    steps = [async_step(10.0, 9.5, 5.0), async_step(10.0, 9.5, 5.0)]
    choice = decide_opened(steps, OPENED, opened_model(1.7), M2PO, [0, 1, 2, 4], 2)
    assert choice.mode is Mode.SYNC and choice.kind == "measure"
    assert choice.sync is not None and choice.sync.step_s < 10.0 * M2PO.at(2) * MARGIN
    assert "2 sync steps measure" in choice.reason


def test_an_auto_run_opens_async_below_the_cap():
    assert (opening_choice([0, 1, 2, 4], True).staleness, opening_choice([0, 1], True).staleness) == (2, 1)
    assert opening_choice([0, 1, 2, 3], False).staleness == 2


def test_async_slower_than_predicted_but_sooner_than_sync_stays_async():
    # v2: async predicted 1.2 s a step, measured 2.0 s, sync measured 2.8 s; re-measuring there
    # every few steps cost 16 of 112 steps in sync
    measured = sync_step(2.8, 1.0, 1.8, 0.0)
    choice = decide(model(measured, BATCHING), [0, 1, 2, 4], M2PO, "measured", 1)
    assert choice.mode is Mode.ASYNC and choice.predicted_step_s is not None and choice.predicted_step_s < 2.0
    assert async_still_sooner(choice, choice.predicted_step_s * 0.9, M2PO) == "faster than predicted"
    assert "sooner than the sync step measured (2.8s)" in async_still_sooner(choice, 2.0, M2PO)  # type: ignore[operator]
    # slower than sync once lag's cost is counted: measure sync again
    assert async_still_sooner(choice, 2.8 / M2PO.at(choice.staleness), M2PO) is None
    assert async_still_sooner(choice, 3.5, M2PO) is None


def test_drifted_async_steps_that_still_beat_the_sync_step_they_imply_keep_async():
    # The sandbox at 10 s, seed 0 (section 22f): the opening's second step set a low mark (its
    # groups were made during the fill), then a slower tool made three steps take twice that.
    # Against the mark they drifted, and against the opening's implied sync step times lag's cost
    # they lost, so 2 sync steps measured again (52.5 and 36.4 s) before async came back. Tested
    # as the opening's steps are, against the sync step they themselves imply (their learner and
    # generation on every core, and the calls they waited on), they keep async with no sync step.
    opened = decide_opened([async_step(20.0, 9.0, 19.0), async_step(8.4, 8.4, 8.0, batch=128.0)], OPENED,
                           opened_model(1.27), M2PO, [0, 1, 2, 4], 2)
    assert opened.mode is Mode.ASYNC and opened.predicted_step_s is not None and opened.predicted_step_s < 10.0
    assert opened.sync is not None
    drifted = [async_step(s, 8.0, 8.0, wait_s=4.0, calls_s=14.0, batch=110.0) for s in (19.0, 18.0, 17.0)]
    mean = StepFigures.mean(drifted).step_s
    assert mean * M2PO.at(opened.staleness) > opened.sync.step_s
    assert async_still_sooner(opened, mean, M2PO) is None  # against the opening's sync: only sync steps could tell
    kept = async_beats_implied(drifted, opened, opened_model(1.27), M2PO)
    assert kept is not None
    implied, why = kept
    assert implied.step_s > mean * M2PO.at(opened.staleness) * MARGIN and "sooner than the sync step they imply" in why
    assert implied.wait_s == 14.0  # a sync step waits a median call of each kind its rollouts made
    # the same steps with nothing to wait on: on every core their learner and generation would
    # make a sync step as short, so only sync steps can tell
    unhidden = [replace(s, wait_s=0.0, call_wait_s=0.0) for s in drifted]
    assert async_beats_implied(unhidden, opened, opened_model(1.27), M2PO) is None


def test_the_monitor_compares_steps_per_sample_drawn():
    # a task being solved draws more groups per step (flat ones train nothing): a step that drew
    # twice the samples, its generation taking twice as long and its learner as long, is on its
    # prediction
    measured = sync_step(10.0, 2.0, 8.0, 0.0)
    choice = decide(model(measured), [0, 1, 2, 4], M2PO, "measured", 1)
    twice = replace(measured, step_s=18.0, gen_compute_s=16.0, samples_pulled=64)
    assert scaled_step_s(twice, choice) == pytest.approx(10.0)
    assert not off_prediction(choice.predicted_step_s, scaled_step_s(twice, choice))
    # the same step with as many samples as measured took 1.8x: off
    assert off_prediction(choice.predicted_step_s, scaled_step_s(replace(twice, samples_pulled=32), choice))


def test_candidates_and_the_monitors_rule():
    assert candidates(4) == [0, 1, 2, 4]
    assert candidates(1) == [0, 1]
    assert candidates(3) == [0, 1, 2, 3]
    assert candidates(8) == [0, 1, 2, 4, 8]
    assert not off_prediction(10.0, 12.4) and off_prediction(10.0, 12.6) and off_prediction(10.0, 7.4)
    assert not off_prediction(None, 100.0)


def test_a_choice_survives_json():
    choice = decide(model(sync_step(70.0, 15.0, 5.0, 50.0)), [0, 1, 2, 4], M2PO, "measured", 3)
    again = Choice.from_json(json.loads(json.dumps(choice.to_json())))
    assert again == choice


def test_a_choice_an_earlier_version_saved_still_loads_and_an_unknown_key_fails():
    # checkpoints written before StepFigures dropped learner_cpu_s carry it in the choice
    choice = decide(model(sync_step(70.0, 15.0, 5.0, 50.0)), [0, 1, 2, 4], M2PO, "measured", 3)
    saved = json.loads(json.dumps(choice.to_json()))
    saved["sync"]["learner_cpu_s"] = 12.5
    assert Choice.from_json(saved) == choice
    saved["sync"]["gen_s_renamed"] = 1.0
    with pytest.raises(TypeError, match="gen_s_renamed"):
        Choice.from_json(saved)


def test_auto_reads_a_step_as_its_metrics_line_gives_it():
    from lora_async.metrics import STEP_KEYS
    from lora_async.mode import StepRecord
    from lora_async.timing import CallWaits, GeneratorSplit, IdleSplit, Wait, call_figures

    idle = IdleSplit(admission=0.5, reward=1.0, tool=0.25, env=0.125, other=0.1)
    step = StepRecord(step_s=4.0, learner_s=1.5, generator=GeneratorSplit(2.0, 1.975, idle),
                      calls={Wait.ADMISSION: CallWaits(9.0, 9.5), Wait.REWARD: CallWaits(0.5, 0.9),
                             Wait.ENV: CallWaits(0.25, 0.3)},
                      engine_batch=12.0, engine_steps=40.0, samples=8, samples_pulled=12, groups=2,
                      tokens_trained=100, padded_tokens=28)
    # the waits and calls a sync step could not hide: rewards, tools, environments (not admission)
    assert StepFigures.of_step(step, aborted_groups=1) == StepFigures(
        step_s=4.0, learner_s=1.5, gen_compute_s=2.0, wait_s=1.375, engine_batch=12.0, engine_steps=40.0, samples=8,
        groups=2, samples_pulled=12, aborted_groups=1, learner_tokens=128, call_wait_s=0.75)
    # ... and the line's figures are the record's, under the keys a run has always written
    line = {**step.generator.figures(), **call_figures(step.calls)}
    assert line == {"gen_compute_s": 2.0, "gen_idle_s": 1.975, "gen_idle_admission_s": 0.5, "gen_idle_reward_s": 1.0,
                    "gen_idle_tool_s": 0.25, "gen_idle_env_s": 0.125, "gen_idle_other_s": 0.1,
                    "admission_wait_s_p50": 9.0, "admission_wait_s_p95": 9.5, "reward_wait_s_p50": 0.5,
                    "reward_wait_s_p95": 0.9, "env_wait_s_p50": 0.25, "env_wait_s_p95": 0.3}
    assert set(step.generator.figures()) <= set(STEP_KEYS)


def test_pinned_and_own_device_choices_need_no_measurement():
    assert initial_choice("sync", 2, shared=True, split=True).mode is Mode.SYNC  # type: ignore[union-attr]
    assert initial_choice("auto", 0, shared=True, split=True).mode is Mode.SYNC  # type: ignore[union-attr]
    pinned = initial_choice("async", 3, shared=True, split=True)
    assert pinned is not None and pinned.mode is Mode.ASYNC and pinned.staleness == 3
    own = initial_choice("auto", 2, shared=False, split=False)
    assert own is not None and own.mode is Mode.ASYNC and "device of its own" in own.reason
    assert initial_choice("auto", 2, shared=True, split=True) is None  # measures first


def test_async_without_staleness_is_a_one_line_config_error(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[buffer]\nmode = "async"\nmax_staleness = 0\n')
    with pytest.raises(ConfigError, match=r"buffer\.mode.*max_staleness >= 1"):
        load_config(path)


# ---------------------------------------------------------------- auto runs on fakes

SWITCHED_REWARD = """
import asyncio, os

async def reward(prompt, completion, answer):
    # a sandbox or a judge: the generator has nothing to do meanwhile. SLOW_AFTER names a file
    # whose existence makes every call wait; DELAY_S is the wait (0 before the file appears)
    if os.path.exists(os.environ["SLOW_AFTER"]):
        await asyncio.sleep(float(os.environ["DELAY_S"]))
    return float(completion.startswith("x"))
"""


def config(tmp_path: Path, reward: str, reward_workers: int = 64, **buffer) -> TrainConfig:
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"item {i}", "answer": "-"}) for i in range(200)))
    return TrainConfig.model_validate({
        "sampling": {"samples_per_prompt": 4, "max_new_tokens": 8},
        "generator": {"groups_in_flight": 8},
        "learner": {"groups_per_step": 2},
        "buffer": {"max_staleness": 2, **buffer},
        "run": {"max_steps": 8, "output_dir": str(tmp_path / "out"), "progress": False, "canary_every": 0,
                "chart_every": 0},
        "task": {"type": "jsonl", "path": str(data), "reward": reward, "heldout": 4,
                 "reward_workers": reward_workers},
    })


def slow_reward(tmp_path: Path, monkeypatch, delay_s: float, from_start: bool = True) -> Path:
    """The switched reward, waiting `delay_s` once the returned flag file exists."""
    (tmp_path / "switched_reward.py").write_text(SWITCHED_REWARD)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    flag = tmp_path / "slow"
    monkeypatch.setenv("SLOW_AFTER", str(flag))
    monkeypatch.setenv("DELAY_S", str(delay_s))
    if from_start:
        flag.touch()
    return flag


def run(cfg: TrainConfig, parts: FakeParts, resume: bool = False,
        on_step=None) -> tuple[dict, list[dict], list[dict], list[dict]]:
    summary = asyncio.run(train(cfg, resume=resume, console=Console(stderr=True, width=200), parts=parts,
                                on_step=on_step))
    rows = read_metrics(Path(cfg.run.output_dir) / "metrics.jsonl")
    return (summary, [r for r in rows if "kind" not in r], [r for r in rows if r.get("kind") == "mode"],
            [r for r in rows if r.get("kind") == "calibrate"])


def test_auto_opens_async_and_stays_where_rewards_wait(tmp_path, monkeypatch):
    # an async reward waits without using a core: a sync step would wait on one with nothing to
    # generate, async hides the waits behind the other groups in flight
    slow_reward(tmp_path, monkeypatch, delay_s=1.0)
    cfg = config(tmp_path, "switched_reward:reward")
    parts = FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.1, pinned_step_s=0.17)
    summary, steps, events, calibrations = run(cfg, parts)
    assert len(calibrations) == 1 and calibrations[0]["engine_b1_tok_s"] > 0
    decisions = [(e["mode_kind"], e["step"], e["mode"]) for e in events]
    # async from the first step; after the second it stays, and no sync step ever ran
    assert decisions[:2] == [("opening", 0, "async"), ("opened", 2, "async")]
    # async stays: waits overlap more than the model assumes, so steps may beat the prediction
    # (the mark then moves to what they take), never fall behind it
    assert all(kind == "kept" and mode == "async" for kind, _, mode in decisions[2:])
    assert summary["mode"] == "async" and summary["mode_staleness"] >= 1
    # the fastest sync step the async ones imply: it would wait a reward call (1 s)
    assert summary["mode_sync_wait_s"] >= 1.0 > summary["mode_sync_learner_s"]
    assert [d["mode_kind"] for d in summary["mode_decisions"]] == [kind for kind, _, _ in decisions]
    # one step on-policy (nothing older exists); from the second on, generation ran ahead
    lags = [r["policy_lag_max"] for r in steps]
    assert lags[0] == 0 and max(lags[1:]) >= 1


def test_an_opening_the_learner_cannot_afford_measures_sync_and_stays_sync(tmp_path, monkeypatch):
    # the learner on its share of the cores takes 15x as long: the opening's async steps are
    # slower than a sync step might be, 2 sync steps measure, and the model, corrected by what
    # the async steps measured (no assumed split cost, no confirming async steps), keeps sync
    slow_reward(tmp_path, monkeypatch, delay_s=0.3)
    cfg = config(tmp_path, "switched_reward:reward")
    parts = FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.1, pinned_step_s=1.5)
    summary, steps, events, _ = run(cfg, parts)
    decisions = [(e["mode_kind"], e["mode"], e["step"]) for e in events]
    assert decisions[:3] == [("opening", "async", 0), ("measure", "sync", 2), ("measured", "sync", 4)]
    # a later check may decide again from the sync steps it sees; it keeps what was measured
    assert all(kind == "re-decided" and mode == "sync" for kind, mode, _ in decisions[3:])
    assert summary["mode"] == "sync"
    # sync from step 3: on-policy again, and the learner back on every core (the fake reports
    # the step time it was given: 0.1 s on every core, 1.5 s pinned to its share)
    assert all(r["policy_lag_max"] == 0 for r in steps[3:])
    assert all(r["learner_s"] == pytest.approx(0.1) for r in steps[2:])


def test_nothing_waits_and_the_split_costs_goes_sync_after_two_async_steps(tmp_path, monkeypatch):
    slow_reward(tmp_path, monkeypatch, delay_s=0.0, from_start=False)
    cfg = config(tmp_path, "switched_reward:reward")
    summary, steps, events, _ = run(cfg, FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.1, pinned_step_s=0.3))
    assert [(e["mode_kind"], e["mode"], e["step"]) for e in events] == [
        ("opening", "async", 0), ("measure", "sync", 2), ("measured", "sync", 4)]
    assert summary["mode"] == "sync" and all(r["policy_lag_max"] == 0 for r in steps[3:])


def test_steps_that_drift_from_the_prediction_make_auto_decide_again(tmp_path, monkeypatch):
    # the first steps wait on nothing (sync from step 3, measured at 4); from step 5 every
    # reward call waits 1 s, so sync steps take several times the predicted time, and after 3
    # of them auto decides again; that async choice is then confirmed by 2 async steps. The
    # reward slows down right after the measured step: a fast step checked against the
    # prediction could read as off on a loaded machine (a 0.1 s step stretched by half), so
    # none is left between the measurement and the slow steps.
    flag = slow_reward(tmp_path, monkeypatch, delay_s=1.0, from_start=False)
    cfg = config(tmp_path, "switched_reward:reward")
    cfg.run.max_steps = 12

    def at_step(run_state) -> None:
        if run_state.global_step == 4:
            flag.touch()

    parts = FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.1, pinned_step_s=0.17)
    summary, steps, events, _ = run(cfg, parts, on_step=at_step)
    kinds = [(e["mode_kind"], e["mode"]) for e in events]
    assert kinds[:5] == [("opening", "async"), ("measure", "sync"), ("measured", "sync"), ("re-decided", "async"),
                         ("confirmed", "async")]
    redecided = events[3]
    assert "3 steps took" in redecided["mode_reason"]
    # three slow sync steps and then the decision, not later: steps 5-7, or 6-8 where step 5's
    # groups were scored before the flag appeared (producers wake before `on_step` runs)
    assert redecided["step"] in (7, 8)
    assert events[4]["step"] == redecided["step"] + 2
    assert max(r["policy_lag_max"] for r in steps[redecided["step"]:]) >= 1


STEPPED_REWARD = """
import asyncio, os

async def reward(prompt, completion, answer):
    # 0.5 s a call, and 3 s once the file SLOWER names exists (reward workers may be processes:
    # a file reaches them, an environment variable set later does not)
    await asyncio.sleep(3.0 if os.path.exists(os.environ["SLOWER"]) else 0.5)
    return float(completion.startswith("x"))
"""


def test_async_steps_that_drift_but_beat_the_sync_step_they_imply_stay_async_without_sync_steps(tmp_path,
                                                                                                 monkeypatch):
    # rewards wait 0.5 s a call; from step 4 on, generations got longer: the learner takes 5x as
    # long and each reward call 3 s. The async steps take several times the opening's mark, and
    # times lag's cost more than the sync step the opening implied, but a sync step now would
    # wait a 3 s call on top of that learner: async stays, the sync step to beat moves to what
    # the drifted steps imply, and no sync step runs
    (tmp_path / "stepped_reward.py").write_text(STEPPED_REWARD)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    slower = tmp_path / "slower"
    monkeypatch.setenv("SLOWER", str(slower))
    cfg = config(tmp_path, "stepped_reward:reward")
    cfg.run.max_steps = 12
    parts = FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.1, pinned_step_s=0.17)

    def at_step(run_state) -> None:
        if run_state.global_step == 4:
            slower.touch()
            parts.fake_learner.step_s, parts.fake_learner.pinned_step_s = 0.5, 0.85

    summary, steps, events, _ = run(cfg, parts, on_step=at_step)
    told = "\n".join(f"{e['mode_kind']} {e['step']}: {e['mode_reason']}" for e in events)
    assert [e["mode_kind"] for e in events[:2]] == ["opening", "opened"], told
    assert all(e["mode"] == "async" for e in events), told
    assert all(r["policy_lag_max"] >= 1 for r in steps[2:]), told  # no sync step ran
    implied = [e for e in events if "sooner than the sync step they imply" in e["mode_reason"]]
    assert implied and implied[0]["mode_kind"] == "kept" and implied[0]["step"] <= 9, told
    # the sync step to beat moved to what the drifted steps imply: their slower learner and calls
    # (the check may fire first on steps from both sides of the change, then again)
    assert implied[-1]["mode_sync_learner_s"] > 3 * events[1]["mode_sync_learner_s"], told
    assert implied[-1]["mode_sync_wait_s"] > 3 * events[1]["mode_sync_wait_s"], told


def test_a_resumed_auto_run_keeps_its_choice_and_does_not_measure_again(tmp_path, monkeypatch):
    slow_reward(tmp_path, monkeypatch, delay_s=1.0)
    cfg = config(tmp_path, "switched_reward:reward")
    cfg.run.max_steps, cfg.run.checkpoint_every = 4, 2
    first, _, events, calibrations = run(cfg, FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.1,
                                                        pinned_step_s=0.17))
    assert first["mode"] == "async" and len(calibrations) == 1 and len(events) == 2
    cfg.run.max_steps = 8
    summary, steps, events, calibrations = run(cfg, FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.1,
                                                              pinned_step_s=0.17), resume=True)
    assert len(calibrations) == 1  # the first session's only: the resumed one did not calibrate
    resumed = [e for e in events if e["step"] >= 4]
    assert (resumed[0]["mode_kind"], resumed[0]["mode"], resumed[0]["step"]) == ("resumed", "async", 4)
    assert all(e["mode_kind"] == "kept" for e in resumed[1:])  # only ever faster than predicted
    assert resumed[0]["mode_staleness"] == first["mode_staleness"]
    assert [d["mode_kind"] for d in summary["mode_decisions"]][:3] == ["opening", "opened", "resumed"]
    # no sync step after the resume: generation runs ahead from its first step on
    after = [r for r in steps if r["step"] > 4]
    assert len(after) == 4 and max(r["policy_lag_max"] for r in after) >= 1


def test_pinned_async_says_so_from_the_start(tmp_path, monkeypatch):
    slow_reward(tmp_path, monkeypatch, delay_s=0.0, from_start=False)
    cfg = config(tmp_path, "switched_reward:reward", mode="async")
    summary, steps, events, calibrations = run(cfg, FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.1))
    assert summary["mode"] == "async" and summary["mode_reason"] == "pinned by buffer.mode"
    assert summary["mode_decided_at_step"] == 0 and events == [] and calibrations == []
    assert [d["mode_kind"] for d in summary["mode_decisions"]] == ["pinned"]


def test_a_calibration_the_engine_refuses_is_said_once_and_auto_still_decides(tmp_path, monkeypatch):
    slow_reward(tmp_path, monkeypatch, delay_s=1.0)
    cfg = config(tmp_path, "switched_reward:reward")
    cfg.run.max_steps = 3
    parts = FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.1, pinned_step_s=0.17)
    submit = parts.fake_generator.submit

    def refuse_calibration(request, on_done):
        if request.tag == "calibrate":
            on_done(GenResult.failed(request, GenStatus.REFUSED, "no room"))
            return
        submit(request, on_done)

    parts.fake_generator.submit = refuse_calibration  # type: ignore[method-assign]
    console = Console(stderr=True, width=200, record=True)
    asyncio.run(train(cfg, console=console, parts=parts))
    text = console.export_text()
    assert text.count("calibration failed (refused: no room)") == 1
    rows = read_metrics(Path(cfg.run.output_dir) / "metrics.jsonl")
    calibrations = [r for r in rows if r.get("kind") == "calibrate"]
    assert len(calibrations) == 1 and not any(k.startswith("engine_") for k in calibrations[0])
    assert [r["mode_kind"] for r in rows if r.get("kind") == "mode"][:2] == ["opening", "opened"]
