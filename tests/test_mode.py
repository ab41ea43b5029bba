"""Sync or async (`buffer.mode`): the choice from measured figures, and an auto run on fakes that
turns async where its rewards wait and stays sync where nothing waits."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from rich.console import Console

from lora_async.config import ConfigError, TrainConfig, load_config
from lora_async.metrics import read_metrics
from lora_async.mode import PROBE_STEPS, TRIAL_STEPS, Mode, SyncStep, async_step_s, choose, initial_choice, judge, trial
from lora_async.orchestrator import train

from .fakes import FakeParts

SLOW_REWARD = """
import asyncio

async def reward(prompt, completion, answer):
    await asyncio.sleep(1.0)  # a sandbox or a judge: the generator has nothing to do meanwhile
    return float(completion.startswith("x"))
"""


# ---------------------------------------------------------------- the choice from figures


def test_nothing_waits_on_shared_cores_stays_sync():
    # the demo on 2 cores: generation 74% of a 9.5 s step, the learner 25%, no waits
    demo = SyncStep(step_s=9.5, learner_s=2.4, gen_compute_s=7.0, wait_s=0.0)
    choice = choose(demo, max_staleness=4, split=True)
    assert choice.mode is Mode.SYNC and choice.staleness == 0
    assert "waits 0%" in choice.reason and choice.predicted_async_s is not None


def test_waiting_generator_turns_async_at_the_smallest_staleness_that_helps():
    # tool waits are 71% of a sync step
    tools = SyncStep(step_s=70.0, learner_s=15.0, gen_compute_s=5.0, wait_s=50.0)
    choice = choose(tools, max_staleness=4, split=True)
    assert choice.mode is Mode.ASYNC and choice.split
    # staleness 1 leaves the generator the long pole ((6.5 + 50) / 2 > 25.5); 2 reaches the learner's bound
    assert async_step_s(tools, 1, True) > async_step_s(tools, 2, True) == pytest.approx(15.0 * 1.7)
    assert choice.staleness == 2
    assert "waits 71%" in choice.reason
    # capped by max_staleness
    assert choose(tools, max_staleness=1, split=True).staleness == 1


def test_the_margin_keeps_sync_when_async_is_barely_faster():
    close = SyncStep(step_s=10.0, learner_s=5.0, gen_compute_s=4.5, wait_s=0.5)
    assert 10.0 / 1.2 < async_step_s(close, 1, True) < 10.0
    assert choose(close, max_staleness=2, split=True).mode is Mode.SYNC


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


def config(tmp_path: Path, reward: str, reward_workers: int = 8, **buffer) -> TrainConfig:
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"item {i}", "answer": "-"}) for i in range(80)))
    return TrainConfig.model_validate({
        "sampling": {"samples_per_prompt": 4, "max_new_tokens": 8},
        "generator": {"groups_in_flight": 8},
        "learner": {"groups_per_step": 2},
        "buffer": {"max_staleness": 2, **buffer},
        "run": {"max_steps": 10, "output_dir": str(tmp_path / "out"), "progress": False, "canary_every": 0,
                "chart_every": 0},
        "task": {"type": "jsonl", "path": str(data), "reward": reward, "heldout": 4,
                 "reward_workers": reward_workers},
    })


def run(cfg: TrainConfig, parts: FakeParts) -> tuple[dict, list[dict], list[dict]]:
    summary = asyncio.run(train(cfg, console=Console(stderr=True, width=200), parts=parts))
    rows = read_metrics(Path(cfg.run.output_dir) / "metrics.jsonl")
    return summary, [r for r in rows if "kind" not in r], [r for r in rows if r.get("kind") == "mode"]


def test_auto_tries_async_and_keeps_it_when_rewards_wait(tmp_path, monkeypatch):
    (tmp_path / "slow_reward.py").write_text(SLOW_REWARD)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    # an async reward waits without using a core, and every completion in flight waits at once:
    # sync has one step's 8 completions waiting, async up to (1 + staleness) steps' worth, so the
    # trial's gain comes from overlap, not from how busy the machine running the test is
    cfg = config(tmp_path, "slow_reward:reward", reward_workers=64)
    parts = FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.1, pinned_step_s=0.17)
    summary, steps, events = run(cfg, parts)
    decided = PROBE_STEPS + TRIAL_STEPS
    assert summary["mode"] == "async" and summary["mode_decided_at_step"] == decided
    assert summary["mode_staleness"] >= 1 and "samples/s" in summary["mode_reason"]
    assert summary["mode_sync_wait_s"] > summary["mode_sync_learner_s"]
    assert [(e["mode"], e["trial"]) for e in events] == [("async", True), ("async", False)]
    # the probe steps trained on-policy; from the trial on, generation ran ahead of the learner
    lags = [r["policy_lag_max"] for r in steps]
    assert lags[:PROBE_STEPS] == [0] * PROBE_STEPS
    assert max(lags[PROBE_STEPS:]) >= 1


def test_auto_goes_back_to_sync_when_the_split_costs_more_than_overlap_gains(tmp_path):
    # nothing waits, and the learner on its share of the cores takes 3x as long
    cfg = config(tmp_path, "regex:^x")
    parts = FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.1, pinned_step_s=0.3)
    summary, steps, events = run(cfg, parts)
    decided = PROBE_STEPS + TRIAL_STEPS
    assert summary["mode"] == "sync" and "not 1.2x" in summary["mode_reason"]
    assert [(e["mode"], e["trial"]) for e in events] == [("async", True), ("sync", False)]
    # after the decision: on-policy again, and the learner back on every core (not pinned: 0.1 s steps)
    assert all(r["policy_lag_max"] == 0 for r in steps[decided + 1:])
    assert all(r["learner_s"] < 0.25 for r in steps[decided + 1:])


def test_the_trial_is_judged_on_samples_trained_per_second():
    step = SyncStep(step_s=30.0, learner_s=5.0, gen_compute_s=24.0, wait_s=0.3)
    tried = trial(step, max_staleness=3, split=True)
    assert tried.mode is Mode.ASYNC and tried.staleness >= 1
    sync_rows = [{"samples": 8, "step_s": 30.0}] * 2
    faster = [{"samples": 8, "step_s": 12.0}, {"samples": 0, "step_s": 8.0}]  # 8 samples in 20 s vs 16 in 60 s
    assert judge(sync_rows, faster, tried, 5).mode is Mode.ASYNC
    slower = [{"samples": 8, "step_s": 28.0}] * 2
    kept = judge(sync_rows, slower, tried, 5)
    assert kept.mode is Mode.SYNC and kept.staleness == 0 and "not 1.2x" in kept.reason


def test_pinned_async_says_so_from_the_start(tmp_path):
    cfg = config(tmp_path, "regex:^x", mode="async")
    summary, steps, events = run(cfg, FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.1))
    assert summary["mode"] == "async" and summary["mode_reason"] == "pinned by buffer.mode"
    assert summary["mode_decided_at_step"] == 0 and events == []
