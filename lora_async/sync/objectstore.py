"""The `ray` transport: a version is packed once and `ray.put` once into Ray's object store.

Every replica of a `RayGenerator` then registers it from there (`ReplicaReceiver.add_object`):
Ray hands the buffer to a replica on the same node without a copy, and moves it once to each
other node. Each replica checks the checksum and copies the tensors out once (vLLM scales
`lora_B` in place). The object lives while its version is live (the generator holds the ref),
so a replica that restarts or falls behind catches up from the same object.
"""

from __future__ import annotations

from ..generator.receivers import ReplicaReceiver
from ..generator.types import Generator
from ..handoff.packed import PackedAdapter
from .transports import Loader, PackingTransport


class RayTransport(PackingTransport[ReplicaReceiver]):
    name = "ray"

    def __init__(self, generator: Generator[ReplicaReceiver], checksum: bool = True, timeout_s: float = 120.0) -> None:
        super().__init__(generator, checksum, timeout_s)

    def _loader(self, packed: PackedAdapter) -> Loader[ReplicaReceiver]:
        import ray

        ref = ray.put(packed.buffer.numpy())  # the one copy on this side: into the object store
        meta = packed.meta  # a PackMeta as it is: Ray pickles it

        def load(replicas: ReplicaReceiver, int_id: int) -> float:
            return replicas.add_object(ref, meta)
        return load
