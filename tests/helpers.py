"""Test helpers: random adapters for the tiny model, blocking generation."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from lora_async.bench.common import blocking_generate
from lora_async.generator.types import AdapterVersion, GenRequest, GenResult, PublishStats


def random_adapter(model_dir: Path, adapter: str, version: int, seed: int, scale: float = 1.0,
                   rank: int = 8, gathered: bool = False, **peft_kwargs) -> AdapterVersion:
    """A peft LoRA with random A and B (so it visibly changes outputs), as an AdapterVersion:
    separate tensors, or (`gathered`) views of one buffer, as the learner hands a version over."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from lora_async.generator.validate import peft_config_dict

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False,
                     **peft_kwargs)
    model = get_peft_model(base, cfg)
    tensors = {k: (v.detach() * scale).clone() for k, v in get_peft_model_state_dict(model).items()}
    config = peft_config_dict(cfg)
    if gathered:
        return AdapterVersion.gather(adapter, version, tensors, config)
    return AdapterVersion(adapter, version, tensors, config)


def inproc_reference(model_dir: Path, adapter: str, seeds: tuple[int, ...], read) -> dict:
    """The path every transport must match: an in-process engine where version k of `adapter`
    (random, `seeds[k]`) is published in order, then `read(engine, k)` is taken; returns {k: read}."""
    from lora_async.generator.engine import EngineSpec, VllmGenerator
    from lora_async.placement import Placement
    from lora_async.sync.transports import InprocTransport

    spec = EngineSpec(model_dir=model_dir, adapters=(adapter,), max_staleness=1, max_lora_rank=8,
                      kv_cache_gb=0.25, max_model_len=512, seed=0)
    out = {}
    with VllmGenerator(spec, Placement("cpu", None)) as engine:
        transport = InprocTransport(engine)
        for version, seed in enumerate(seeds):
            assert transport.publish(random_adapter(model_dir, adapter, version, seed=seed)).transport == "inproc"
            out[version] = read(engine, version)
    assert out[0] != out[1]  # the two versions answer differently, so a stale one would show
    return out


def publish(engine, version: AdapterVersion) -> PublishStats:
    """The in-process path a training run takes (validate, tensors lent to the worker, register)."""
    from lora_async.sync.transports import InprocTransport

    return InprocTransport(engine).publish(version)


def generate(generator, request: GenRequest, timeout: float = 120.0) -> GenResult:
    return blocking_generate(generator, request, timeout)


def submit_many(generator, requests: list[GenRequest], timeout: float = 120.0) -> list[GenResult]:
    """Submit all at once (they share engine batches); wait for every result."""
    results: list[GenResult | None] = [None] * len(requests)
    remaining = threading.Semaphore(0)

    for i, request in enumerate(requests):
        def on_done(result: GenResult, i: int = i) -> None:
            results[i] = result
            remaining.release()

        generator.submit(request, on_done)
    for _ in requests:
        assert remaining.acquire(timeout=timeout), "generation timed out"
    return results  # type: ignore[return-value]


PROMPTS = [[1, 510, 2114, 314, 260, 1372], [1, 22, 3320, 4217, 3106], [1, 17, 28, 39, 410, 511, 612]]
