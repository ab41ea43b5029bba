"""End-to-end runs of the built-in environments through the real CLI and the vLLM engine:
a few steps on tiny models (plumbing; the calculator's calls its tool), and on the real default
model (learning, `long`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lora_async.metrics import read_metrics

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
# What the scripted model replies to every turn: a call of the calculator's tool, written in
# tokens that all differ, so that each token alone decides the next (see `tool_caller`).
TOOL_CALL = '<tool_call>{"name":"calculate","arguments": {"expression":"6*7"}}'
TOOL_CALL_TOKENS = ["<", "tool", "_", "call", ">", '{"', "name", '":"', "calculate", '","', "arguments", '":', ' {"',
                    "expression", '"', ':"', "6", "*", "7", '"}', "}"]
SPIKE = 8.0  # the scripted next token's logit is SPIKE * sqrt(hidden) (about 90); the others stay near 0


@pytest.fixture(scope="module")
def tool_caller(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama that answers every chat turn with TOOL_CALL, then ends its turn.

    A random model never writes a tool call. This one is a bigram machine: attention and MLP
    outputs are zero, so the last hidden state is the current token's embedding; the tokens of
    the call (and the assistant header's last token, which precedes every reply) embed as basis
    vectors, and each one's successor's output row points at it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lora_async.models import build_tiny_model

    out = build_tiny_model(tmp_path_factory.mktemp("models") / "tool-caller", tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(out)
    header_end = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                               tokenize=True)
    header_end = (header_end["input_ids"] if hasattr(header_end, "keys") else header_end)[-1]
    chain = [header_end] + [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(t))[0] for t in TOOL_CALL_TOKENS]
    assert len(set(chain)) == len(chain) and tokenizer.decode(chain[1:]) == TOOL_CALL
    chain.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.normal_(0.0, 0.02)
        for k, (token, successor) in enumerate(zip(chain, chain[1:])):
            embed[token] = 0.0
            embed[token, k] = 1.0
            head[successor, k] = SPIKE
    model.bfloat16().save_pretrained(out)
    return out


def run_cli(args: list[str]):
    from typer.testing import CliRunner

    from lora_async.cli import app

    return CliRunner().invoke(app, args)


def two_steps_of(config: Path, model: Path, out: Path, *extra: str) -> tuple[list[dict], list[dict], dict]:
    """Train an example environment config 2 steps on a tiny model through the CLI (eval at start
    and end on 4 episodes); its step rows, eval rows and summary, with what every run shows checked.
    `extra`: more --set arguments; the CLI's output is in the summary under "output"."""
    result = run_cli(["train", str(config), "--set", f"model.name={model}", "--set", "generator.kv_cache_gb=0.25",
                      "--set", "run.max_steps=2", "--set", f"run.output_dir={out}", "--set", "run.time_budget_s=600",
                      "--set", "task.heldout=4", "--set", "sampling.samples_per_prompt=4",
                      "--set", "learner.groups_per_step=2", "--set", "run.eval_every=0", "--set", "run.progress=false",
                      *[arg for setting in extra for arg in ("--set", setting)]])
    assert result.exit_code == 0, result.output
    rows = read_metrics(out / "metrics.jsonl")
    steps = [r for r in rows if "kind" not in r]
    evals = [r for r in rows if r.get("kind") == "eval"]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["episodes"] >= 8 and r["turns_mean"] >= 1 for r in steps)
    assert [e["when"] for e in evals] == ["start", "end"] and all(e["n"] == 4 for e in evals)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["episodes"] >= 16 and summary["env_errors"] == 0
    return steps, evals, {**summary, "output": result.output}


@pytest.mark.parametrize("example, model", [("calculator", "tool_caller"), ("guess", "tiny_model")])
def test_a_builtin_environment_trains_a_few_steps_on_a_tiny_model(tmp_path, request, example, model):
    tiny_model = request.getfixturevalue(model)
    out = tmp_path / example
    steps, evals, summary = two_steps_of(REPO / "examples" / f"{example}.toml", tiny_model, out)
    assert all("version_span_max" in r for r in steps)
    assert all(e["turns_mean"] >= 1 for e in evals)
    assert (out / "adapters" / "main" / "final" / "adapter_config.json").is_file()
    if example == "calculator":  # every reply calls the tool, which runs: its calls are counted, none failed
        assert all(r["tool_call_rate"] == 1.0 and r["tool_calls_mean"] >= 1 for r in steps)
        assert summary["tool_calls"] >= summary["episodes"] and summary["tool_errors"] == 0
    # `lora-async eval` scores an env config: success, turns and tool calls, base and adapter
    scored = run_cli(["eval", str(REPO / "examples" / f"{example}.toml"), "--set", f"model.name={tiny_model}",
                      "--set", "generator.kv_cache_gb=0.25", "--adapter", str(out / "adapters" / "main" / "final"),
                      "--limit", "3", "--json"])
    assert scored.exit_code == 0, scored.output
    report = json.loads(scored.output[scored.output.index("{"):])
    assert [r["model"] for r in report["results"]][0] == "base" and len(report["results"]) == 2
    assert all(r["n"] == 3 and "turns_mean" in r and "tool_call_rate" in r for r in report["results"])
    if example == "calculator":  # the tool's result is the next message of every episode shown
        assert all(r["tool_call_rate"] == 1.0 for r in report["results"])
        assert all("[tool] 42" in conversation for r in report["results"] for _, conversation, _ in r["examples"])


def test_tools_that_run_code_train_inside_the_namespaces_by_default(tmp_path, tool_caller):
    """The calculator with its tool run as a program in the sandbox (tests/sandboxed_calculator.py):
    the run probes the namespaces before the model loads, says so, and every call of every
    episode runs inside them (the tool reports the isolation it ran in)."""
    steps, evals, summary = two_steps_of(REPO / "examples" / "calculator.toml", tool_caller, tmp_path / "caged",
                                         "task.env=tests.sandboxed_calculator:make")
    assert "code runs in namespaces (bwrap " in summary["output"]
    assert all(r["tool_call_rate"] == 1.0 for r in steps)
    assert summary["tool_calls"] >= summary["episodes"] and summary["tool_errors"] == 0
    scored = run_cli(["eval", str(REPO / "examples" / "calculator.toml"), "--set", f"model.name={tool_caller}",
                      "--set", "generator.kv_cache_gb=0.25", "--set", "task.env=tests.sandboxed_calculator:make",
                      "--limit", "2", "--json"])
    assert scored.exit_code == 0, scored.output
    report = json.loads(scored.output[scored.output.index("{"):])
    assert all("[tool] 42 (namespaces)" in conversation for r in report["results"] for _, conversation, _ in r["examples"])


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
