"""Process groups of lora-async's own, beside torch's default group (which vLLM's in-process
workers own): the data-parallel learner's ranks (`learner/ranks.py`), and the `nccl`/`gloo`
transport between the learner and vLLM's workers (`sync/collective.py`, `handoff/receive.py`).
Torch only."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import torch.distributed as dist

GROUP_PREFIX = "lora-async-sync"


def make_store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store of a dedicated group. The master may pass port 0 (the store then
    binds a free port: `store.port`); it does not wait for the others here."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, world_size, is_master=is_master, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def make_group(store: dist.Store, rank: int, world_size: int, backend: str, timeout_s: float) -> Any:
    """A process group of its own (not torch's default group, which vLLM's workers use)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.PrefixStore(GROUP_PREFIX, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    raise ValueError(f"unknown process-group backend {backend!r}")


def broadcast(group: Any, buffer: torch.Tensor) -> None:
    """Rank 0's `buffer` into every other rank's `buffer` (same size), waiting for it."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([buffer], options).wait()
