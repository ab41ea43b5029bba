"""End-to-end runs of the built-in environments through the real CLI and the vLLM engine:
a few steps on the tiny model (plumbing), and on the real default model (learning, `long`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lora_async.metrics import read_metrics

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent


def run_cli(args: list[str]):
    from typer.testing import CliRunner

    from lora_async.cli import app

    return CliRunner().invoke(app, args)


@pytest.mark.parametrize("example", ["calculator", "guess"])
def test_a_builtin_environment_trains_a_few_steps_on_the_tiny_model(tmp_path, tiny_model, example):
    out = tmp_path / example
    result = run_cli(["train", str(REPO / "examples" / f"{example}.toml"),
                      "--set", f"model.name={tiny_model}", "--set", "generator.kv_cache_gb=0.25",
                      "--set", "run.max_steps=2", "--set", f"run.output_dir={out}", "--set", "run.time_budget_s=600",
                      "--set", "task.heldout=4", "--set", "sampling.samples_per_prompt=4",
                      "--set", "learner.groups_per_step=2", "--set", "run.eval_every=0", "--set", "run.progress=false"])
    assert result.exit_code == 0, result.output
    rows = read_metrics(out / "metrics.jsonl")
    steps = [r for r in rows if "kind" not in r]
    evals = [r for r in rows if r.get("kind") == "eval"]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["episodes"] >= 8 and r["turns_mean"] >= 1 and "version_span_max" in r for r in steps)
    assert [e["when"] for e in evals] == ["start", "end"] and all(e["n"] == 4 and e["turns_mean"] >= 1 for e in evals)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["episodes"] >= 16 and summary["env_errors"] == 0
    assert (out / "adapters" / "main" / "final" / "adapter_config.json").is_file()
    if example == "calculator":  # the tool is described in the opening: the fallback tool prompt
        assert "calculate" in result.output
    # `lora-async eval` scores an env config: success, turns and tool calls, base and adapter
    scored = run_cli(["eval", str(REPO / "examples" / f"{example}.toml"), "--set", f"model.name={tiny_model}",
                      "--set", "generator.kv_cache_gb=0.25", "--adapter", str(out / "adapters" / "main" / "final"),
                      "--limit", "3", "--json"])
    assert scored.exit_code == 0, scored.output
    report = json.loads(scored.output[scored.output.index("{"):])
    assert [r["model"] for r in report["results"]][0] == "base" and len(report["results"]) == 2
    assert all(r["n"] == 3 and "turns_mean" in r and "tool_call_rate" in r for r in report["results"])


@pytest.mark.long
def test_guess_reward_rises_on_the_real_model(tmp_path):
    """The embedded SmolLM2-135M on the guessing game for 8 minutes: the policy's reward in the
    last steps beats the first steps' (the held-out figures are in bench/RESULTS.md)."""
    out = tmp_path / "guess"
    result = run_cli(["train", str(REPO / "examples" / "guess.toml"), "--set", f"run.output_dir={out}",
                      "--set", "run.time_budget_s=480", "--set", "run.eval_every=0", "--set", "task.heldout=32",
                      "--set", "run.progress=false"])
    assert result.exit_code == 0, result.output
    steps = [r for r in read_metrics(out / "metrics.jsonl") if "kind" not in r]
    assert len(steps) >= 6
    third = max(2, len(steps) // 3)
    first = sum(r["reward_mean"] for r in steps[:third]) / third
    last = sum(r["reward_mean"] for r in steps[-third:]) / third
    assert last > first + 0.05, (first, last)
