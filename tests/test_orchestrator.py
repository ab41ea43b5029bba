"""The training loop against fakes (tests/fakes.py): in-process, a few seconds each.

Admission keeps every trained sample within `max_staleness` versions (0 = synchronous: the
generator is idle while the learner trains), stale rollouts are aborted, a refused version
does not stop the run (three in a row do), a dead engine fails the run with its error and a
checkpoint, SIGTERM stops after the step in a fixed order, and a reward that always fails
stops the run at once with its error.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
from pathlib import Path

import pytest
from rich.console import Console

from lora_async.config import TrainConfig
from lora_async.metrics import read_metrics
from lora_async.orchestrator import TrainingError, train
from lora_async.orchestrator.rollouts import PRODUCER, producer_quota

from .fakes import FakeParts


def config(tmp_path: Path, **sections: dict) -> TrainConfig:
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"item {i}", "answer": "-"}) for i in range(50)))
    base = {
        "sampling": {"samples_per_prompt": 4, "max_new_tokens": 8},
        "generator": {"groups_in_flight": 8},
        "learner": {"groups_per_step": 2},
        "run": {"max_steps": 8, "output_dir": str(tmp_path / "out"), "progress": False, "canary_every": 1,
                "chart_every": 0},
        "task": {"type": "jsonl", "path": str(data), "reward": "regex:^x", "heldout": 4},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return TrainConfig.model_validate(base)


def run(cfg: TrainConfig, parts: FakeParts, on_step=None) -> dict:
    return asyncio.run(train(cfg, console=Console(stderr=True, width=200), on_step=on_step, parts=parts))


def steps(cfg: TrainConfig) -> list[dict]:
    return [r for r in read_metrics(Path(cfg.run.output_dir) / "metrics.jsonl") if "kind" not in r]


@pytest.mark.parametrize("lag", [1, 3])
def test_a_fixed_lag_trains_every_sample_exactly_that_many_versions_behind(tmp_path, lag):
    cfg = config(tmp_path, buffer={"mode": "async", "max_staleness": lag, "fixed_lag": lag,
                                   "partial_rollouts": False})
    parts = FakeParts(["main"], gen_delay=lambda: 0.02, step_s=0.1)
    run(cfg, parts)
    trained = parts.fake_learner.trained
    assert len(trained) == 8
    for t in trained:
        if t.learner_version >= lag:  # from then on, every sample was drawn exactly `lag` versions back
            assert t.lags == [lag] * len(t.lags), (t.learner_version, t.lags)
            assert t.in_flight == 0  # and nothing generated while the learner trained
        else:  # before that only version 0 exists
            assert set(t.versions) == {0}
    # the generator never served a version newer than the learner's minus the lag
    assert parts.fake_generator.live_versions("main")[-1] == 8 - lag
    assert all(r["policy_lag_mean"] == lag for r in steps(cfg) if r["step"] > lag)


@pytest.mark.parametrize("dropped, shown", [(0.9, 1), (0.1, 0)])
def test_a_loss_that_drops_most_tokens_is_shown_once(tmp_path, dropped, shown):
    import io

    cfg = config(tmp_path)
    parts = FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.01)
    parts.fake_learner.dropped_frac = dropped
    out = io.StringIO()
    asyncio.run(train(cfg, console=Console(file=out, width=400), parts=parts))
    assert len(re.findall(r"main: loss.type = m2po dropped \d+% of step 1's tokens", out.getvalue())) == shown
    assert all(abs(r["clip_frac"] - dropped) < 0.05 for r in steps(cfg))  # every step dropped as much


@pytest.mark.parametrize("buffer", [{"mode": "auto"}, {"mode": "async", "max_staleness": 1},
                                    {"mode": "async", "max_staleness": 2, "partial_rollouts": True}])
def test_a_fixed_lag_needs_async_at_that_staleness_without_partial_rollouts(tmp_path, buffer):
    with pytest.raises(ValueError, match="buffer.fixed_lag"):
        config(tmp_path, buffer={"partial_rollouts": False, "max_staleness": 2, **buffer, "fixed_lag": 2})


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_admission_keeps_every_sample_within_max_staleness(tmp_path, staleness):
    cfg = config(tmp_path, buffer={"mode": "async" if staleness else "sync", "max_staleness": staleness})
    parts = FakeParts(["main"], gen_delay=lambda: 0.02, step_s=0.15)
    summary = run(cfg, parts)
    trained = parts.fake_learner.trained
    assert summary["steps"] == len(trained) == 8
    lags = [lag for t in trained for lag in t.lags]
    # every sample finished inside the window; a continued one (partial rollouts) may have begun
    # one version outside it, and exactly those older tokens are marked for correction
    samples = [s for t in trained for s in t.samples]
    assert all(s.policy_lag - (s.finished_version - s.version) <= staleness for s in samples)
    assert max(lags) <= staleness + 1
    for s in samples:
        assert s.token_stale() == [lag > staleness for lag in s.token_lags()]
    # the lag stamped on a sample is the learner's version minus the sample's version
    assert all(lag == t.learner_version - v for t in trained for lag, v in zip(t.lags, t.versions))
    if staleness == 0:  # synchronous: nothing generates while the learner trains
        assert all(t.in_flight == 0 for t in trained)
    else:  # asynchronous: generation runs ahead of the learner, within the bound
        assert any(t.in_flight > 0 for t in trained)
    # admission, not the buffer's stale drop, bounds the lag: little generated work is thrown
    # away (without it producers run far ahead: ~1,800 samples for these 64 trained)
    trained_samples = 8 * 2 * 4
    assert summary["samples_in"] < 4 * trained_samples
    versions = [r["version"] for r in steps(cfg)]
    assert versions == list(range(1, 9))  # one new version per step, never repeated


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_slow_hand_off_does_not_make_producers_start_doomed_groups(tmp_path, staleness):
    # Each hand-off takes 0.3 s: groups started meanwhile would be sampled on a version the learner
    # has already left, and be dropped or aborted as stale. Admission counts the pending version
    # (without it, ~250 groups were thrown away here for the 16 trained).
    cfg = config(tmp_path, buffer={"mode": "async" if staleness else "sync", "max_staleness": staleness})
    summary = run(cfg, FakeParts(["main"], gen_delay=lambda: 0.02, step_s=0.15, publish_s=0.3))
    assert summary["steps"] == 8
    last = steps(cfg)[-1]
    trained_groups = 8 * 2
    wasted_groups = last["dropped_stale"] // 4 + last["aborted_stale_groups"]
    assert wasted_groups < trained_groups
    assert max(r["policy_lag_max"] for r in steps(cfg)) <= staleness


def test_rollouts_a_step_makes_too_stale_are_aborted(tmp_path):
    """A long-tailed generation: 1 request in 4 takes 3 s while steps take 0.1 s."""
    rng = random.Random(1)
    cfg = config(tmp_path, buffer={"mode": "async", "max_staleness": 1, "partial_rollouts": False}, run={"max_steps": 10})
    parts = FakeParts(["main"], gen_delay=lambda: 3.0 if rng.random() < 0.25 else 0.01, step_s=0.1)
    summary = run(cfg, parts)
    aborted = parts.fake_generator.aborted
    assert aborted and summary["aborted_stale_groups"] == len(aborted)
    assert all(lag <= 1 for t in parts.fake_learner.trained for lag in t.lags)
    assert steps(cfg)[-1]["aborted_stale_groups"] == summary["aborted_stale_groups"]


def test_a_refused_transfer_is_counted_sent_again_and_the_run_goes_on(tmp_path):
    cfg = config(tmp_path)
    parts = FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.05, damage={2, 3})
    summary = run(cfg, parts)
    rows = steps(cfg)
    assert [r["step"] for r in rows] == list(range(1, 9))
    refused = [r for r in rows if r.get("sync_error")]
    assert [r["version"] for r in refused] == [2, 3] and "checksum mismatch" in refused[0]["sync_error"]
    assert all(r["sync_transport"] == "fake" for r in rows)  # each was then delivered
    assert summary["rejected_versions"] == 2
    assert parts.fake_generator.live_versions("main") == list(range(0, 9))


def test_transfers_refused_three_times_in_a_row_stop_the_run(tmp_path):
    cfg = config(tmp_path, run={"max_steps": 20})
    parts = FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.05, refuse={2})
    with pytest.raises(TrainingError, match="3 transfers in a row refused.*checksum mismatch"):
        run(cfg, parts)
    assert len(steps(cfg)) < 20


def test_a_dead_engine_stops_the_run_with_its_error_and_a_checkpoint(tmp_path):
    cfg = config(tmp_path, run={"max_steps": 50, "canary_every": 0})
    parts = FakeParts(["main"], gen_delay=lambda: 0.05, step_s=0.05)

    def kill_at_step_2(run_):
        if run_.global_step == 2:
            parts.fake_generator.kill()

    with pytest.raises(TrainingError, match="engine"):
        run(cfg, parts, on_step=kill_at_step_2)
    checkpoints = Path(cfg.run.output_dir) / "checkpoints"
    state = json.loads((checkpoints / (checkpoints / "LATEST").read_text() / "state.json").read_text())
    assert 2 <= state["step"] < 50
    summary = json.loads((Path(cfg.run.output_dir) / "summary.json").read_text())
    assert "engine" in summary["error"]


def test_a_failing_learner_fails_the_run_with_a_checkpoint_and_no_final_adapter(tmp_path):
    """A learner step that raises (a dead data-parallel rank, out of memory) ends the run as a
    failure: its error, a checkpoint of the steps before it, and no "final" adapter."""
    cfg = config(tmp_path, run={"max_steps": 50, "canary_every": 0})
    parts = FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.02)
    learner_step = parts.fake_learner.train_step

    def step_or_die(adapter, samples):
        if parts.fake_learner.version(adapter) == 3:
            raise TrainingError("learner rank 1 (pid 4242) died (killed by SIGKILL)")
        return learner_step(adapter, samples)

    parts.fake_learner.train_step = step_or_die
    with pytest.raises(TrainingError, match="rank 1 .* died"):
        run(cfg, parts)
    out = Path(cfg.run.output_dir)
    state = json.loads((out / "checkpoints" / (out / "checkpoints" / "LATEST").read_text() / "state.json").read_text())
    assert state["step"] == 3
    assert not (out / "adapters" / "main" / "final").exists()
    assert "died" in json.loads((out / "summary.json").read_text())["error"]


def test_sigterm_stops_after_the_step_in_order(tmp_path):
    cfg = config(tmp_path, run={"max_steps": 50, "checkpoint_every": 0})
    parts = FakeParts(["main"], gen_delay=lambda: 0.02, step_s=0.05)

    def terminate_at_step_3(run_):
        if run_.global_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    summary = run(cfg, parts, on_step=terminate_at_step_3)
    assert 3 <= summary["steps"] < 50 and "error" not in summary
    rows = steps(cfg)
    assert len(rows) == summary["steps"]  # every step trained has its metrics line
    events = parts.events
    last = f"main@v{summary['version']}"
    # the last version is published, then checkpointed, then the transport, the engine and the
    # learner (a data-parallel learner ends its ranks) close
    order = [events.index(f"publish {last}"), events.index(f"checkpoint {last}"),
             events.index("transport.close"), events.index("generator.close"), events.index("learner closed")]
    assert order == sorted(order)
    assert (Path(cfg.run.output_dir) / "adapters" / "main" / "final" / "adapter_config.json").is_file()


REWARDS = '''
def broken(prompt, completion, answer):
    return undefined_helper(completion)  # a bad name inside the reward
def half(completion):
    return 0.5
def skip_all(completions, **kwargs):  # batched, and scores nothing
    return [None] * len(completions)
'''


def test_a_reward_that_always_fails_stops_the_run_with_its_error(tmp_path, monkeypatch, capsys):
    (tmp_path / "broken_rewards.py").write_text(REWARDS)
    monkeypatch.chdir(tmp_path)  # user reward modules are imported from the working directory
    cfg = config(tmp_path, task={"reward": "broken_rewards:broken"}, run={"max_steps": 20})
    parts = FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.05)
    with pytest.raises(TrainingError, match="every reward call of the first step failed.*NameError"):
        run(cfg, parts)
    assert parts.fake_learner.trained == []  # nothing was trained on the zeros
    err = capsys.readouterr().err
    shown = [line for line in err.splitlines() if "the reward failed" in line]
    assert len(shown) == 1 and "NameError" in shown[0] and "undefined_helper" in shown[0]


def test_a_function_that_always_fails_beside_one_that_works_stops_the_run(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards.py").write_text(REWARDS)
    monkeypatch.chdir(tmp_path)
    cfg = config(tmp_path, task={"reward": ["regex:^x", "broken_rewards:broken"]}, run={"max_steps": 20})
    parts = FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.05)
    with pytest.raises(TrainingError, match="every reward call of the first step failed.*broken_rewards:broken.*NameError"):
        run(cfg, parts)
    assert parts.fake_learner.trained == []


def test_several_rewards_combine_by_weight_and_each_has_its_metric(tmp_path, monkeypatch, capsys):
    (tmp_path / "broken_rewards.py").write_text(REWARDS)
    monkeypatch.chdir(tmp_path)
    cfg = config(tmp_path, task={"reward": ["regex:^x", "broken_rewards:half", "broken_rewards:skip_all"],
                                 "reward_weights": [1.0, 2.0, 3.0]},
                 learner={"skip_flat_groups": False}, run={"max_steps": 3, "log_interval_s": 0})
    parts = FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.05)
    summary = run(cfg, parts)
    rows = steps(cfg)
    assert summary["reward_errors"] == 0 and len(rows) == 3
    for row in rows:
        assert row["reward/half"] == 0.5 and "reward/regex" in row
        assert "reward/skip_all" not in row  # it scored nothing: no mean, and nothing added to the sum
        assert row["reward_mean"] == pytest.approx(row["reward/regex"] + 2 * 0.5)
    # the user functions' calls are timed: one per sample (half), one per group (skip_all). A step
    # row holds the calls that ended within it; on a busy machine every call may end in another's.
    timed = [row for row in rows if "reward_wait_s_p50" in row]
    assert timed and all(0 <= row["reward_wait_s_p50"] <= row["reward_wait_s_p95"] for row in timed)
    assert summary["reward_wait_calls"] >= 3 * 8  # at least one per sample of every step
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert lines and all("half 0.50" in line and "(regex " in line for line in lines)


def test_without_flat_group_filtering_steps_take_groups_as_they_come(tmp_path):
    # Prompts with an even item number always score 0 in all samples (a flat group).
    def reply(request, rng):
        flat = int(bytes(request.prompt_ids).decode().split()[-1]) % 2 == 0  # "item N\n"
        return "yabc" if flat else ("x" if rng.random() < 0.5 else "y") + "abc"

    figures = {}
    for skip in (True, False):
        (tmp_path / str(skip)).mkdir()
        cfg = config(tmp_path / str(skip), learner={"groups_per_step": 2, "skip_flat_groups": skip})
        run(cfg, FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.05, reply=reply))
        rows = steps(cfg)
        figures[skip] = (sum(r["flat_groups_trained"] for r in rows), rows[-1]["zero_adv_groups"])
    trained_flat, skipped = figures[True]
    assert trained_flat == 0 and skipped > 0  # filtering: flat groups are skipped and counted
    trained_flat, skipped = figures[False]
    assert trained_flat > 0 and skipped == 0  # without: they are trained on, nothing is skipped


def test_save_every_keeps_stamped_snapshots_and_the_start_row_says_how_long_startup_took(tmp_path):
    cfg = config(tmp_path, run={"max_steps": 6, "save_every": 2})
    run(cfg, FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.05))
    out = Path(cfg.run.output_dir)
    infos = sorted((json.loads(p.read_text()) for p in (out / "adapters" / "main").glob("v*/lora_async.json")),
                   key=lambda i: i["step"])
    # v6 is also the final adapter (saved again at the end, stamped then)
    assert [i["step"] for i in infos] == [0, 2, 4, 6]
    assert [i["version"] for i in infos] == [0, 2, 4, 6]
    snaps = [i for i in infos if i.get("snapshot")]
    assert [i["step"] for i in snaps] == [0, 2, 4]
    # stamped with the training clock of the step that made the version
    clock = {r["step"]: r["wall_s"] for r in steps(cfg)}
    assert all(i["wall_s"] == pytest.approx(clock[i["step"]], abs=1e-3) for i in snaps[1:])
    start = [r for r in read_metrics(out / "metrics.jsonl") if r.get("kind") == "start"]
    assert len(start) == 1 and start[0]["startup_s"] > 0 and start[0]["resumed"] is False


def test_producers_are_shared_by_weight():
    assert producer_quota({"a": 2.0, "b": 1.0, "c": 1.0}, 8) == {"a": 4, "b": 2, "c": 2}
    assert producer_quota({"a": 1.0, "b": 1.0}, 7) == {"a": 4, "b": 4}  # rounded, each
    assert producer_quota({"big": 100.0, "small": 1.0}, 4) == {"big": 4, "small": 1}  # at least one each


def producers(names) -> dict[str, int]:
    """Live producer tasks per adapter (start_producers names them)."""
    tasks = [t.get_name().split() for t in asyncio.all_tasks() if t.get_name().startswith(PRODUCER)]
    return {name: sum(1 for _, owner in tasks if owner == name) for name in names}


def test_a_fleet_shares_generation_by_weight(tmp_path):
    """Weight 2 against weight 1, generation the bottleneck (the learner is fast, the window wide):
    the first adapter runs twice the producers, so it starts about twice the groups and takes
    about twice the steps in the same time."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"item {i}", "answer": "-"}) for i in range(50)))
    task = {"type": "jsonl", "path": str(data), "reward": "regex:^x", "heldout": 4}
    cfg = TrainConfig.model_validate({
        "adapters": [{"name": "heavy", "weight": 2.0, "task": task}, {"name": "light", "weight": 1.0, "task": task}],
        "sampling": {"samples_per_prompt": 4, "max_new_tokens": 8}, "generator": {"groups_in_flight": 6},
        "learner": {"groups_per_step": 2}, "buffer": {"mode": "async", "max_staleness": 8},
        "run": {"max_steps": 1000, "time_budget_s": 2.0, "output_dir": str(tmp_path / "out"), "progress": False,
                "canary_every": 0, "chart_every": 0}})
    seen: dict = {}

    def watch(run_):
        seen["run"] = run_
        seen.setdefault("producers", producers(run_.adapters))

    summary = run(cfg, FakeParts(["heavy", "light"], gen_delay=lambda: 0.1, step_s=0.01), on_step=watch)
    assert seen["producers"] == {"heavy": 4, "light": 2}
    started = {name: a.counters.groups_started for name, a in seen["run"].adapters.items()}
    assert 1.5 <= started["heavy"] / started["light"] <= 2.6, started
    tokens = {name: summary[f"{name}.tokens_generated"] for name in ("heavy", "light")}
    assert 1.5 <= tokens["heavy"] / tokens["light"] <= 2.6, tokens
    rows = steps(cfg)
    taken = {name: len([r for r in rows if r["adapter"] == name]) for name in ("heavy", "light")}
    assert 1.4 <= taken["heavy"] / taken["light"] <= 2.8, taken
    # each adapter's step lines count its own tokens, within its own total
    for name in ("heavy", "light"):
        assert 0 < sum(r["tokens_generated"] for r in rows if r["adapter"] == name) <= tokens[name]


