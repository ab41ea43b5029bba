"""Held-out evaluation: greedy completions through the generator, scored by the task's reward."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from .generator.types import GenRequest, GenResult
from .tasks import Problem, Task, render_prompt

GREEDY = 0.0  # vLLM treats temperature 0 as greedy decoding


@dataclass
class EvalResult:
    adapter: str | None
    version: int | None
    accuracy: float  # share of problems with reward >= 1
    mean_reward: float
    n: int
    examples: list[tuple[str, str, str]]  # (prompt, completion, answer), a few for display


async def evaluate(
    generate: Callable[[GenRequest], Awaitable[GenResult]],
    tokenizer: Any,
    task: Task,
    problems: list[Problem],
    adapter: str | None,
    max_tokens: int,
) -> EvalResult:
    requests = [
        GenRequest(render_prompt(tokenizer, p.prompt, task.system_prompt), adapter, n=1,
                   max_tokens=max_tokens, temperature=GREEDY)
        for p in problems
    ]
    results = await asyncio.gather(*(generate(r) for r in requests))
    rewards: list[float] = []
    examples = []
    version = None
    for problem, result in zip(problems, results):
        if not result.ok or not result.samples:
            raise RuntimeError(f"evaluation request failed: {result.error}")
        version = result.version
        text = tokenizer.decode(result.samples[0].token_ids, skip_special_tokens=True)
        reward = task.rewards(problem, [text])[0]
        rewards.append(reward)
        if len(examples) < 3:
            examples.append((problem.prompt, text, problem.answer))
    n = len(rewards)
    return EvalResult(
        adapter=adapter,
        version=version,
        accuracy=sum(r >= 1.0 for r in rewards) / n if n else 0.0,
        mean_reward=sum(rewards) / n if n else 0.0,
        n=n,
        examples=examples,
    )


def asyncio_generate(generator: Any) -> Callable[[GenRequest], Awaitable[GenResult]]:
    """Adapt a callback generator (`submit(req, on_done)`) to `await generate(req)`."""

    def generate(request: GenRequest) -> Awaitable[GenResult]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def done(result: GenResult) -> None:
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(result))

        generator.submit(request, done)
        return future

    return generate


def run_eval(config: Any, adapter_dir: Any, limit: int = 0) -> dict:
    """`lora-async eval`: start an engine, evaluate the base and (optionally) one adapter."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from .adapters import load_peft_dir
    from .generator.vllm_engine import EngineSpec, VllmGenerator

    from .models import resolve_model
    from .placement import Placement, cuda_available
    from .tasks import make_task

    model_dir = resolve_model(config.model.name)
    task = make_task(config.task, config.run.seed)
    problems = task.heldout()[: limit or None]
    if not problems:
        raise ValueError("the task has no held-out problems (set task.heldout)")
    rank = config.lora.rank
    if adapter_dir is not None:
        _, peft_config = load_peft_dir(Path(adapter_dir))  # fails early on a non-PEFT directory
        rank = int(peft_config.get("r", rank))
    from .config import vllm_rank

    spec = EngineSpec(model_dir=model_dir, adapters=("eval",), max_staleness=0, max_lora_rank=vllm_rank(rank),
                      dtype=config.model.dtype, memory_fraction=config.generator.memory_fraction,
                      kv_cache_gb=config.generator.kv_cache_gb, max_model_len=config.generator.max_model_len,
                      seed=config.run.seed, fast_cpu_lora=config.generator.fast_cpu_lora,
                      engine_log=config.run.engine_log)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    results = []
    device = config.generator.device
    if device == "auto":
        device = "cuda:0" if cuda_available() else "cpu"
    with VllmGenerator(spec, Placement(device, None)) as generator:
        if adapter_dir is not None:
            # vLLM loads the directory itself (LoRARequest path), as `vllm serve` would.
            generator.publish_dir("eval", 0, Path(adapter_dir).resolve())

        async def both() -> list[EvalResult]:
            gen = asyncio_generate(generator)
            out = [await evaluate(gen, tokenizer, task, problems, None, config.eval_max_tokens)]
            if adapter_dir is not None:
                out.append(await evaluate(gen, tokenizer, task, problems, "eval", config.eval_max_tokens))
            return out

        for result in asyncio.run(both()):
            name = "base" if result.adapter is None else str(adapter_dir)
            results.append({"model": name, "accuracy": result.accuracy, "mean_reward": result.mean_reward,
                            "n": result.n, "examples": result.examples})
    task.close()
    return {"model": config.model.name, "task": config.task.type, "results": results}
