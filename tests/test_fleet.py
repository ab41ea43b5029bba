"""Fleets: three adapters on one tiny base, trained at once; then listed, exported and served."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from lora_async.bench.proc import free_port
from lora_async.config import load_config
from lora_async.metrics import read_metrics
from lora_async.orchestrator.rollouts import PRODUCER

from .helpers import RUN_TIMEOUT_S

pytestmark = pytest.mark.slow

# Each adapter is rewarded for a different digit the tiny model emits now and then.
DIGITS = {"seven": "7", "zero": "0", "four": "4"}


def fleet_config(tmp_path: Path, tiny_model: Path, out: str, max_steps: int) -> Path:
    (tmp_path / "prompts.jsonl").write_text("\n".join(
        json.dumps({"prompt": f"Say something about item {i}.", "answer": "-"}) for i in range(40)))
    entries = "\n".join(
        f'[[adapters]]\nname = "{name}"\nweight = {2.0 if name == "seven" else 1.0}\n'
        f'[adapters.task]\ntype = "jsonl"\npath = "prompts.jsonl"\nreward = "regex:{digit}"\nheldout = 4\n'
        for name, digit in DIGITS.items())
    text = f"""
[model]
name = "{tiny_model}"
[generator]
kv_cache_gb = 0.25
groups_in_flight = 8
max_model_len = 256
[sampling]
max_new_tokens = 8
samples_per_prompt = 4
[learner]
groups_per_step = 3
lr = 2e-2
[run]
max_steps = {max_steps}
output_dir = "{tmp_path / out}"
progress = false
canary_every = 0
checkpoint_every = 4
{entries}
"""
    path = tmp_path / f"{out}.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def fleet_run(tiny_model, tmp_path_factory):
    """Train the 3-adapter fleet once (checking isolation on every step); later tests reuse it."""
    from lora_async.orchestrator import train

    tmp = tmp_path_factory.mktemp("fleet")
    config = load_config(fleet_config(tmp, tiny_model, "fleet", max_steps=12))
    snapshots: dict[str, dict[str, torch.Tensor]] = {}
    steps: dict[str, int] = {}
    violations: list[str] = []
    producers: dict[str, int] = {}

    def check_isolation(run):
        stepped = {name for name, a in run.adapters.items() if a.step != steps.get(name)}
        for name in run.adapters:
            now = run.learner.adapter_tensors(name)
            before = snapshots.get(name)
            if before is not None and name not in stepped:
                if any(not torch.equal(before[k], now[k]) for k in now):
                    violations.append(f"{name} changed during a step of {sorted(stepped)}")
            snapshots[name] = now
        steps.update({name: a.step for name, a in run.adapters.items()})
        if not producers:  # the producer tasks running, per adapter (start_producers names them)
            names = [t.get_name().split() for t in asyncio.all_tasks() if t.get_name().startswith(PRODUCER)]
            producers.update({name: sum(owner == name for _, owner in names) for name in run.adapters})

    summary = asyncio.run(train(config, on_step=check_isolation))
    return {"out": Path(config.run.output_dir), "config": config, "summary": summary, "violations": violations,
            "tmp": tmp, "producers": producers}


def test_each_adapter_learns_its_own_reward_in_isolation(fleet_run):
    assert fleet_run["violations"] == []
    rows = [r for r in read_metrics(fleet_run["out"] / "metrics.jsonl") if "kind" not in r]
    for name in DIGITS:
        mine = [r for r in rows if r["adapter"] == name]
        assert [r["step"] for r in mine] == list(range(1, 13))
        versions = [r["version"] for r in mine]
        assert versions == sorted(versions)  # per-adapter counters, never repeating
        first = sum(r["reward_mean"] for r in mine[:3]) / 3
        last = sum(r["reward_mean"] for r in mine[-3:]) / 3
        assert last > first + 0.25, f"{name}: {first:.2f} -> {last:.2f}"


def test_fleet_generation_is_shared_by_weight(fleet_run):
    # groups_in_flight = 8 shared by weight (seven 2, the others 1): twice the producers (the
    # share of groups it gives is tests/test_orchestrator.py's, where generation is the bottleneck)
    assert fleet_run["producers"] == {"seven": 4, "zero": 2, "four": 2}
    rows = [r for r in read_metrics(fleet_run["out"] / "metrics.jsonl") if "kind" not in r]
    summary = fleet_run["summary"]
    for name in DIGITS:
        mine = [r for r in rows if r["adapter"] == name]
        total = summary[f"{name}.tokens_generated"]
        # its own step lines count its own tokens: nobody starved, and none counted another's
        assert 0 < sum(r["tokens_generated"] for r in mine) <= total, name
        assert summary[f"{name}.version"] == mine[-1]["version"] and summary[f"{name}.reward_errors"] == 0
    # the run-wide figure is the sum of every adapter's own
    assert max(r["tokens_generated_total"] for r in rows) <= sum(summary[f"{n}.tokens_generated"] for n in DIGITS)


def test_fleet_resume_continues_every_adapter(fleet_run, tiny_model):
    from lora_async.orchestrator import train

    tmp = fleet_run["tmp"]
    config = load_config(fleet_config(tmp, tiny_model, "fleet", max_steps=16))
    asyncio.run(train(config, resume=True))
    rows = [r for r in read_metrics(fleet_run["out"] / "metrics.jsonl") if "kind" not in r]
    for name in DIGITS:
        mine = [r for r in rows if r["adapter"] == name]
        assert [r["step"] for r in mine] == list(range(1, 17)), name
        versions = [r["version"] for r in mine]
        # numbering continues across the resume (never restarts); steps after the reward
        # saturates make no update, so a version may stay while steps go on
        assert versions == sorted(versions) and versions[12] >= versions[11] >= 1


def test_adapters_list_and_export(fleet_run, tiny_model, tmp_path):
    from typer.testing import CliRunner

    from lora_async.cli import app

    out = fleet_run["out"]
    listed = CliRunner().invoke(app, ["adapters", "list", str(out), "--json"])
    assert listed.exit_code == 0, listed.output
    rows = {r["adapter"]: r for r in json.loads(listed.stdout)}
    assert set(rows) == set(DIGITS) and all(r["version"] >= 1 and r["bytes"] > 0 for r in rows.values())

    dest = tmp_path / "seven-peft"
    done = CliRunner().invoke(app, ["adapters", "export", str(out), "seven", str(dest)])
    assert done.exit_code == 0, done.output
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, dest)
    ids = torch.tensor([[1, 510, 2114, 314]])
    with torch.no_grad():
        adapted = peft_model(ids).logits

    merged_dir = tmp_path / "seven-merged"
    done = CliRunner().invoke(app, ["adapters", "export", str(out), "seven", str(merged_dir), "--merged"])
    assert done.exit_code == 0, done.output
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    with torch.no_grad():
        error = (merged(ids).logits - adapted).abs().max()
    assert error < 0.03 * adapted.abs().max()  # the merged weights are stored in bf16

    missing = CliRunner().invoke(app, ["adapters", "export", str(out), "nope", str(tmp_path / "x")])
    assert missing.exit_code == 1 and "seven" in missing.output


def _post(url: str, payload: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_serve_answers_per_adapter_over_http(fleet_run):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lora_async", "serve", str(fleet_run["out"]),
                             "--port", str(port), "--max-model-len", "256", "--kv-cache-gb", "0.25"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + RUN_TIMEOUT_S
        while time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            try:
                with urllib.request.urlopen(f"{base_url}/v1/models", timeout=2) as response:
                    served = {m["id"] for m in json.loads(response.read())["data"]}
                break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail("server did not come up")
        assert {"base", *DIGITS} <= served

        def complete(model: str) -> str:
            body = _post(f"{base_url}/v1/completions", {"model": model, "prompt": "Say something about item 3.",
                                                         "max_tokens": 12, "temperature": 0.0})
            return body["choices"][0]["text"]

        base_text = complete("base")
        texts = {name: complete(name) for name in DIGITS}
        for name, text in texts.items():
            assert text != base_text, f"{name} answers like the base model"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    output = proc.stdout.read()
    assert code == 0, output[-3000:]
    assert "curl" in output and all(name in output for name in DIGITS)  # one example per adapter
    with socket.socket() as sock:  # nobody listens any more: the server is really gone
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine
        sock.bind(("127.0.0.1", port))


def test_plot_writes_a_png_for_two_runs(fleet_run, tmp_path):
    from typer.testing import CliRunner

    from lora_async.cli import app

    other = tmp_path / "other-run"
    other.mkdir()
    (other / "metrics.jsonl").write_text((fleet_run["out"] / "metrics.jsonl").read_text())
    png = tmp_path / "cmp.png"
    done = CliRunner().invoke(app, ["plot", str(fleet_run["out"]), str(other), "-o", str(png)])
    assert done.exit_code == 0, done.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert (fleet_run["out"] / "chart.png").is_file()  # the live view the run kept redrawing

    empty = tmp_path / "empty-run"
    empty.mkdir()
    for bad in (empty, tmp_path / "missing"):
        done = CliRunner().invoke(app, ["plot", str(bad), "-o", str(tmp_path / "x.png")])
        assert done.exit_code == 1 and str(bad.name) in done.output and "Traceback" not in done.output
