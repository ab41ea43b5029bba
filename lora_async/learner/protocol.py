"""`LearnerAPI`: what a training run needs of a learner (`Learner`, `ParallelLearner`, or a
test's fake). Kept free of torch so the orchestrator and checkpoints can name it cheaply."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Protocol

if TYPE_CHECKING:
    import torch

    from ..adapter_version import AdapterVersion
    from ..buffer import TrainSample
    from .step import StepStats


class LearnerAPI(Protocol):
    """Every method runs on the learner's own thread (the learner is not thread-safe)."""

    @property
    def adapters(self) -> Mapping[str, object]:
        """The adapters it trains, by name (what each holds is the learner's own)."""

    def version(self, adapter: str) -> int: ...
    def adapter_version(self, adapter: str) -> "AdapterVersion": ...
    def adapter_tensors(self, adapter: str) -> "dict[str, torch.Tensor]": ...
    def peft_config(self, adapter: str) -> dict: ...
    def fits(self, samples: "list[TrainSample]") -> bool: ...
    def train_step(self, adapter: str, samples: "list[TrainSample]") -> "StepStats": ...
    def snapshot_logprobs(self, version: "AdapterVersion", samples: "list[TrainSample]") -> list[list[float]]: ...

    # ---- checkpoints (`checkpoint.py`)
    def state_dict(self, adapter: str) -> dict[str, Any]: ...
    def load_state_dict(self, adapter: str, state: dict[str, Any]) -> None: ...
    def load_adapter_tensors(self, adapter: str, tensors: "dict[str, torch.Tensor]") -> None: ...

    def close(self) -> None:
        """Called once on the learner thread at the end of a run (a data-parallel learner ends its ranks)."""
