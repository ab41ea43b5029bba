"""The QLoRA learner: a bitsandbytes 4-bit (or 8-bit) base trains an ordinary PEFT adapter, and
the generator serves it on the learner's own base, dequantised (`learner/served_base.py`), so
vLLM computes what the quantised learner computes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lora_async.buffer import TrainSample
from lora_async.config import LearnerConfig, LoraConfig, default_loss
from lora_async.placement import Placement

from .helpers import PROMPTS, publish, submit_many


def make_learner(model_dir, quantization: str, lr: float = 1e-2):
    from lora_async.learner import Learner

    return Learner(model_dir, {"main": (LoraConfig(rank=8), lr)}, LearnerConfig(dtype="float32"), default_loss(),
                   Placement("cpu", None), 1.0, 0, quantization)


def batch(behaviour: list[list[float]] | None = None) -> list[TrainSample]:
    """Two completions of one prompt: the first rewarded, the second not. `behaviour`: the
    sampling logprobs (the learner's own, for an on-policy step; made-up ones otherwise)."""
    first, second = behaviour or ([-3.0] * 3, [-3.0] * 3)
    return [TrainSample("main", 0, PROMPTS[0], [44, 55, 66], list(first), 1.0, 1.0),
            TrainSample("main", 0, PROMPTS[0], [77, 88, 99], list(second), 0.0, -1.0)]


@pytest.mark.parametrize("quantization, layer", [("nf4", "Linear4bit"), ("int8", "Linear8bitLt")])
def test_quantized_base_trains_a_full_precision_adapter(tiny_model, quantization, layer):
    learner = make_learner(tiny_model, quantization)
    model = learner.model
    kinds = {type(m).__name__ for m in model.modules()}
    assert layer in kinds  # the frozen linears really are bitsandbytes layers
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
    before = learner.logprobs("main", batch())
    for _ in range(3):  # on-policy steps: sampled by the adapter being trained, as the loss expects
        stats = learner.train_step("main", batch(learner.logprobs("main", batch())))
        assert stats.updated and not stats.skipped_nonfinite
    after = learner.logprobs("main", batch())
    assert sum(after[0]) > sum(before[0]) + 0.5  # the rewarded completion became likelier
    assert sum(after[1]) < sum(before[1])  # the other one less likely
    # The adapter is a normal PEFT state dict: an unquantised learner takes it as it is.
    plain = make_learner(tiny_model, "none")
    plain.load_adapter_tensors("main", learner.adapter_tensors("main"))
    assert set(plain.adapter_tensors("main")) == set(learner.adapter_tensors("main"))


@pytest.fixture
def bases(tmp_path, monkeypatch):
    """Served bases built into this test's own cache."""
    monkeypatch.setenv("LORA_ASYNC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "bases"


def checkpoint(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


@pytest.fixture(scope="module")
def biased_model(tiny_model, tmp_path_factory):
    """The tiny model with a bias on every linear layer (as Qwen2 has on q, k, v), far from 0."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("biased") / "tiny-biased"
    shutil.copytree(tiny_model, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "attention_bias": True, "mlp_bias": True}))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(mean=3.0)
    for path in out.glob("*.safetensors"):
        path.unlink()
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("quantization, model", [("nf4", "tiny_model"), ("int8", "tiny_model"),
                                                 ("nf4", "biased_model")])
def test_the_generators_base_is_the_learners_dequantised_weights(request, bases, quantization, model):
    """Every weight of the generator's base is, bit for bit, what the learner multiplies by: each
    bitsandbytes layer of a learner that has trained and computed logprobs gives exactly an
    ordinary matmul with the served weight (with and without grad: one kernel path), and every
    other tensor is the learner's own. An unquantised learner on that base computes the
    quantised learner's logprobs."""
    import bitsandbytes as bnb

    from lora_async.base_recipe import Recipe
    from lora_async.learner.served_base import served_base

    tiny_model = request.getfixturevalue(model)
    served_dir = served_base(tiny_model, Recipe(quantization, "float32", "cpu"))
    served = checkpoint(served_dir)
    learner = make_learner(tiny_model, quantization)
    learner.train_step("main", batch())
    learner.logprobs("main", batch())
    base = learner.model.get_base_model()
    layers = {name.removesuffix(".base_layer"): m for name, m in base.named_modules()
              if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))}
    original = checkpoint(tiny_model)
    assert set(served) == set(original) and len(layers) == 14  # 2 layers x 7 linears
    assert any(name.endswith(".bias") for name in served) == (model == "biased_model")
    torch.manual_seed(0)
    for name, value in served.items():
        assert value.dtype == torch.float32, name
        layer = layers.get(name.removesuffix(".weight"))
        if layer is None:
            assert torch.equal(value, base.get_parameter(name).data), name
            continue
        x = torch.randn(3, value.shape[1])
        expected = torch.nn.functional.linear(x, value, served.get(name.removesuffix("weight") + "bias"))
        with torch.no_grad():
            assert torch.equal(layer(x), expected), name
        assert torch.equal(layer(x.clone().requires_grad_()).detach(), expected), name
        assert not torch.equal(value, original[name].float()), name  # the rounding is really there
    plain = make_learner(served_dir, "none")
    plain.load_adapter_tensors("main", learner.adapter_tensors("main"))
    theirs = torch.tensor([lp for row in learner.logprobs("main", batch()) for lp in row])
    mine = torch.tensor([lp for row in plain.logprobs("main", batch()) for lp in row])
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)


