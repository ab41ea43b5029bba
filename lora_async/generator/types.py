"""What goes into and comes out of a generator, independent of the backend."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch


@dataclass(frozen=True)
class GenRequest:
    """One prompt, `n` samples, on one adapter (None = the base model)."""

    prompt_ids: list[int]
    adapter: str | None
    n: int = 1
    max_tokens: int = 32
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    tag: object = None  # opaque caller data, returned with the result


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]  # the sampling logprob of each token, as vLLM drew it
    finish_reason: str  # "stop" | "length" | "abort"


@dataclass
class GenResult:
    request: GenRequest
    adapter: str | None
    version: int | None  # the adapter version that produced every token of every sample
    samples: list[Sample]
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and all(s.finish_reason != "abort" for s in self.samples)


@dataclass(frozen=True)
class AdapterVersion:
    """An adapter version ready to publish: tensors (peft state-dict names) + peft config."""

    adapter: str
    version: int
    tensors: dict[str, torch.Tensor]
    peft_config: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass
class PublishStats:
    adapter: str
    version: int
    vllm_name: str
    int_id: int
    bytes: int
    ms: float  # the work: tensors ready -> registered, less the wait below
    retired: list[str] = field(default_factory=list)
    wait_ms: float = 0.0  # waiting for the engine to finish its current step (never a pause)
    transport: str = "inproc"

    @property
    def total_ms(self) -> float:
        return self.ms + self.wait_ms


class GeneratorClock:
    """What every generator backend counts, and the busy share derived from it."""

    def _start_clock(self) -> None:
        self._started_at = time.perf_counter()
        self.stats = {"requests": 0, "aborted": 0, "tokens": 0, "busy_s": 0.0, "rejected_versions": 0}

    def busy_fraction(self) -> float:
        elapsed = time.perf_counter() - self._started_at
        return self.stats["busy_s"] / elapsed if elapsed > 0 else 0.0


class Generator(Protocol):
    """A multi-LoRA generator that serves several versions of each adapter at once."""

    def submit(self, request: GenRequest, on_done: Callable[[GenResult], None]) -> None:
        """Queue a request; `on_done` runs (on the generator's thread) when it finishes."""

    def publish(self, version: AdapterVersion) -> PublishStats:
        """Register a new version beside the live ones; blocks until it can be requested."""

    def live_versions(self, adapter: str) -> list[int]:
        """Versions of `adapter` currently registered in the engine."""

    def close(self) -> None: ...
