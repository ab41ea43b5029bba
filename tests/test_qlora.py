"""The QLoRA learner: a bitsandbytes 4-bit (or 8-bit) base trains an ordinary PEFT adapter, which
vLLM serves on the unquantised base exactly as an unquantised learner computes it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lora_async.buffer import TrainSample
from lora_async.config import LearnerConfig, LoraConfig, LossConfig
from lora_async.placement import Placement

from .helpers import PROMPTS, publish, submit_many


def make_learner(model_dir, quantization: str, lr: float = 1e-2):
    from lora_async.learner import Learner

    return Learner(model_dir, {"main": (LoraConfig(rank=8), lr)}, LearnerConfig(dtype="float32"), LossConfig(),
                   Placement("cpu", None), 1.0, 0, quantization)


def batch() -> list[TrainSample]:
    """Two completions of one prompt: the first rewarded, the second not."""
    return [TrainSample("main", 0, PROMPTS[0], [44, 55, 66], [-3.0] * 3, 1.0, 1.0),
            TrainSample("main", 0, PROMPTS[0], [77, 88, 99], [-3.0] * 3, 0.0, -1.0)]


@pytest.mark.parametrize("quantization, layer", [("nf4", "Linear4bit"), ("int8", "Linear8bitLt")])
def test_quantized_base_trains_a_full_precision_adapter(tiny_model, quantization, layer):
    learner = make_learner(tiny_model, quantization)
    model = learner.model
    kinds = {type(m).__name__ for m in model.modules()}
    assert layer in kinds  # the frozen linears really are bitsandbytes layers
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
    before = learner.logprobs("main", batch())
    for _ in range(3):
        stats = learner.train_step("main", batch())
        assert stats.updated and not stats.skipped_nonfinite
    after = learner.logprobs("main", batch())
    assert sum(after[0]) > sum(before[0]) + 0.5  # the rewarded completion became likelier
    assert sum(after[1]) < sum(before[1])  # the other one less likely
    # The adapter is a normal PEFT state dict: an unquantised learner takes it as it is.
    plain = make_learner(tiny_model, "none")
    plain.load_adapter_tensors("main", learner.adapter_tensors("main"))
    assert set(plain.adapter_tensors("main")) == set(learner.adapter_tensors("main"))


@pytest.mark.vllm
def test_vllm_serves_what_an_nf4_learner_trained(tiny_model, engine_lease):
    """vLLM (unquantised base) serves the nf4 learner's adapter: its sampling logprobs equal an
    unquantised learner's holding the same adapter to 1e-3 (both float32 here), and differ from
    the nf4 learner's own by the quantisation gap alone."""
    from lora_async.generator.types import GenRequest

    from .conftest import shared_spec

    learner = make_learner(tiny_model, "nf4")
    for _ in range(3):
        learner.train_step("main", batch())
    version = learner.adapter_version("main")
    # The session's engine where it serves float32 (here); its own engine where it would not.
    generator = engine_lease.get(shared_spec(tiny_model, dtype="float32"))
    publish(generator, version)
    requests = [GenRequest(prompt, "main", n=2, max_tokens=6, temperature=1.0) for prompt in PROMPTS]
    results = submit_many(generator, requests)
    base = submit_many(generator, [GenRequest(p, None, max_tokens=6, temperature=0.0) for p in PROMPTS])
    served = submit_many(generator, [GenRequest(p, "main", max_tokens=6, temperature=0.0) for p in PROMPTS])
    samples = [TrainSample("main", version.version, request.prompt_ids, s.token_ids, s.logprobs, 0.0, 0.0)
               for request, result in zip(requests, results) for s in result.samples]
    plain = make_learner(tiny_model, "none")
    plain.load_adapter_tensors("main", version.tensors)
    vllm_lp = torch.tensor([lp for s in samples for lp in s.logprobs])
    plain_lp = torch.tensor([lp for row in plain.logprobs("main", samples) for lp in row])
    nf4_lp = torch.tensor([lp for row in learner.logprobs("main", samples) for lp in row])
    torch.testing.assert_close(vllm_lp, plain_lp, rtol=0, atol=1e-3)
    gap = (nf4_lp - vllm_lp).abs().mean().item()
    assert gap > 1e-3  # the learner's base really is quantised ...
    assert (nf4_lp - plain_lp).abs().mean().item() == pytest.approx(gap, abs=1e-3)  # ... and that is all
    assert [r.samples[0].token_ids for r in served] != [r.samples[0].token_ids for r in base]  # adapter applied


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