def test_the_cache_is_rebuilt_when_the_checkpoint_or_the_quantisation_changes(tiny_model, bases, tmp_path):
    import json
    import pickle
    import shutil

    from safetensors.torch import save_file

    from lora_async.base_recipe import Recipe
    from lora_async.learner.served_base import BaseBuilder, served_base

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    nf4 = Recipe("nf4", "float32", "cpu")
    first = served_base(model, nf4)
    built = (first / ".complete").stat().st_mtime_ns
    assert served_base(model, nf4) == first and (first / ".complete").stat().st_mtime_ns == built  # cached
    # What a Ray replica on another node is handed (pickled) finds the same entry there.
    assert pickle.loads(pickle.dumps(BaseBuilder(nf4)))(model) == first
    int8 = served_base(model, Recipe("int8", "float32", "cpu"))
    bf16 = served_base(model, Recipe("nf4", "bfloat16", "cpu"))
    assert len({first, int8, bf16}) == 3 and all(p.is_dir() for p in (first, int8, bf16))
    assert checkpoint(bf16)["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"

    # A new checkpoint under the same path: a new entry, built from the new weights; the one it
    # supersedes is removed, the other recipes' entries stay.
    weights = checkpoint(model)
    name = "model.layers.0.mlp.up_proj.weight"
    weights[name] = weights[name] * 2
    for path in model.glob("*.safetensors"):
        path.unlink()
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    second = served_base(model, nf4)
    assert second != first and not first.exists() and int8.is_dir() and bf16.is_dir()
    assert not torch.equal(checkpoint(second)[name], checkpoint(int8)[name])
    before = checkpoint(second)[name]

    # An entry whose files changed after it was built no longer matches its hashes: rebuilt.
    shard = next(second.glob("*.safetensors"))
    damaged = checkpoint(second)
    damaged[name] = torch.zeros_like(damaged[name])
    save_file(damaged, str(shard), metadata={"format": "pt"})
    assert served_base(model, nf4) == second
    assert torch.equal(checkpoint(second)[name], before)


def test_a_full_disk_or_a_killed_build_loses_nothing(tiny_model, bases, monkeypatch):
    """Too little disk for the copy is one line naming what it needs and the ways out, and
    leaves no entry; a build killed half-way leaves a temporary directory that the next build
    removes (it holds the entry's lock, so no builder is alive there)."""
    import shutil
    from collections import namedtuple

    from lora_async.base_recipe import Recipe
    from lora_async.learner import served_base as module
    from lora_async.learner.served_base import ServedBaseError, served_base

    recipe = Recipe("nf4", "float32", "cpu")
    usage = namedtuple("usage", "total used free")
    real = shutil.disk_usage
    monkeypatch.setattr(module.shutil, "disk_usage", lambda path: usage(1 << 40, 1 << 40, 10 << 20))
    with pytest.raises(ServedBaseError) as caught:
        served_base(tiny_model, recipe)
    message = str(caught.value)
    assert "GB free" in message and "LORA_ASYNC_CACHE" in message and "generator.base = 'original'" in message
    assert "\n" not in message
    assert not [p for p in bases.iterdir() if p.is_dir()]
    monkeypatch.setattr(module.shutil, "disk_usage", real)
    entry = served_base(tiny_model, recipe)
    leftover = bases / f".{entry.name}.k1ll3d"
    leftover.mkdir()
    (leftover / "part-1.safetensors").write_bytes(b"half")
    shutil.rmtree(entry)
    assert served_base(tiny_model, recipe) == entry and not leftover.exists()


@pytest.mark.vllm
def test_vllm_serves_what_an_nf4_learner_computes(tiny_model, bases, engine_lease):
    """On the learner's dequantised base (the default) vLLM's sampling logprobs equal the nf4
    learner's own to 1e-3 per token, the tolerance an unquantised learner meets on the original
    base; on the original base (generator.base = "original") the nf4 learner is off by its
    quantisation gap."""
    import dataclasses

    from lora_async.base_recipe import Recipe
    from lora_async.generator.types import GenRequest
    from lora_async.learner.served_base import served_base

    from .conftest import shared_spec

    learner = make_learner(tiny_model, "nf4")
    for _ in range(3):
        learner.train_step("main", batch())
    version = learner.adapter_version("main")
    served_dir = served_base(tiny_model, Recipe("nf4", "float32", "cpu"))
    requests = [GenRequest(prompt, "main", n=2, max_tokens=6, temperature=1.0) for prompt in PROMPTS]
    gaps = {}
    for base, model_dir in (("learner", served_dir), ("original", tiny_model)):
        spec = dataclasses.replace(shared_spec(tiny_model, dtype="float32"), model_dir=model_dir)
        generator = engine_lease.get(spec)
        publish(generator, version)
        results = submit_many(generator, requests)
        samples = [TrainSample("main", version.version, request.prompt_ids, s.token_ids, s.logprobs, 0.0, 0.0)
                   for request, result in zip(requests, results) for s in result.samples]
        vllm_lp = torch.tensor([lp for s in samples for lp in s.logprobs])
        nf4_lp = torch.tensor([lp for row in learner.logprobs("main", samples) for lp in row])
        if base == "learner":
            torch.testing.assert_close(vllm_lp, nf4_lp, rtol=0, atol=1e-3)
        else:  # the original base: what an unquantised learner with the same adapter computes
            plain = make_learner(tiny_model, "none")
            plain.load_adapter_tensors("main", version.tensors)
            plain_lp = torch.tensor([lp for row in plain.logprobs("main", samples) for lp in row])
            torch.testing.assert_close(vllm_lp, plain_lp, rtol=0, atol=1e-3)
        gaps[base] = (nf4_lp - vllm_lp).abs().mean().item()
    assert gaps["original"] > 1e-3 > gaps["learner"]
    assert gaps["original"] > 30 * gaps["learner"]


def test_bitsandbytes_that_cannot_load_is_one_line_and_exit_2(tmp_path):
    """`model.quantization = "nf4"` without a working bitsandbytes fails before any model loads."""
    broken = tmp_path / "site" / "bitsandbytes"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('libbitsandbytes_cpu.so: cannot open shared object file')\n")
    (broken / "functional.py").write_text("")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code = textwrap.dedent("""
        import sys
        from lora_async.cli import app
        sys.argv = ["lora-async", "train", "--set", "model.quantization=nf4", "--set", "model.name=smollm2-135m"]  # a known name: nothing is built before the check
        app()
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.quantization" in lines[0] and "bitsandbytes" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


class _Served:
    """A stand-in for the servers' /v1/models answers (what `check_base` reads)."""

    def __init__(self, roots: dict[str, str]) -> None:
        self.roots = roots
        self.urls = list(roots)

    def served(self, url: str) -> list[dict]:
        return [{"id": "base", "root": self.roots[url], "parent": None}, {"id": "main@3", "parent": "base"}]


def test_a_server_run_checks_its_servers_serve_the_learners_base(tmp_path):
    """generator.type = "server" cannot build the base for the servers: it checks that each one
    serves the entry the run would build (by its content-hash name), or says how to start it."""
    from lora_async.base_recipe import Recipe
    from lora_async.generator.server import ServerGenerator
    from lora_async.generator.server.client import ServerError

    expected = tmp_path / "bases" / "tiny-nf4-float32-cpu-0123456789abcdef"
    command = Recipe("nf4", "float32", "cpu").server_command("my-model")
    assert command == "lora-async server my-model --quantization nf4 --learner-dtype float32 --learner-device cpu"
    generator = ServerGenerator.__new__(ServerGenerator)  # no servers to reach: only the check
    generator.client = _Served({"http://a:1": f"/elsewhere/{expected.name}", "http://b:1": f"/x/{expected.name}"})
    generator.check_base(expected, command)  # another machine's cache, same entry: accepted
    generator.client = _Served({"http://a:1": f"/x/{expected.name}", "http://b:1": "/models/tiny"})
    with pytest.raises(ServerError) as caught:
        generator.check_base(expected, command)
    message = str(caught.value)
    assert "http://b:1 serves /models/tiny" in message and command in message and "generator.base" in message
    assert "\n" not in message


def test_the_generator_factory_checks_a_server_runs_base_and_closes_it_on_a_mismatch(tmp_path, monkeypatch):
    """With a base the run builds (a recipe), `make_generator` checks the servers serve it (and
    closes what it opened if they do not); without one, nothing is checked."""
    from lora_async.base_recipe import Recipe
    from lora_async.config import TrainConfig
    from lora_async.generator import make_generator
    from lora_async.generator.server import ServerGenerator
    from lora_async.generator.server.client import ServerError
    from lora_async.learner.served_base import BaseBuilder

    expected = tmp_path / "bases" / "tiny-nf4-float32-cpu-0123456789abcdef"
    opened, closed = [], []

    def connect(self, client, model_dir, *args):  # no servers to reach: they serve /models/tiny
        self.client = _Served({url: "/models/tiny" for url in client.urls})
        opened.append(self)

    monkeypatch.setattr(ServerGenerator, "__init__", connect)
    monkeypatch.setattr(ServerGenerator, "close", lambda self: closed.append(self))
    config = TrainConfig.model_validate({"generator": {"type": "server", "urls": ["http://a:1"]}})
    with pytest.raises(ServerError, match="http://a:1 serves /models/tiny"):
        make_generator(config, expected, None, BaseBuilder(Recipe("nf4", "float32", "cpu")))  # no engine placed
    assert len(opened) == 1 and closed == opened
    assert isinstance(make_generator(config, expected, None, None), ServerGenerator)
    assert len(closed) == 1


@pytest.mark.slow
def test_an_nf4_run_serves_the_learners_base_end_to_end(tiny_model, bases, tmp_path):
    """`lora-async train` with model.quantization = "nf4": the generator serves the learner's
    dequantised base, so the on-policy mismatch and the canary are at float32's level (1e-3, the
    tolerance an unquantised learner meets; the original base is off by more, see above), the
    run records the base, and `serve` and `export` find it."""
    from typer.testing import CliRunner

    from lora_async.cli import app
    from lora_async.learner.served_base import run_base
    from lora_async.metrics import read_metrics
    from lora_async.serve import server_command

    from .conftest import REPO

    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "train", str(REPO / "examples" / "qlora.toml"), "--set", f"model.name={tiny_model}",
        "--set", "model.dtype=float32", "--set", "learner.dtype=float32", "--set", "generator.kv_cache_gb=0.25",
        "--set", "run.max_steps=2", "--set", f"run.output_dir={out}", "--set", "run.canary_every=1",
        "--set", "run.eval_every=0", "--set", "run.eval_at_start=false", "--set", "run.eval_at_end=false",
        "--set", "learner.groups_per_step=2", "--set", "sampling.samples_per_prompt=4", "--set", "run.progress=false",
        "--set", "buffer.mode=sync",
        # the random tiny model rarely writes a number: with a KL term every group trains, flat or not,
        # so both steps have on-policy tokens to compare whatever the samples drawn
        "--set", "loss.kl_coef=0.01"])
    assert result.exit_code == 0, result.output
    assert "the generator serves the learner's nf4 base, dequantised to float32" in " ".join(result.output.split())
    rows = read_metrics(out / "metrics.jsonl")
    onpolicy = [r["logprob_mismatch_onpolicy"] for r in rows if "kind" not in r]
    canaries = [r["canary_mismatch"] for r in rows if r.get("kind") == "canary"]
    assert len(onpolicy) == 2 and all(m is not None and m < 1e-3 for m in onpolicy), onpolicy
    assert canaries and all(c < 1e-3 for c in canaries), canaries
    served, recipe = run_base(out)
    assert served.parent == bases and recipe is not None and recipe.quantization == "nf4"
    cmd, _, model_dir = server_command(out, "127.0.0.1", 8000, 256, 0.25)
    assert model_dir == served and cmd[cmd.index("--model") + 1] == str(served)


def test_server_flags_for_the_learners_base_are_checked_before_anything_loads():
    from typer.testing import CliRunner

    from lora_async.cli import app

    result = CliRunner().invoke(app, ["server", "smollm2-135m", "--quantization", "nf5"])
    assert result.exit_code == 2
    assert "--quantization takes none, nf4 or int8" in result.output and "Traceback" not in result.output
