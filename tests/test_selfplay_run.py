"""Self-play through the real CLI and the vLLM engine on a tiny model: Nim against a league of
past versions kept registered in one engine, held-out win rates, a resumed run that publishes its
kept versions again, and `lora-async eval` on a saved adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lora_async.metrics import read_metrics

from .test_env_train import REPO, run_cli, two_steps_of

pytestmark = pytest.mark.slow

NIM = REPO / "examples" / "nim.toml"
LEAGUE = ("task.league.every=1", "task.league.size=2", "run.checkpoint_every=2", "task.max_turns=3")


def test_nim_against_a_league_of_past_versions_and_resumed(tmp_path, tiny_model):
    out = tmp_path / "nim"
    steps, evals, summary = two_steps_of(NIM, tiny_model, out, *LEAGUE)
    assert all(r["league_size"] >= 1 and "league_elo" in r for r in steps)
    league = summary["league"]
    assert [m["version"] for m in league["members"]] == [0, 1, 2] and league["anchor"] == 0
    assert league["games"] >= 8  # the second step's games drew v0 or v1
    for e in evals:  # against its step-0 version and each scripted player, every game counted once
        for opponent in ("self_v0", "random", "expert", "optimal"):
            rates = [e[f"vs_{opponent}/{r}"] for r in ("win", "draw", "loss")]
            assert sum(rates) == pytest.approx(1.0)
        assert e["accuracy"] == e["vs_self_v0/win"]
    frozen = sorted(p.name for p in (out / "checkpoints" / "step-000002" / "frozen").iterdir())
    assert frozen == ["main@v0.safetensors", "main@v1.safetensors", "main@v2.safetensors"]

    resumed = run_cli(["train", str(NIM), "--resume", "--set", f"model.name={tiny_model}",
                       "--set", "generator.kv_cache_gb=0.25", "--set", "run.max_steps=3", "--set", f"run.output_dir={out}",
                       "--set", "task.heldout=4", "--set", "sampling.samples_per_prompt=4", "--set", "run.eval_every=0",
                       "--set", "learner.groups_per_step=2", "--set", "run.progress=false",
                       *[arg for setting in LEAGUE for arg in ("--set", setting)]])
    assert resumed.exit_code == 0, resumed.output
    after = json.loads((out / "summary.json").read_text())["league"]
    # the pool went on from where the checkpoint left it: the members it held, then v3
    assert [m["version"] for m in after["members"]] == [0, 1, 2, 3] and after["anchor"] == 0
    assert [m for m in after["members"] if m["version"] == 0][0]["elo"] == league["members"][0]["elo"]
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "kind" not in r]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["league_games"] > rows[1]["league_games"]

    # a saved adapter scored on its own: the opponents that need no version of the run
    scored = run_cli(["eval", str(NIM), "--set", f"model.name={tiny_model}", "--set", "generator.kv_cache_gb=0.25",
                      "--adapter", str(out / "adapters" / "main" / "final"), "--limit", "2", "--json"])
    assert scored.exit_code == 0, scored.output
    report = json.loads(scored.output[scored.output.index("{"):])
    for result in report["results"]:
        assert "vs_random/win" in result and "vs_self_v0/win" not in result
