"""The `nccl` transport: one broadcast of the packed adapter over a process group of our own.

Rank 0 is the learner; ranks 1.. are vLLM's workers, which join through the worker extension.
`backend='nccl'` between GPUs; `backend='gloo'` runs the same code on CPU. The group is not
torch's default group (vLLM's workers use that one).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import TYPE_CHECKING, Any

import torch

from .pack import PackedAdapter
from ..process_groups import broadcast, make_group, make_store
from .transports import Loader, PackingTransport, TransportError

if TYPE_CHECKING:
    from ..generator.engine import VllmGenerator

log = logging.getLogger(__name__)

JOIN_GRACE_S = 5.0  # beyond the transport timeout, how long a broadcast thread gets to finish


class CollectiveTransport(PackingTransport):
    def __init__(self, generator: "VllmGenerator", backend: str = "nccl", device: str = "cpu",
                 checksum: bool = True, timeout_s: float = 60.0, host: str = "127.0.0.1") -> None:
        if backend == "nccl" and (not device.startswith("cuda") or not torch.cuda.is_available()):
            raise TransportError("sync.backend 'nccl' needs the learner on a GPU (learner.device = 'cuda:N'); "
                                 "use sync.backend = 'gloo' on CPU")
        super().__init__(generator, checksum, timeout_s)
        self.name = "nccl" if backend == "nccl" else "gloo"
        self.device = device if backend == "nccl" else "cpu"
        world = 1 + generator.run_in_engine(lambda client: client.workers())
        store = make_store(host, 0, world, True, timeout_s)  # port 0: the store picks a free one
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            joined = pool.submit(generator.run_in_engine,
                                 lambda client: client.join_group(host, store.port, world, backend, timeout_s))
            try:
                self.group = make_group(store, 0, world, backend, timeout_s)
                ranks = joined.result(timeout=timeout_s)
            except Exception as exc:
                raise TransportError(f"vLLM's workers did not join the {backend} group within "
                                     f"{timeout_s:.0f} s: {exc}") from exc
        log.info("%s group up: learner rank 0, workers %s", backend, ranks)

    def _loader(self, packed: PackedAdapter, meta: dict) -> Loader:
        buffer = packed.buffer
        name = f"{meta['adapter']}@v{meta['version']}"

        def load(client: Any, int_id: int) -> None:
            outcome: dict[str, BaseException] = {}

            def send() -> None:
                try:
                    broadcast(self.group, buffer)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    outcome["error"] = exc

            sender = threading.Thread(target=send, name="lora-async-broadcast", daemon=True)
            sender.start()
            try:
                client.add_broadcast(int_id, meta)
            finally:
                sender.join(self.timeout_s + JOIN_GRACE_S)
                if sender.is_alive() or "error" in outcome:
                    self._broken = f"broadcast of {name} did not complete"
                    raise TransportError(f"{self.name}: the receiver did not take {name} within "
                                         f"{self.timeout_s:.0f} s ({outcome.get('error', 'no answer')})")
        return load
