"""End-to-end runs of the real trainer on the tiny model: CLI, learning, faults, resume."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lora_async.config import load_config
from lora_async.metrics import STEP_KEYS, read_metrics

from .helpers import WHOLE_RUN_TIMEOUT_S, wait_for_run

pytestmark = pytest.mark.slow

REWARDS = '''
def vowels(prompt, completion, answer):
    """Share of letters that are vowels: a smooth reward the random tiny model can climb."""
    letters = [c for c in completion.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0
'''

PROMPTS_JSONL = "\n".join(json.dumps({"prompt": f"Say something about item {i}.", "answer": "-"})
                          for i in range(40))


def make_config(tmp_path: Path, tiny_model: Path, out: str, replace: dict | None = None, **sections: dict) -> Path:
    """A small run on the tiny model with the vowel reward (module in tmp_path). `sections`
    update the base tables; `replace` swaps whole tables (e.g. another generator type)."""
    (tmp_path / "tiny_rewards.py").write_text(REWARDS)
    (tmp_path / "prompts.jsonl").write_text(PROMPTS_JSONL)
    base = {
        "model": {"name": str(tiny_model)},
        "generator": {"kv_cache_gb": 0.25, "groups_in_flight": 4, "max_model_len": 256},
        "sampling": {"max_new_tokens": 8, "samples_per_prompt": 4},
        "learner": {"groups_per_step": 2, "lr": 2e-3},
        "run": {"max_steps": 3, "output_dir": str(tmp_path / out), "progress": False, "canary_every": 1},
        "task": {"type": "jsonl", "path": str(tmp_path / "prompts.jsonl"), "reward": "tiny_rewards:vowels",
                 "heldout": 4},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    base.update(replace or {})
    lines = []
    for name, values in base.items():
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {json.dumps(v)}" for k, v in values.items())
    path = tmp_path / f"{out}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # user reward modules are imported from the working directory
    return tmp_path


def test_cli_runs_three_steps_and_writes_loadable_adapters(in_tmp, tiny_model):
    from typer.testing import CliRunner

    from lora_async.cli import app

    config = make_config(in_tmp, tiny_model, "cli")
    result = CliRunner().invoke(app, ["train", str(config), "--set", "run.max_steps=3"])
    assert result.exit_code == 0, result.output
    out = in_tmp / "cli"
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "kind" not in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert set(STEP_KEYS) <= set(row), set(STEP_KEYS) - set(row)
    versions = [r["version"] for r in rows]
    assert versions == sorted(set(versions)) and versions[-1] == 3  # never repeat
    # learner and vLLM agree where the sample's version is the learner's (lag 0)
    onpolicy = [r["logprob_mismatch_onpolicy"] for r in rows if r["logprob_mismatch_onpolicy"] is not None]
    # (bf16 on both sides; the tiny model's peaked logits make ~0.03 nats of numeric noise)
    assert onpolicy and all(m < 0.1 for m in onpolicy)
    canaries = [r for r in read_metrics(out / "metrics.jsonl") if r.get("kind") == "canary"]
    assert canaries and all(c["canary_mismatch"] < 0.1 for c in canaries)
    assert list((out / "tb").glob("events.*"))

    # The adapters are standard PEFT: peft loads them, and vLLM loads them from the path.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    final = out / "adapters" / "main" / "final"
    assert (out / "adapters" / "main" / "v3" / "adapter_model.safetensors").is_file()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), final)
    assert any("lora_A" in n for n, _ in model.named_parameters())
    # `lora-async eval --adapter` hands vLLM the directory (LoRARequest path, vLLM's own loader)
    result = CliRunner().invoke(app, ["eval", str(config), "--adapter", str(final), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert [r["model"] for r in report["results"]] == ["base", str(final)]
    assert all(r["n"] == 4 for r in report["results"])


def test_tiny_model_learns_a_trivial_reward(in_tmp, tiny_model):
    """Reward 1 for emitting the token '7' (about a quarter of samples do at first)."""
    from lora_async.orchestrator import train

    config = load_config(make_config(in_tmp, tiny_model, "learn", run={"max_steps": 20, "canary_every": 0},
                                     learner={"groups_per_step": 4, "lr": 1e-2}, task={"reward": "regex:7"}))
    asyncio.run(train(config))
    rows = [r for r in read_metrics(in_tmp / "learn" / "metrics.jsonl") if "kind" not in r]
    first = sum(r["reward_mean"] for r in rows[:3]) / 3
    last = sum(r["reward_mean"] for r in rows[-3:]) / 3
    assert first < 0.6 and last > 0.75 and last > first + 0.3, f"reward did not rise: {first:.2f} -> {last:.2f}"
    updates = sum(r["updated"] for r in rows)  # once it has learned, groups are flat and steps skip
    assert updates >= 2 and rows[-1]["version"] == updates  # it got there by updates, each a new version


def test_a_dead_engine_stops_the_run_with_a_clear_error_and_a_checkpoint(in_tmp, tiny_model):
    import os
    import signal

    from lora_async.orchestrator import TrainingError, train

    # The engine in its own process, killed with SIGKILL mid-run (as the OOM killer would).
    config = load_config(make_config(in_tmp, tiny_model, "dead", run={"max_steps": 50, "canary_every": 0},
                                     generator={"engine_process": "separate"}))

    def kill_engine(run):
        if run.global_step != 2:
            return
        pids = run.generator.run_in_engine(lambda client: client.worker_pids())
        assert pids and all(pid != os.getpid() for pid in pids)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

    with pytest.raises(TrainingError, match="engine"):
        asyncio.run(train(config, on_step=kill_engine))
    out = in_tmp / "dead"
    state = json.loads((out / "checkpoints" / (out / "checkpoints" / "LATEST").read_text() / "state.json")
                       .read_text())
    assert state["step"] >= 2  # what was learned before the failure is kept


def test_sigkill_then_resume_continues_versions_and_restores_state(in_tmp, tiny_model):
    config = make_config(in_tmp, tiny_model, "resume", run={"max_steps": 8, "checkpoint_every": 1,
                                                           "canary_every": 0})
    out = in_tmp / "resume"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(in_tmp), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "lora_async", "train", str(config)]
    proc = subprocess.Popen(cmd, env=env, cwd=in_tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    latest = out / "checkpoints" / "LATEST"
    try:
        wait_for_run(proc, lambda: latest.is_file() and latest.read_text().strip() >= "step-000003",
                     "the checkpoint of step 3")
    finally:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    name = latest.read_text().strip()
    saved = in_tmp / "saved-checkpoint"
    shutil.copytree(out / "checkpoints" / name, saved)
    killed_at = json.loads((saved / "state.json").read_text())

    # The checkpoint restores exactly: adapter tensors, optimizer state, version.
    from lora_async.checkpoint import checkpoint_tensors, load_checkpoint
    from lora_async.learner import Learner
    from lora_async.placement import Placement

    cfg = load_config(config)
    learner = Learner(tiny_model, {"main": (cfg.lora, cfg.learner.lr)}, cfg.learner, cfg.loss,
                      Placement("cpu", None), 1.0, 0)
    state = load_checkpoint(saved, learner)
    assert state.step == killed_at["step"] and learner.version("main") == killed_at["versions"]["main"]
    restored = learner.adapter_tensors("main")
    for key, tensor in checkpoint_tensors(saved, "main").items():
        assert torch.equal(restored[key], tensor), key
    assert learner.adapters["main"].optimizer.state_dict()["state"]  # Adam moments came back

    done = subprocess.run(cmd + ["--resume"], env=env, cwd=in_tmp, capture_output=True, text=True,
                          timeout=WHOLE_RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "kind" not in r]
    assert [r["step"] for r in rows] == list(range(1, 9))  # appended, never duplicated
    assert [r["version"] for r in rows] == list(range(1, 9))  # numbering continues
    assert rows[-1]["wall_s"] > rows[killed_at["step"] - 1]["wall_s"]
    assert f"resumed from {name}" in done.stderr


def test_nonfinite_loss_skips_the_step_and_keeps_the_weights(tiny_model):
    from lora_async.buffer import TrainSample
    from lora_async.config import LearnerConfig, LoraConfig, default_loss
    from lora_async.learner import Learner
    from lora_async.placement import Placement

    learner = Learner(tiny_model, {"main": (LoraConfig(), 1e-2)}, LearnerConfig(), default_loss(),
                      Placement("cpu", None), 1.0, 0)
    before = learner.adapter_tensors("main")
    good = [TrainSample("main", 0, [1, 2, 3], [4, 5], [-1.0, -1.0], 1.0, 1.0),
            TrainSample("main", 0, [1, 2, 3], [6, 7], [-1.0, -1.0], 0.0, -1.0)]
    bad = [TrainSample("main", 0, [1, 2, 3], [4, 5], [float("nan"), -1.0], 1.0, 1.0),
           TrainSample("main", 0, [1, 2, 3], [6, 7], [-1.0, -1.0], 0.0, -1.0)]
    stats = learner.train_step("main", bad)
    assert stats.skipped_nonfinite and not stats.updated and learner.version("main") == 0
    after = learner.adapter_tensors("main")
    assert all(torch.equal(before[k], after[k]) for k in before)
    stats = learner.train_step("main", good)
    assert stats.updated and learner.version("main") == 1
    assert learner.adapters["main"].skipped_nonfinite == 1
