"""The generator: vLLM serving many adapter versions at once.

`types` is the contract (`Generator` protocol, requests, typed results, deliveries);
`receivers` what a delivery loads a version into, one protocol per engine home;
`engine.VllmGenerator` owns an in-process vLLM engine; `server.ServerGenerator` drives remote
`vllm serve` replicas (`server.command`: the command line they are started with);
`ray.generator.RayGenerator` runs engine replicas as Ray actors; `registry` (the version
bookkeeping and the one register routine), `spec` and `validate` are what they share; `vllm/`
is the one place that touches vLLM itself.

Nothing here imports `sync/` (the senders): what both sides share is in `handoff/`. Nor the
learner: an adapter version and the name it is served under are `lora_async.adapter_version`'s,
and a generator that serves the learner's dequantised base is handed its recipe and what builds
it (`make_generator`'s `base`, a `types.LearnerBase`), which a Ray replica on another node runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Union

from .receivers import EngineReceiver, ReplicaReceiver, ServerReceiver
from .types import (Delivery, GenRequest, GenResult, Generator, GeneratorDead, GeneratorStats, GenStatus, LearnerBase,
                    PublishStats, Sample, generate_async)

__all__ = ["Delivery", "GenRequest", "GenResult", "Generator", "GeneratorDead", "GeneratorStats", "GenStatus",
           "LearnerBase", "PublishStats", "RunGenerator", "Sample", "generate_async", "make_generator"]

if TYPE_CHECKING:
    from ..config import TrainConfig
    from ..placement import Placement

# What `make_generator` builds: a generator whose receiver is one engine home's (the config pairs
# it with a transport that needs that receiver).
RunGenerator = Union[Generator[EngineReceiver], Generator[ServerReceiver], Generator[ReplicaReceiver]]


def make_generator(config: "TrainConfig", model_dir: Path, placement: "Placement",
                   base: LearnerBase | None = None, kept: int = 0) -> RunGenerator:
    """The generator `[generator]` names: an engine of our own ("vllm"), remote servers ("server"),
    or engine replicas on Ray ("ray"), serving `model_dir`. `base`: when the run serves the
    learner's dequantised base, its recipe and what builds it (`types.LearnerBase`): a Ray replica
    on a node without `model_dir` builds it there; servers cannot build it, so they are checked to
    serve it. `kept`: the frozen versions the run's games keep registered (an engine of our own's
    LoRA slots)."""
    from ..config import RayGeneratorConfig, ServerGeneratorConfig, VllmGeneratorConfig

    gen = config.generator
    match gen:
        case VllmGeneratorConfig():
            from ..progress import stage
            from .engine import EngineSpec, VllmGenerator

            with stage(f"starting the vLLM engine ({placement.device})"):
                return VllmGenerator(EngineSpec.from_config(config, model_dir, placement.device, kept=kept), placement)
        case ServerGeneratorConfig():
            from .server import ServerGenerator

            base_command = None if base is None else base.recipe.server_command(config.model.name)
            return ServerGenerator.from_config(config, gen, model_dir, base_command)
        case RayGeneratorConfig():
            from .ray.generator import RayGenerator

            return RayGenerator.from_config(config, gen, model_dir, base)
    raise TypeError(f"no generator for {type(gen).__name__}")
