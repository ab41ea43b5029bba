"""`lora-async bench staleness` for real on the tiny model: arms on one engine and one learner,
each at its lag, scored off the clock, kept on a rerun."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from lora_async.config import load_config
from lora_async.metrics import read_metrics

from .test_train import make_config

pytestmark = pytest.mark.slow


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the reward module is imported from the working directory
    return tmp_path


def test_arms_train_at_their_lag_on_one_engine_and_are_scored_and_kept(in_tmp, tiny_model):
    from lora_async.bench.staleness import run_staleness_bench

    config = make_config(in_tmp, tiny_model, "base", learner={"groups_per_step": 2, "lr": 2e-3,
                                                              "skip_flat_groups": False})
    cfg = load_config(config)
    lines: list[str] = []
    result = run_staleness_bench(cfg, ["ppo-clip", "m2po+ess"], [0, 2], [0], steps=4, target=0.3,
                                 out=in_tmp / "st", log=lines.append)
    assert sum("training 4 steps" in line for line in lines) == 4  # one engine start, four arms
    for name, arm in result["arms"].items():
        rows = [r for r in read_metrics(in_tmp / "st" / name / "metrics.jsonl") if "kind" not in r]
        assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["adapter"] == name for r in rows)
        lag = 2 if "-k2-" in name else 0
        # lag 2: the first two steps train on version 0 (lags 0 and 1), then every sample is 2 behind
        assert [r["policy_lag_max"] for r in rows] == ([0, 1, 2, 2] if lag else [0, 0, 0, 0])
        assert all(r["policy_lag_mean"] == lag and f"lag{lag}/tokens" in r for r in rows[2:])
        if name.startswith("m2po-ess"):
            assert all(r["lr_scale"] < 1.0 for r in rows[2:])  # stale sequences weigh unevenly
        else:
            assert all(r["lr_scale"] == 1.0 for r in rows)
        # every snapshot (steps 0..4) was scored after the arms, on the held-out problems
        assert [step for step, _ in arm["curve"]] == [0, 1, 2, 3, 4] and arm["heldout_n"] == 4
    curves = [arm["curve"] for arm in result["arms"].values()]
    assert len({curve[0] for curve in curves}) == 1  # every arm starts from the same weights
    assert (in_tmp / "st" / "staleness.png").stat().st_size > 10_000
    assert set(result["table"]) == {"ppo-clip", "m2po+ess"} and set(result["table"]["m2po+ess"]) == {"0", "2"}
    # the same command again keeps every arm and every score
    lines.clear()
    again = run_staleness_bench(cfg, ["ppo-clip", "m2po+ess"], [0, 2], [0], steps=4, target=0.3,
                                out=in_tmp / "st", log=lines.append)
    assert sum("kept" in line for line in lines) == 4 and not any("training" in line or "scoring" in line
                                                                 for line in lines)
    assert again["table"] == result["table"]
    # `lora-async compare` reads the bench's own output: one column per arm, the same curves
    from lora_async.cli import app

    shown = CliRunner().invoke(app, ["compare", str(in_tmp / "st"), "--plot", str(in_tmp / "compare.png")])
    assert shown.exit_code == 0, shown.output
    assert all(name in shown.output for name in result["arms"]) and "loss.type" in shown.output
    assert (in_tmp / "compare.png").stat().st_size > 10_000
    figures = CliRunner().invoke(app, ["compare", str(in_tmp / "st"), "--json"])
    by_arm = {f["run"]: f for f in json.loads(figures.output)}
    assert set(by_arm) == set(result["arms"])
    for name, arm in result["arms"].items():
        assert by_arm[name]["steps"] == 4 and by_arm[name]["accuracy_final"] == arm["curve"][-1][1]


def test_the_cli_refuses_unknown_losses_and_bad_lags_in_one_line(in_tmp, tiny_model):
    from lora_async.cli import app

    config = make_config(in_tmp, tiny_model, "base")
    done = CliRunner().invoke(app, ["bench", "staleness", str(config), "--losses", "ppo-clip,grpo"])
    assert done.exit_code == 2 and "unknown grpo" in done.output and "Traceback" not in done.output
    done = CliRunner().invoke(app, ["bench", "staleness", str(config), "--lags", "0,x"])
    assert done.exit_code == 2 and "--lags" in done.output and "Traceback" not in done.output


def test_an_arm_that_fails_stops_the_bench_in_one_line(in_tmp, tiny_model):
    from lora_async.bench.staleness import BenchError, run_staleness_bench

    (in_tmp / "broken_rewards.py").write_text("def boom(prompt, completion, answer):\n    raise ValueError('boom')\n")
    config = make_config(in_tmp, tiny_model, "base", task={"reward": "broken_rewards:boom"})
    with pytest.raises(BenchError) as failed:
        run_staleness_bench(load_config(config), ["ppo-clip"], [0, 2], [0], steps=2, target=0.3,
                            out=in_tmp / "st", log=lambda line: None)
    message = str(failed.value)
    assert "ppo-clip-k0-s0 failed" in message and "boom" in message and "\n" not in message
    assert not (in_tmp / "st" / "ppo-clip-k2-s0").exists()  # nothing ran after it
