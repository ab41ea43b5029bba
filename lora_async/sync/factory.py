"""`make_transport`: the sender the run's `[sync]` names, bound to its generator.

The one place that matches on the sync config's kind (the config already checked that the
transport fits the generator's engine home: `SyncBase.needs` vs `engine_home`). It sits above
the transports, which import their shared base (`transports.PackingTransport`) and never this.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .transports import CudaIpcTransport, InprocTransport, ShmTransport, Transport

if TYPE_CHECKING:
    from ..config import TrainConfig
    from ..generator.types import Generator


def make_transport(config: TrainConfig, generator: Generator[Any], learner_device: str, out_dir: Path) -> Transport:
    """The sender the run's `[sync]` names (or the default for its generator), bound to `generator`."""
    from ..config import CudaIpcSync, HttpSync, InprocSync, NcclSync, RaySync, ShmSync

    sync = config.sync_config
    match sync:
        case InprocSync():
            return InprocTransport(generator)
        case ShmSync():
            return ShmTransport(generator, sync.checksum, sync.timeout_s)
        case NcclSync():
            from .collective import CollectiveTransport

            return CollectiveTransport(generator, sync.backend, learner_device, sync.checksum, sync.timeout_s)
        case CudaIpcSync():
            return CudaIpcTransport(generator, learner_device, sync.timeout_s)
        case HttpSync():
            from .http import HttpTransport

            sync_dir = Path(sync.dir) if sync.dir else out_dir / "sync"
            return HttpTransport(generator, sync_dir, sync.timeout_s, sync.retry_budget_s)
        case RaySync():
            from .objectstore import RayTransport

            return RayTransport(generator, sync.checksum, sync.timeout_s)
    raise TypeError(f"no transport for {type(sync).__name__}")
