"""The `nccl` transport: one broadcast of the packed adapter over a process group of our own.

Rank 0 is the learner; ranks 1.. are vLLM's workers, which join through the worker extension
(`EngineReceiver.join_group`, run where the generator registers versions: `with_receiver`).
`backend='nccl'` between GPUs; `backend='gloo'` runs the same code on CPU. The group is not
torch's default group (vLLM's workers use that one).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading

import torch

from ..generator.receivers import EngineReceiver
from ..generator.types import Generator
from ..handoff.packed import PackedAdapter
from ..process_groups import broadcast, make_group, make_store
from .transports import Loader, PackingTransport, TransportError

log = logging.getLogger(__name__)

JOIN_GRACE_S = 5.0  # beyond the transport timeout, how long a broadcast thread gets to finish


class CollectiveTransport(PackingTransport[EngineReceiver]):
    def __init__(self, generator: Generator[EngineReceiver], backend: str = "nccl", device: str = "cpu",
                 checksum: bool = True, timeout_s: float = 60.0, host: str = "127.0.0.1") -> None:
        if backend == "nccl" and (not device.startswith("cuda") or not torch.cuda.is_available()):
            raise TransportError("sync.backend 'nccl' needs the learner on a GPU (learner.device = 'cuda:N'); "
                                 "use sync.backend = 'gloo' on CPU")
        super().__init__(generator, checksum, timeout_s)
        self.name = "nccl" if backend == "nccl" else "gloo"
        self.device = device if backend == "nccl" else "cpu"
        world = 1 + generator.with_receiver(lambda engine: engine.workers())
        store = make_store(host, 0, world, True, timeout_s)  # port 0: the store picks a free one

        def join(engine: EngineReceiver) -> list[int]:
            return engine.join_group(host, store.port, world, backend, timeout_s)

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            joined = pool.submit(generator.with_receiver, join)
            try:
                self.group = make_group(store, 0, world, backend, timeout_s)
                ranks = joined.result(timeout=timeout_s)
            except Exception as exc:
                raise TransportError(f"vLLM's workers did not join the {backend} group within "
                                     f"{timeout_s:.0f} s: {exc}") from exc
        log.info("%s group up: learner rank 0, workers %s", backend, ranks)

    def _loader(self, packed: PackedAdapter) -> Loader[EngineReceiver]:
        buffer, meta = packed.buffer, packed.meta
        name = meta.served_name

        def load(engine: EngineReceiver, int_id: int) -> None:
            outcome: dict[str, BaseException] = {}

            def send() -> None:
                try:
                    broadcast(self.group, buffer)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    outcome["error"] = exc

            sender = threading.Thread(target=send, name="lora-async-broadcast", daemon=True)
            sender.start()
            try:
                engine.add_broadcast(int_id, meta)
            finally:
                sender.join(self.timeout_s + JOIN_GRACE_S)
                if sender.is_alive() or "error" in outcome:
                    self._broken = f"broadcast of {name} did not complete"
                    raise TransportError(f"{self.name}: the receiver did not take {name} within "
                                         f"{self.timeout_s:.0f} s ({outcome.get('error', 'no answer')})")
        return load
