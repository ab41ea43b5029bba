"""`lora-async eval`: held-out evaluation on an engine of its own.

How a task is evaluated is its rollout source's (`rollout.RolloutSource.evaluate`: greedy
completions scored by the reward, or greedy episodes); a training run asks it on its own
generator. Here `eval_engine` starts an engine, and `run_eval` scores the base model and,
optionally, a stored adapter; on a fleet config, on the task of the adapter it is asked about.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from .generator.types import generate_async
from .rollout import EvalResult, RolloutSource
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .config import AdapterSpec, TrainConfig
    from .generator.engine import VllmGenerator

EVAL_ADAPTER = "eval"  # the name `lora-async eval` serves an adapter directory under


@dataclass
class EvalEngine:
    """An engine started for evaluation only (no training run around it)."""

    generator: "VllmGenerator"
    tokenizer: Tokenizer

    def load_dir(self, name: str, version: int, path: Path) -> None:
        """Register a PEFT directory; vLLM loads it itself, as `vllm serve --lora-modules` would."""
        self.generator.publish_dir(name, version, Path(path))

    def run(self, source: RolloutSource, adapter: str | None, limit: int = 0) -> EvalResult:
        """Evaluate `adapter` (None: the base) on `source`'s held-out split."""
        return self.run_many(source, [adapter], limit)[0]

    def run_many(self, source: RolloutSource, adapters: list[str | None], limit: int = 0) -> list[EvalResult]:
        """Evaluate each of `adapters` at once: their episodes share the engine's batches (a
        multi-LoRA batch), and one's tool calls overlap another's decoding."""
        from .progress import stage

        generate = generate_async(self.generator)
        each = min(limit, source.heldout_size) if limit else source.heldout_size
        names = ", ".join(a or "the base" for a in adapters)

        async def all_of() -> list[EvalResult]:
            with stage(f"eval {names}: {each} held-out problems each", each * len(adapters)) as progress:
                return list(await asyncio.gather(*(source.evaluate(generate, self.tokenizer, a, limit, progress.advance)
                                                   for a in adapters)))

        return asyncio.run(all_of())


@contextlib.contextmanager
def eval_engine(config: "TrainConfig", max_lora_rank: int,
                adapters: tuple[str, ...] = (EVAL_ADAPTER,)) -> Iterator[EvalEngine]:
    """One in-process vLLM engine on the config's model, sized for `adapters` (one version each)."""
    from transformers import AutoTokenizer

    from .generator.engine import EngineSpec, VllmGenerator
    from .learner.served_base import generator_base
    from .models import resolve_model
    from .placement import place_run, resolve
    from .progress import stage
    from .staleness import StalenessWindow

    if config.engine_settings is None:  # running servers: the config says nothing of how to build an engine
        raise ValueError('evaluation starts its own vLLM engine: give it a config with generator.type = "vllm"')
    model_dir = resolve_model(config.model.name)
    # A quantised learner's adapters are evaluated on the base their run served: the learner's own.
    base_dir, _ = generator_base(config, model_dir, place_run(config)[1][0].device)
    # A Ray run's evaluation engine is a local one, on this machine's own choice of device.
    local = config.local_engine
    device = local.device if local is not None else "auto"
    placement = resolve(device, None, config.learner.device, None, concurrent=False)[0]
    spec = EngineSpec.from_config(config, base_dir, placement.device, adapters=adapters, window=StalenessWindow(0),
                                  max_lora_rank=max_lora_rank, separate_process=False)
    with stage(f"starting the vLLM engine ({placement.device})"):
        generator = VllmGenerator(spec, placement)
    with generator:
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
    from .tasks import make_source

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
            source = make_source(spec, config, config.run.seed)
            try:
                if not source.heldout_size:
                    raise ValueError(f"{spec.name}: the task has no held-out problems (set its heldout)")
                runs = [(None, "base")] + ([(EVAL_ADAPTER, str(adapter_dir))] if adapter_dir is not None else [])
                for adapter, label in runs:
                    result = engine.run(source, adapter, limit)
                    results.append({"adapter": spec.name, "task": spec.task.type, "model": label,
                                    "accuracy": result.accuracy, "mean_reward": result.mean_reward,
                                    "n": result.n, "examples": result.examples, **result.extra})
            finally:
                source.close()
    return {"model": config.model.name, "results": results}
