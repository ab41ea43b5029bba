"""`lora-async bench staleness` without an engine: the arms and their configs, what is kept on a
rerun, and the report (steps to the target, collapses, spreads over seeds, the chart) read from
hand-written runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lora_async.bench.common import finished
from lora_async.bench.staleness import Arm, BenchError, arm_config, arms_of, check_base, parse_losses
from lora_async.bench.staleness_report import chart, collapsed, markdown, paired_ratios, report, spread
from lora_async.config import TrainConfig, dump_config


def base(**sections: dict) -> TrainConfig:
    data = {"loss": {"type": "cispo", "eps_high": 2.0, "kl_coef": 0.01}, "run": {"output_dir": "x"}}
    data.update(sections)
    return TrainConfig.model_validate(data)


def test_losses_parse_with_the_ess_suffix_and_unknown_ones_are_one_line():
    assert parse_losses("ppo-clip, m2po+ess") == ["ppo-clip", "m2po+ess"]
    with pytest.raises(BenchError, match="unknown grpo"):
        parse_losses("ppo-clip,grpo")
    arm = Arm("m2po+ess", 2, 1)
    assert (arm.loss_type, arm.lr_scale, arm.name) == ("m2po", "ess", "m2po-ess-k2-s1")


def test_arms_go_seed_by_seed():
    arms = arms_of(["a", "b"], [0, 2], [0, 1])
    assert [a.seed for a in arms] == [0] * 4 + [1] * 4
    assert arms[:4] == [Arm("a", 0, 0), Arm("a", 2, 0), Arm("b", 0, 0), Arm("b", 2, 0)]


def test_an_arm_is_sync_at_lag_0_and_held_back_above(tmp_path):
    sync = arm_config(base(), Arm("ppo-clip", 0, 3), 12, 2, tmp_path)
    assert (sync.buffer.mode, sync.buffer.max_staleness, sync.buffer.fixed_lag) == ("sync", 0, None)
    held = arm_config(base(), Arm("ppo-clip", 4, 3), 12, 2, tmp_path)
    assert (held.buffer.mode, held.buffer.max_staleness, held.buffer.fixed_lag) == ("async", 4, 4)
    assert not held.buffer.partial_rollouts and not held.buffer.concurrent_from_start  # the halves take turns
    for cfg in (sync, held):
        assert cfg.run.seed == 3 and cfg.run.max_steps == 12 and cfg.run.save_every == 2
        assert cfg.run.time_budget_s is None and cfg.run.eval_every == 0 and not cfg.run.eval_at_start
        assert cfg.adapter.name == cfg.adapter_names[0] and Path(cfg.run.output_dir).parent == tmp_path


def test_an_arm_keeps_the_base_loss_settings_only_for_the_base_loss_type(tmp_path):
    same = arm_config(base(), Arm("cispo", 2, 0), 4, 1, tmp_path)
    assert same.loss.type == "cispo" and same.loss.eps_high == 2.0 and same.loss.kl_coef == 0.01  # type: ignore[union-attr]
    other = arm_config(base(), Arm("m2po+ess", 2, 0), 4, 1, tmp_path)
    assert other.loss.type == "m2po" and other.loss.tau == 0.04 and other.loss.kl_coef == 0.01  # type: ignore[union-attr]
    assert other.learner.lr_scale == "ess" and same.learner.lr_scale == "none"


def test_the_base_config_must_be_one_adapter_on_an_engine_here():
    with pytest.raises(BenchError, match="generator"):
        check_base(base(generator={"type": "server", "urls": ["http://127.0.0.1:1"]}))


def test_a_finished_arm_is_kept_only_with_the_same_config(tmp_path):
    cfg = arm_config(base(), Arm("topr", 2, 0), 4, 1, tmp_path)
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True)
    (out / "config.json").write_text(dump_config(cfg))
    assert not finished(cfg)  # no summary yet
    (out / "summary.json").write_text(json.dumps({"ended": "failed"}))
    assert not finished(cfg)
    (out / "summary.json").write_text(json.dumps({"ended": "done"}))
    assert finished(cfg)
    assert not finished(arm_config(base(), Arm("topr", 2, 0), 5, 1, tmp_path))  # more steps: rerun


def test_a_collapse_is_a_drop_from_the_best_so_far_within_twice_the_steps_to_target():
    assert not collapsed([(0, 0.1), (2, 0.5), (4, 0.6), (6, 0.55)], 4)
    assert collapsed([(0, 0.1), (2, 0.5), (4, 0.7), (6, 0.45)], 4)
    assert not collapsed([(0, 0.1), (2, 0.5), (4, 0.7), (10, 0.1)], 4)  # after 2 x 4 steps: not counted
    assert collapsed([(0, 0.4), (2, 0.1)], None)  # never reached: the whole curve counts


def test_a_spread_counts_an_arm_that_never_reached_the_target_as_infinitely_late():
    assert spread([8, 10, 12]) == {"median": 10, "min": 8, "max": 12, "reached": "3/3"}
    assert spread([8, None, 12]) == {"median": 12, "min": 8, "max": None, "reached": "2/3"}
    assert spread([8, None, None])["median"] is None


def write_arm(out: Path, arm: Arm, curve: list[float], clip: float) -> None:
    """An arm's run as the trainer writes it: step rows, the snapshots' eval rows, the summary."""
    run = out / arm.name
    run.mkdir(parents=True)
    rows = [{"step": s, "wall_s": 10.0 * s, "tokens_trained": 100, "policy_lag_mean": float(arm.lag),
             "clip_frac": clip, "ess_frac": 0.9, "lr_scale": 1.0} for s in range(1, len(curve))]
    rows += [{"kind": "eval", "step": s, "wall_s": 10.0 * s, "accuracy": a, "n": 100} for s, a in enumerate(curve)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"ended": "done", f"lag{min(arm.lag, 3)}/clip_frac": clip}))


def test_the_report_sets_each_loss_and_lag_side_by_side_over_seeds(tmp_path):
    curves = {  # accuracy after steps 0..6: ppo-clip slows down with lag, m2po does not
        ("ppo-clip", 0): [0.1, 0.3, 0.5, 0.6, 0.7, 0.7, 0.7], ("ppo-clip", 2): [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7],
        ("m2po", 0): [0.1, 0.3, 0.5, 0.6, 0.7, 0.7, 0.7], ("m2po", 2): [0.1, 0.3, 0.5, 0.6, 0.7, 0.7, 0.7],
    }
    arms = arms_of(["ppo-clip", "m2po"], [0, 2], [0, 1])
    for arm in arms:
        shift = 0.0 if arm.seed == 0 else -0.1  # seed 1 is a step behind at every point
        write_arm(tmp_path, arm, [max(0.0, a + shift) for a in curves[(arm.loss, arm.lag)]], 0.05 * arm.lag)
    result = report(arms, [tmp_path / a.name for a in arms], target=0.6)
    ppo, m2po = result["table"]["ppo-clip"], result["table"]["m2po"]
    assert ppo["0"]["steps_to_target"] == {"median": 3.5, "min": 3, "max": 4, "reached": "2/2"}
    assert ppo["2"]["steps_to_target"]["median"] == 5.5 and ppo["2"]["steps_over_k0"] == pytest.approx(5.5 / 3.5)
    assert m2po["2"]["steps_over_k0"] == 1.0
    # seed by seed: 5/3 and 6/4 (each seed against its own sync arm)
    assert ppo["2"]["paired_over_k0"] == {"median": pytest.approx(19 / 12), "min": 1.5, "max": pytest.approx(5 / 3),
                                          "reached": "2/2"}
    assert paired_ratios({(0, 0): 4, (2, 0): None, (0, 1): None, (2, 1): 6}, 2, 0, [0, 1]) == \
        {"median": None, "min": None, "max": None, "reached": "0/1"}  # never reached at k = 2: infinitely late
    assert ppo["2"]["time_to_target_s"]["median"] == 55.0
    assert ppo["2"]["clip_frac_mean"] == pytest.approx(0.1) and ppo["2"]["by_lag"] == {"lag2/clip_frac": 0.1}
    arm = result["arms"]["ppo-clip-k2-s0"]
    assert arm["trained_tokens_per_s"] == pytest.approx(10.0)  # up to the target: 5 steps x 100 tokens in 50 s
    assert not arm["collapsed"] and arm["accuracy_max"] == 0.7
    table = markdown(result)
    assert "| ppo-clip | 3.5 (3-4, 2/2) | 5.5 (5-6, 2/2) | 1.57x; paired 1.58 (1.50-1.67) |" in table
    png = chart(result, tmp_path / "chart.png")
    assert png.stat().st_size > 10_000


def test_the_plot_draws_the_clipped_share_of_each_lag_bucket(tmp_path):
    from lora_async.plot import lag_series, plot_runs

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "adapter": "main", "wall_s": 5.0 * s, "reward_mean": 0.1 * s, "lag0/clip_frac": 0.01,
             **({"lag2/clip_frac": 0.2 + 0.01 * s} if s > 2 else {})} for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    series = lag_series(rows)
    assert list(series) == ["lag0", "lag2"] and series["lag2"][0] == [15.0, 20.0, 25.0]
    assert series["lag2"][1] == pytest.approx([0.23, 0.24, 0.25])
    png = plot_runs([run], tmp_path / "chart.png")
    assert png.stat().st_size > 10_000
    assert lag_series([{"step": 1, "wall_s": 1.0}]) == {}  # an older run: no panel
