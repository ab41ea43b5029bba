"""Lag's cost in steps (`lora_async/lag_cost.py`): the built-in table is what the staleness
benchmark's reports say, and a user's own report replaces it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lora_async import lag_cost
from lora_async.config import ConfigError, load_config

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results" / "staleness"


def test_the_builtin_table_is_the_benchmarks_medians():
    # recomputed from the 3-seed reports: an edit of either without the other fails here
    assert lag_cost.from_reports([RESULTS / name for name in lag_cost.REPORTS]) == lag_cost.BUILTIN


def test_ratios_between_and_beyond_the_measured_lags():
    costs = lag_cost.LagCosts("x", {0: 1.0, 2: 1.2, 4: 1.6}, "test")
    assert costs.at(0) == 1.0 and costs.at(2) == 1.2 and costs.at(4) == 1.6
    assert costs.at(1) == pytest.approx(1.1) and costs.at(3) == pytest.approx(1.4)
    assert costs.at(6) == pytest.approx(2.0)  # along the last slope
    # a larger lag never costs less than a smaller one, and lag never helps
    dipping = lag_cost.LagCosts("y", {0: 1.0, 2: 1.15, 4: 1.03}, "test")
    assert dipping.at(4) == 1.15 and dipping.at(3) == 1.15
    assert lag_cost.LagCosts("z", {0: 1.0, 2: 0.9}, "test").at(2) == 1.0


def test_a_loss_without_three_seed_figures_takes_the_most_lag_sensitive_measured():
    costs = lag_cost.builtin("cispo")
    assert costs.ratios == lag_cost.BUILTIN["ppo-clip"] and "not measured" in costs.source


def test_a_users_report_replaces_the_table(tmp_path):
    report = tmp_path / "mine.json"
    report.write_text(json.dumps({"table": {"m2po": {"0": {"steps_over_k0": 1.0, "seeds": 3},
                                                     "2": {"steps_over_k0": 1.5, "seeds": 3}}}}))
    config = tmp_path / "c.toml"
    config.write_text(f'[buffer]\nlag_costs = "{report}"\n')
    loaded = load_config(config)
    costs = lag_cost.load(loaded.buffer.lag_costs, loaded.loss.type)
    assert costs.at(2) == 1.5 and costs.at(1) == 1.25 and "mine.json" in costs.source


@pytest.mark.parametrize("content, words", [
    (None, "cannot read"),
    ("not json", "cannot read"),
    (json.dumps({"table": {"ppo-clip": {"0": {"steps_over_k0": 1.0}, "2": {"steps_over_k0": 1.2}}}}),
     "no steps-to-target at lag 0 and another lag for loss.type = 'm2po'"),
])
def test_a_bad_report_is_a_one_line_config_error(tmp_path, content, words):
    report = tmp_path / "report.json"
    if content is not None:
        report.write_text(content)
    config = tmp_path / "c.toml"
    config.write_text(f'[buffer]\nlag_costs = "{report}"\n')
    with pytest.raises(ConfigError, match="buffer.lag_costs") as caught:
        load_config(config)
    assert words in str(caught.value) and "\n" not in str(caught.value)
