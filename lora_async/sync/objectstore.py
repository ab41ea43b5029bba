"""The `ray` transport: a version is packed once and `ray.put` once into Ray's object store.

Every replica of a `RayGenerator` then registers it from there (`RayGenerator.add_object`):
Ray hands the buffer to a replica on the same node without a copy, and moves it once to each
other node. Each replica checks the checksum and copies the tensors out once (vLLM scales
`lora_B` in place). The object lives while its version is live (the generator holds the ref),
so a replica that restarts or falls behind catches up from the same object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .pack import PackedAdapter
from .transports import Loader, PackingTransport

if TYPE_CHECKING:
    from ..generator.ray.generator import RayGenerator


class RayTransport(PackingTransport):
    name = "ray"

    def __init__(self, generator: "RayGenerator", checksum: bool = True, timeout_s: float = 120.0) -> None:
        super().__init__(generator, checksum, timeout_s)  # type: ignore[arg-type]

    def _loader(self, packed: PackedAdapter, meta: dict) -> Loader:
        import ray

        ref = ray.put(packed.buffer.numpy())  # the one copy on this side: into the object store
        return lambda generator, int_id: generator.add_object(ref, meta)
