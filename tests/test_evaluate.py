"""`lora-async eval` on a fleet config: whose task it scores (it used to score the default task)."""

from pathlib import Path

import pytest

from lora_async.config import load_config
from lora_async.evaluate import eval_specs

from .conftest import REPO


def test_eval_on_a_fleet_scores_the_named_adapters_task(tmp_path):
    config = load_config(REPO / "examples" / "fleet.toml")
    names = [spec.name for spec in config.adapter_specs]
    assert names == ["add", "sub", "shout"]
    # the base model alone: every adapter's task
    assert [s.name for s in eval_specs(config, None, None)] == names
    # an adapter from a run's store: its own task, found from the directory it lives in
    stored = tmp_path / "runs" / "fleet" / "adapters" / "sub" / "final"
    (specs,) = [eval_specs(config, None, stored)]
    assert [s.name for s in specs] == ["sub"] and specs[0].task.ops == ["-"]
    # or named explicitly
    assert [s.name for s in eval_specs(config, "shout", tmp_path / "elsewhere")] == ["shout"]
    with pytest.raises(ValueError, match="say whose task"):
        eval_specs(config, None, tmp_path / "elsewhere" / "final")
    with pytest.raises(ValueError, match="no adapter of that name"):
        eval_specs(config, "mul", None)


def test_eval_on_a_single_adapter_config_scores_its_task():
    config = load_config(REPO / "examples" / "arithmetic.toml")
    (spec,) = eval_specs(config, None, Path("/any/adapter"))
    assert spec.name == "main" and spec.task.system_prompt == "Answer with only the final number."
