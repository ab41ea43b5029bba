"""Held-out evaluation: greedy completions through a generator, scored by the task's reward.

`evaluate` runs inside a training run (on its generator) and in `lora-async eval`, which starts
an engine of its own (`eval_engine`) and scores the base model and, optionally, a stored
adapter; on a fleet config, on the task of the adapter it is asked about.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterator

from .envs.episode import EpisodeSettings, Trajectory
from .envs.source import EnvSource
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
    extra: dict[str, float] = field(default_factory=dict)  # environments: turns, tool calls


async def evaluate_task(generate: Callable[[GenRequest], Awaitable[GenResult]], tokenizer: Any,
                        task: "Task | EnvSource", spec: "AdapterSpec", config: "TrainConfig", adapter: str | None,
                        limit: int = 0) -> EvalResult:
    """Held-out evaluation of `adapter` (None = the base) on an adapter's task: greedy
    completions for a single-turn task, greedy episodes for an environment."""
    if isinstance(task, EnvSource):
        return await evaluate_episodes(generate, tokenizer, task, task.heldout()[: limit or None], adapter,
                                       EpisodeSettings.for_adapter(config, spec, greedy=True))
    return await evaluate(generate, tokenizer, task, task.heldout()[: limit or None], adapter, spec.eval_max_tokens)


async def evaluate_episodes(generate: Callable[[GenRequest], Awaitable[GenResult]], tokenizer: Any,
                            source: EnvSource, indices: list[int], adapter: str | None,
                            settings: EpisodeSettings) -> EvalResult:
    """Greedy episodes on the held-out split: success rate (`accuracy`), turns and tool use."""
    played = await asyncio.gather(*(source.play(i, "eval", tokenizer, settings, generate, adapter, None)
                                    for i in indices), return_exceptions=True)
    failed = next((p for p in played if isinstance(p, BaseException)), None)
    if failed is not None:
        raise RuntimeError(f"evaluation episode failed: {failed}")
    episodes: list[Trajectory] = list(played)  # type: ignore[arg-type]
    n = len(episodes)

    def mean(values: list[float]) -> float:
        return sum(values) / n if n else 0.0

    versions = [v for t in episodes for v, trained in zip(t.versions, t.trained) if trained]
    return EvalResult(
        adapter=adapter, version=max(versions) if adapter is not None and versions else None,
        accuracy=mean([float(t.success) for t in episodes]),
        mean_reward=mean([t.reward for t in episodes]), n=n,
        examples=[transcript(t) for t in episodes[:EXAMPLES]],
        extra={"turns_mean": mean([t.turns for t in episodes]), "tool_calls_mean": mean([t.tool_calls for t in episodes]),
               "tool_call_rate": mean([float(t.tool_calls > 0) for t in episodes]),
               "env_errors": sum(t.outcome == "env_error" for t in episodes),
               "truncated_episodes": sum(t.outcome == "truncated" for t in episodes)})


def transcript(t: Trajectory) -> tuple[str, str, str]:
    """(the opening's last user message, the conversation after it, the outcome)."""
    opening = next((m["content"] for m in reversed(t.messages[: t.opened]) if m["role"] == "user"), "")
    lines = [f"[{m['role']}] {m['content']}" for m in t.messages[t.opened:]]
    return opening, "\n".join(lines), f"{t.outcome}, reward {t.reward:g}"


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

    def run(self, task: "Task | EnvSource", spec: "AdapterSpec", config: "TrainConfig", adapter: str | None,
            limit: int = 0) -> EvalResult:
        return asyncio.run(evaluate_task(generate_async(self.generator), self.tokenizer, task, spec, config, adapter,
                                         limit))


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
    # A Ray run's evaluation engine is a local one, on this machine's own choice of device.
    device = config.generator.device if config.generator.engine_here else "auto"
    placement = resolve(device, None, config.learner.device, None, concurrent=False)[0]
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
            task = make_task(spec.task, config.run.seed, spec.task_path)
            try:
                if not task.heldout():
                    raise ValueError(f"{spec.name}: the task has no held-out problems (set its heldout)")
                runs = [(None, "base")] + ([(EVAL_ADAPTER, str(adapter_dir))] if adapter_dir is not None else [])
                for adapter, label in runs:
                    result = engine.run(task, spec, config, adapter, limit)
                    results.append({"adapter": spec.name, "task": spec.task.type, "model": label,
                                    "accuracy": result.accuracy, "mean_reward": result.mean_reward,
                                    "n": result.n, "examples": result.examples, **result.extra})
            finally:
                task.close()
    return {"model": config.model.name, "results": results}
