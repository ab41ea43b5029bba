"""One engine and one learner for many training runs in one process (`SharedParts`).

A benchmark that crosses losses, lags and seeds runs dozens of short trainings of one model.
Each would spend 20-40 s starting vLLM and loading the base; here they are built once, and each
run (an *arm*) gets `orchestrator.Parts` that hand out the same two, under its own adapter name:

- the learner gains a fresh adapter per arm, initialised from the arm's seed exactly as a new
  learner's first adapter is (`Learner.add_adapter`), with its own optimizer and the arm's loss
  and `learner.lr_scale`; the next arm deletes it;
- the engine serves the arm's versions under the arm's name (names and int ids are never
  reused, so no cache can serve another arm's weights); when the arm ends, every version of it
  is retired (`VllmGenerator.retire_adapter`).

The engine's LoRA slots are sized for the widest staleness window of any arm, and both halves
share the cores: arms at a fixed lag take turns, like sync ones (`BufferConfig.concurrent_from_start`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import torch
from rich.console import Console

from ..adapter_version import AdapterVersion
from ..buffer import TrainSample
from ..config import TrainConfig
from ..generator.engine import VllmGenerator
from ..generator.receivers import EngineReceiver
from ..generator.types import Delivery, GenRequest, GenResult, GeneratorStats, PublishStats
from ..learner.learner import Learner
from ..learner.step import StepStats
from ..orchestrator.lifecycle import LocalParts
from ..sync.transports import Transport
from ..tokenizer import Tokenizer

T = TypeVar("T")


class ArmGenerator:
    """The shared engine as one arm's run sees it: closing it retires the arm's versions only."""

    def __init__(self, engine: VllmGenerator, adapter: str) -> None:
        self.engine, self.adapter = engine, adapter

    @property
    def stats(self) -> GeneratorStats:
        return self.engine.stats

    @property
    def serving_dtype(self) -> str:
        return self.engine.serving_dtype

    def submit(self, request: GenRequest, on_done: Callable[[GenResult], None]) -> None:
        self.engine.submit(request, on_done)

    def validate(self, version: AdapterVersion, values: bool = True) -> None:
        self.engine.validate(version, values)

    def register(self, delivery: Delivery[EngineReceiver]) -> PublishStats:
        return self.engine.register(delivery)

    def with_receiver(self, fn: Callable[[EngineReceiver], T]) -> T:
        return self.engine.with_receiver(fn)

    def abort_older(self, adapter: str, min_version: int, tag: object) -> None:
        self.engine.abort_older(adapter, min_version, tag)

    def live_versions(self, adapter: str) -> list[int]:
        return self.engine.live_versions(adapter)

    def keep(self, adapter: str, version: int) -> None:
        self.engine.keep(adapter, version)

    def let_go(self, adapter: str, version: int) -> None:
        self.engine.let_go(adapter, version)

    def close(self) -> None:
        self.engine.retire_adapter(self.adapter)


class ArmLearner:
    """The shared learner as one arm's run sees it: closing it deletes the arm's adapter."""

    def __init__(self, learner: Learner, adapter: str) -> None:
        self.learner, self.adapter = learner, adapter
        self.adapters: Mapping[str, object] = learner.adapters  # the arm's alone: each arm removes its own

    def version(self, adapter: str) -> int:
        return self.learner.version(adapter)

    def adapter_version(self, adapter: str) -> AdapterVersion:
        return self.learner.adapter_version(adapter)

    def adapter_tensors(self, adapter: str) -> dict[str, torch.Tensor]:
        return self.learner.adapter_tensors(adapter)

    def peft_config(self, adapter: str) -> dict:
        return self.learner.peft_config(adapter)

    def fits(self, samples: list[TrainSample]) -> bool:
        return self.learner.fits(samples)

    def train_step(self, adapter: str, samples: list[TrainSample]) -> StepStats:
        return self.learner.train_step(adapter, samples)

    def snapshot_logprobs(self, version: AdapterVersion, samples: list[TrainSample]) -> list[list[float]]:
        return self.learner.snapshot_logprobs(version, samples)

    def state_dict(self, adapter: str) -> dict[str, Any]:
        return self.learner.state_dict(adapter)

    def load_state_dict(self, adapter: str, state: dict[str, Any]) -> None:
        self.learner.load_state_dict(adapter, state)

    def load_adapter_tensors(self, adapter: str, tensors: dict[str, torch.Tensor]) -> None:
        self.learner.load_adapter_tensors(adapter, tensors)

    def close(self) -> None:
        """Nothing yet: the run still reads the adapter's version for its summary. The next arm's
        `SharedParts.learner` deletes it."""


class SharedParts:
    """The engine and the learner every arm shares; `arm(config)` gives one arm's `Parts`.

    `config` is the widest arm's (its staleness window sizes the engine's LoRA slots). Arms may
    differ from it in the adapter name, the loss, `learner.lr_scale`, the seed and the buffer's
    mode and lag; nothing that shapes the model or the engine."""

    def __init__(self, config: TrainConfig, console: Console, out_dir: Path) -> None:
        if config.generator.type != "vllm" or config.generator.engine_home != "same":
            raise ValueError("generator: runs share an engine only in this process (generator.type = \"vllm\", "
                             "engine_process = \"same\")")
        if config.learner.devices is not None and len(config.learner.devices) > 1:
            raise ValueError("learner.devices: runs share one learner; a data-parallel one is not supported here")
        self.local = LocalParts(config, console, out_dir)
        self.learner_placement = self.local.learner_placement
        self._tokenizer: Tokenizer | None = None
        self._engine: VllmGenerator | None = None
        self._learner: Learner | None = None

    def arm(self, config: TrainConfig) -> "ArmParts":
        return ArmParts(self, config)

    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = self.local.tokenizer()
        return self._tokenizer

    def engine(self) -> VllmGenerator:
        if self._engine is None:
            engine = self.local.generator()
            assert isinstance(engine, VllmGenerator), "generator.type = 'vllm' builds a VllmGenerator"
            self._engine = engine
        return self._engine

    def learner(self, config: TrainConfig) -> Learner:
        """The learner with `config`'s adapter added (built with it the first time), the previous
        arm's adapter deleted."""
        spec = config.adapter_specs[0]
        if self._learner is None:
            self._learner = Learner(self.local.model_dir, {spec.name: (spec.lora, spec.lr)}, config.learner,
                                    config.loss, self.learner_placement, spec.sampling.temperature,
                                    config.run.seed, config.model.quantization)
            return self._learner
        previous = list(self._learner.adapters)
        self._learner.add_adapter(spec.name, spec.lora, spec.lr, spec.sampling.temperature, config.run.seed)
        self._learner.set_objective(config.loss, config.learner.lr_scale)
        for name in previous:
            self._learner.remove_adapter(name)
        return self._learner

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        self._learner = None


class ArmParts:
    """`orchestrator.Parts` for one arm: the shared engine and learner under the arm's adapter."""

    def __init__(self, shared: SharedParts, config: TrainConfig) -> None:
        self.shared, self.config = shared, config
        self.learner_placement = shared.learner_placement
        self.adapter = config.adapter_names[0]

    def describe(self) -> str:
        return self.shared.local.describe()

    def tokenizer(self) -> Tokenizer:
        return self.shared.tokenizer()

    def generator(self) -> ArmGenerator:
        return ArmGenerator(self.shared.engine(), self.adapter)

    def transport(self, generator: Any) -> Transport:
        from ..sync.factory import make_transport

        return make_transport(self.config, generator, self.learner_placement.device, self.shared.local.out_dir)

    def learner(self) -> ArmLearner:
        return ArmLearner(self.shared.learner(self.config), self.adapter)
