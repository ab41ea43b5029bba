"""Held-out evaluation: greedy completions through a generator, scored by the task's reward.

`evaluate` runs inside a training run (on its generator) and in `lora-async eval`, which starts
an engine of its own (`eval_engine`) and scores the base model and, optionally, a stored
adapter; on a fleet config, on the task of the adapter it is asked about.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterator

from .generator.types import GenRequest, GenResult, generate_async
from .tasks import Problem, Task, render_prompt

if TYPE_CHECKING:
    from .config import AdapterSpec, TrainConfig
    from .generator.engine import VllmGenerator

GREEDY = 0.0  # vLLM treats temperature 0 as greedy decoding
EXAMPLES = 3  # (prompt, completion, answer) triples kept for display
EVAL_ADAPTER = "eval"  # the name `lora-async eval` serves an adapter directory under


@dataclass
class EvalResult:
    adapter: str | None
    version: int | None
    accuracy: float  # share of problems with reward >= 1
    mean_reward: float
    n: int
    examples: list[tuple[str, str, str]]  # (prompt, completion, answer), a few for display


async def evaluate(generate: Callable[[GenRequest], Awaitable[GenResult]], tokenizer: Any, task: Task,
                   problems: list[Problem], adapter: str | None, max_tokens: int) -> EvalResult:
    requests = [GenRequest(render_prompt(tokenizer, p.prompt, task.system_prompt), adapter, n=1,
                           max_tokens=max_tokens, temperature=GREEDY) for p in problems]
    results = await asyncio.gather(*(generate(r) for r in requests))
    failed = next((r for r in results if not r.ok or not r.samples), None)
    if failed is not None:
        raise RuntimeError(f"evaluation request failed ({failed.status.value}): {failed.error}")
    texts = [tokenizer.decode(r.samples[0].token_ids, skip_special_tokens=True) for r in results]
    # Off the event loop: a user reward runs in a subprocess and may take its time.
    rewards = await asyncio.to_thread(lambda: [task.rewards(p, [t])[0] for p, t in zip(problems, texts)])
    n = len(rewards)
    return EvalResult(
        adapter=adapter,
        version=results[-1].version if results else None,
        accuracy=sum(r >= 1.0 for r in rewards) / n if n else 0.0,
        mean_reward=sum(rewards) / n if n else 0.0,
        n=n,
        examples=[(p.prompt, t, p.answer) for p, t in zip(problems[:EXAMPLES], texts)],
    )


@dataclass
class EvalEngine:
    """An engine started for evaluation only (no training run around it)."""

    generator: "VllmGenerator"
    tokenizer: Any

    def load_dir(self, name: str, version: int, path: Path) -> None:
        """Register a PEFT directory; vLLM loads it itself, as `vllm serve --lora-modules` would."""
        self.generator.publish_dir(name, version, Path(path))

    def run(self, task: Task, problems: list[Problem], adapter: str | None, max_tokens: int) -> EvalResult:
        return asyncio.run(evaluate(generate_async(self.generator), self.tokenizer, task, problems, adapter,
                                    max_tokens))


@contextlib.contextmanager
def eval_engine(config: "TrainConfig", max_lora_rank: int,
                adapters: tuple[str, ...] = (EVAL_ADAPTER,)) -> Iterator[EvalEngine]:
    """One in-process vLLM engine on the config's model, sized for `adapters` (one version each)."""
    from transformers import AutoTokenizer

    from .generator.engine import EngineSpec, VllmGenerator
    from .models import resolve_model
    from .placement import resolve

    if config.generator.engine_home == "server":
        raise ValueError('evaluation starts its own vLLM engine: give it a config with generator.type = "vllm"')
    model_dir = resolve_model(config.model.name)
    placement = resolve(config.generator.device, None, config.learner.device, None, concurrent=False)[0]
    spec = EngineSpec.from_config(config, model_dir, placement.device, adapters=adapters, max_staleness=0,
                                  max_lora_rank=max_lora_rank, separate_process=False)
    with VllmGenerator(spec, placement) as generator:
        yield EvalEngine(generator, AutoTokenizer.from_pretrained(model_dir))


def eval_specs(config: "TrainConfig", name: str | None, adapter_dir: Path | None) -> list["AdapterSpec"]:
    """Whose tasks `lora-async eval` scores: the one adapter of a single-adapter config; in a
    fleet, the one named by `name`, or the one whose store directory holds `adapter_dir`
    (OUT/adapters/<name>/...), or, for the base model alone, every adapter's task."""
    specs = {spec.name: spec for spec in config.adapter_specs}
    if name is None and adapter_dir is not None and len(specs) > 1:
        stored_as = Path(adapter_dir).resolve().parent.name
        if stored_as not in specs:
            raise ValueError(f"the config is a fleet ({', '.join(specs)}): say whose task to evaluate "
                             f"{adapter_dir} on with --name")
        name = stored_as
    if name is not None:
        if name not in specs:
            raise ValueError(f"--name {name!r}: the config has no adapter of that name ({', '.join(specs)})")
        return [specs[name]]
    return list(specs.values())


def run_eval(config: "TrainConfig", adapter_dir: Path | None, limit: int = 0, name: str | None = None) -> dict:
    """`lora-async eval`: start an engine, evaluate the base and (optionally) one adapter."""
    from .adapters import load_peft_dir
    from .config import vllm_rank
    from .tasks import make_task

    rank = max(spec.lora.rank for spec in config.adapter_specs)
    if adapter_dir is not None:
        _, peft_config = load_peft_dir(Path(adapter_dir))  # fails early on a non-PEFT directory
        rank = int(peft_config.get("r", rank))
    specs = eval_specs(config, name, adapter_dir)
    results = []
    with eval_engine(config, vllm_rank(rank)) as engine:
        if adapter_dir is not None:
            engine.load_dir(EVAL_ADAPTER, 0, Path(adapter_dir).resolve())
        for spec in specs:
            task = make_task(spec.task, config.run.seed)
            try:
                problems = task.heldout()[: limit or None]
                if not problems:
                    raise ValueError(f"{spec.name}: the task has no held-out problems (set its heldout)")
                runs = [(None, "base")] + ([(EVAL_ADAPTER, str(adapter_dir))] if adapter_dir is not None else [])
                for adapter, label in runs:
                    result = engine.run(task, problems, adapter, spec.eval_max_tokens)
                    results.append({"adapter": spec.name, "task": spec.task.type, "model": label,
                                    "accuracy": result.accuracy, "mean_reward": result.mean_reward,
                                    "n": result.n, "examples": result.examples})
            finally:
                task.close()
    return {"model": config.model.name, "results": results}
