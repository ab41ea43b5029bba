"""Self-play through the real CLI and the vLLM engine on a tiny model: Nim against a league of
past versions kept registered in one engine, held-out win rates, a killed run resumed with the
same pool and the same ratings, and `lora-async eval` on a saved adapter."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lora_async.league import League, league_line
from lora_async.metrics import read_metrics

from .helpers import WHOLE_RUN_TIMEOUT_S, wait_for_run
from .test_env_train import REPO, run_cli, two_steps_of

pytestmark = pytest.mark.slow

NIM = REPO / "examples" / "nim.toml"
LEAGUE = ("task.league.every=1", "task.league.size=2", "run.checkpoint_every=2", "task.max_turns=3")
# A tiny random model loses every Nim game alike (it never writes a move): no group has signal and
# no step makes a version. Coin's games are won and lost by what the replies say, so every step
# makes one, and the league keeps them.
COIN = "task.env=tests.coin_game:make"


def settings(model: Path, out: Path, steps: int) -> list[str]:
    """`--set` arguments of a small Coin run against a league (as `two_steps_of` sets them)."""
    pairs = [f"model.name={model}", "generator.kv_cache_gb=0.25", f"run.max_steps={steps}", f"run.output_dir={out}",
             "run.time_budget_s=600", "task.heldout=4", "sampling.samples_per_prompt=4", "learner.groups_per_step=2",
             "run.eval_every=0", "run.progress=false", COIN, *LEAGUE]
    return [arg for pair in pairs for arg in ("--set", pair)]


def test_nim_against_a_league_of_past_versions(tmp_path, tiny_model):
    """Nim's openings through the real chat template, its scripted players, the held-out games
    against each opponent, and `lora-async eval`."""
    out = tmp_path / "nim"
    steps, evals, summary = two_steps_of(NIM, tiny_model, out, *LEAGUE)
    assert all(r["league_size"] >= 1 and "league_elo" in r for r in steps)
    assert summary["league"]["anchor"] == 0 and summary["league"]["games"] >= 16
    for e in evals:  # against its step-0 version and each scripted player, every game counted once
        for opponent in ("self_v0", "random", "expert", "optimal"):
            rates = [e[f"vs_{opponent}/{r}"] for r in ("win", "draw", "loss")]
            assert sum(rates) == pytest.approx(1.0)
        assert e["accuracy"] == e["vs_self_v0/win"]
    assert (out / "checkpoints" / "step-000002" / "frozen" / "main@v0.safetensors").is_file()
    # a saved adapter scored on its own: the opponents that need no version of the run
    scored = run_cli(["eval", str(NIM), "--set", f"model.name={tiny_model}", "--set", "generator.kv_cache_gb=0.25",
                      "--adapter", str(out / "adapters" / "main" / "final"), "--limit", "2", "--json"])
    assert scored.exit_code == 0, scored.output
    report = json.loads(scored.output[scored.output.index("{"):])
    for result in report["results"]:
        assert "vs_random/win" in result and "vs_self_v0/win" not in result, {k: v for k, v in result.items() if k != "examples"}


def test_a_league_keeps_a_version_a_step_in_one_engine(tmp_path, tiny_model):
    out = tmp_path / "coin"
    steps, evals, summary = two_steps_of(NIM, tiny_model, out, COIN, *LEAGUE)
    assert [r["version"] for r in steps] == [1, 2]  # every step made a version
    league = summary["league"]
    assert [m["version"] for m in league["members"]] == [0, 1, 2] and league["anchor"] == 0
    assert [m["in_pool"] for m in league["members"]] == [False, True, True]
    assert league["games"] >= 16 and sum(m["games"] for m in league["members"]) == league["games"]
    frozen = sorted(p.name for p in (out / "checkpoints" / "step-000002" / "frozen").iterdir())
    assert frozen == ["main@v0.safetensors", "main@v1.safetensors", "main@v2.safetensors"]
    assert all(e["accuracy"] == e["vs_self_v0/win"] for e in evals)


def test_a_killed_league_run_resumes_with_the_same_pool_and_ratings(tmp_path, tiny_model):
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "lora_async", "train", str(NIM)]
    proc = subprocess.Popen(cmd + settings(tiny_model, out, 8), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)

    def past_the_checkpoint() -> bool:
        """Step 3 trained: past the checkpoint of step 2, whose league the resume must take."""
        path = out / "metrics.jsonl"
        return path.is_file() and any(r.get("step") == 3 and "kind" not in r for r in read_metrics(path))

    try:
        wait_for_run(proc, past_the_checkpoint, "step 3")
    finally:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    checkpoint = out / "checkpoints" / "step-000002"
    saved = json.loads((checkpoint / "state.json").read_text())["leagues"]["main"]
    done = subprocess.run(cmd + ["--resume"] + settings(tiny_model, out, 4), cwd=REPO, capture_output=True,
                          text=True, timeout=WHOLE_RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    # the same pool and the same ratings, as the checkpoint holds them, before any game is played
    said = " ".join((done.stdout + done.stderr).split())
    assert f"main: league as checkpointed: {league_line(League.from_state(saved).summary())}" in said, said[-3000:]
    after = json.loads((out / "summary.json").read_text())["league"]
    assert [m["version"] for m in after["members"]] == [0, 1, 2, 3, 4] and after["anchor"] == 0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "kind" not in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[2]["league_games"] > rows[1]["league_games"]