SPLIT_KEYS = ("step_s", "gen_compute_s", "gen_idle_s", "gen_idle_admission_s", "gen_idle_reward_s", "gen_idle_tool_s",
              "gen_idle_env_s", "gen_idle_other_s", "learner_s", "learner_wait_s")
IDLE_PARTS = ("gen_idle_admission_s", "gen_idle_reward_s", "gen_idle_tool_s", "gen_idle_env_s", "gen_idle_other_s")


@pytest.mark.parametrize("staleness", [0, 1])
def test_every_step_and_the_summary_say_where_the_time_went(tmp_path, staleness):
    """Structure and consistency, not speed: each step's generator compute and idle time make its
    interval, the idle causes make the idle time; the run's totals likewise, and the learner's
    compute, wait and rest make the training time."""
    cfg = config(tmp_path, buffer={"mode": "async" if staleness else "sync", "max_staleness": staleness})
    summary = run(cfg, FakeParts(["main"], gen_delay=lambda: 0.02, step_s=0.15))
    rows = steps(cfg)
    assert len(rows) == 8
    for r in rows:
        assert set(SPLIT_KEYS) <= set(r), set(SPLIT_KEYS) - set(r)
        assert all(r[key] >= 0 for key in SPLIT_KEYS)
        assert r["gen_compute_s"] + r["gen_idle_s"] == pytest.approx(r["step_s"], abs=1e-3)
        assert sum(r[key] for key in IDLE_PARTS) == pytest.approx(r["gen_idle_s"], abs=1e-3)
    assert summary["gen_compute_s"] + summary["gen_idle_s"] == pytest.approx(summary["training_s"], abs=1e-3)
    assert sum(summary[key] for key in IDLE_PARTS) == pytest.approx(summary["gen_idle_s"], abs=1e-3)
    learner = summary["learner_compute_s"] + summary["learner_wait_s"] + summary["learner_other_s"]
    assert learner == pytest.approx(summary["training_s"], abs=1e-3)
    assert summary["learner_compute_s"] == pytest.approx(8 * 0.15)  # the fake learner's steps
    assert summary["learner_wait_s"] == pytest.approx(sum(r["learner_wait_s"] for r in rows), abs=1e-3)
    if staleness == 0:
        # synchronous: while the learner trains, producers are held back by admission and
        # nothing generates, so the generator's idle time has that cause
        assert summary["gen_idle_admission_s"] > 0
    written = json.loads((Path(cfg.run.output_dir) / "summary.json").read_text())
    assert written["training_s"] == summary["training_s"]
