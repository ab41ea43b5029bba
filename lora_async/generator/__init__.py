"""The generator: vLLM serving many adapter versions at once.

`types` is the contract (`Generator` protocol, requests, typed results, deliveries);
`engine.VllmGenerator` owns an in-process vLLM engine; `server.ServerGenerator` drives remote
`vllm serve` replicas; `ray.RayGenerator` runs engine replicas as Ray actors; `registry` and `validate` are the bookkeeping and the checks both share;
`vllm/` is the one place that touches vLLM itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .types import (AdapterVersion, Delivery, GenRequest, GenResult, Generator, GeneratorDead, GeneratorStats,
                    GenStatus, PublishStats, Sample, generate_async)

__all__ = ["AdapterVersion", "Delivery", "GenRequest", "GenResult", "Generator", "GeneratorDead",
           "GeneratorStats", "GenStatus", "PublishStats", "Sample", "generate_async", "make_generator"]

if TYPE_CHECKING:
    from ..config import TrainConfig
    from ..placement import Placement


def make_generator(config: "TrainConfig", model_dir: Path, placement: "Placement") -> Generator:
    """The generator `[generator]` names: an engine of our own ("vllm"), remote servers ("server"),
    or engine replicas on Ray ("ray")."""
    if config.generator.engine_home == "ray":
        from .ray.generator import RayGenerator

        return RayGenerator.from_config(config, model_dir)
    if config.generator.engine_home == "server":
        from .server import ServerGenerator

        return ServerGenerator.from_config(config, model_dir)
    from .engine import EngineSpec, VllmGenerator

    return VllmGenerator(EngineSpec.from_config(config, model_dir, placement.device), placement)
