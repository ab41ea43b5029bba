"""Test helpers: random adapters for the tiny model, blocking generation, waiting for a condition."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import torch

from lora_async.adapter_version import AdapterVersion, peft_config_dict
from lora_async.bench.common import blocking_generate
from lora_async.generator.types import GenRequest, GenResult, PublishStats


def random_adapter(model_dir: Path, adapter: str, version: int, seed: int, scale: float = 1.0,
                   rank: int = 8, gathered: bool = False, **peft_kwargs) -> AdapterVersion:
    """A peft LoRA with random A and B (so it visibly changes outputs), as an AdapterVersion:
    separate tensors, or (`gathered`) views of one buffer, as the learner hands a version over."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

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


def fleet_config(tiny_model: Path, max_staleness: int = 1):
    """A 3-adapter fleet on the tiny model, as a run would configure it."""
    from lora_async.config import TrainConfig

    return TrainConfig.model_validate({
        "model": {"name": str(tiny_model)},
        "generator": {"kv_cache_gb": 0.25, "max_model_len": 512, "max_batched_tokens": 384},
        "buffer": {"mode": "async" if max_staleness else "sync", "max_staleness": max_staleness},
        "adapters": [{"name": name, "task": {"type": "arithmetic"}} for name in ("a", "b", "c")]})


GREEDY = dict(temperature=0.0, n=1)


def first_token(result: GenResult) -> tuple[int, float]:
    sample = result.samples[0]
    return sample.token_ids[0], sample.logprobs[0]


def greedy(engine, adapter: str | None, prompt: list[int], max_tokens: int = 6) -> GenResult:
    return generate(engine, GenRequest(prompt, adapter, max_tokens=max_tokens, **GREEDY))


def next_version(engine, adapter: str) -> int:
    newest = engine.registry.newest(adapter)
    return 0 if newest is None else newest + 1


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


def wait_for(condition, timeout_s: float, what: str, poll_s: float = 0.05):
    """Wait until `condition()` is truthy and return its value; fail naming `what` after `timeout_s`.
    What a test waits on before it asserts or acts, instead of a sleep that guesses how long it takes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)


RUN_TIMEOUT_S = 900.0  # a training subprocess's start and first steps: only a hang takes this long, even loaded
# A training subprocess run to its end (a Ray run's 120 steps took 600 s under `make test-stress`):
# only a hang takes this long, even loaded; pytest's --timeout stays the backstop.
WHOLE_RUN_TIMEOUT_S = 1800.0


def wait_for_run(proc, condition, what: str, timeout_s: float = RUN_TIMEOUT_S) -> None:
    """`wait_for` while the training subprocess `proc` runs: fail with the end of its stderr if it
    exits first."""
    def ready() -> bool:
        if condition():
            return True
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr is not None else ""
            err = err.decode(errors="replace") if isinstance(err, bytes) else err
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}: {err[-3000:]}")
        return False

    wait_for(ready, timeout_s, what, poll_s=0.2)


async def wait_for_async(condition, timeout_s: float, what: str, poll_s: float = 0.005):
    """`wait_for` inside an event loop: the loop runs on while `condition()` is polled."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(poll_s)
