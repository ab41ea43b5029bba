"""What a delivery loads a version into: one receiver protocol per engine home.

A `Delivery[R]`'s `load(receiver, int_id)` runs where its generator registers versions, with
that generator's receiver; a transport is typed against the receiver it needs, so it can only
be handed a generator that offers it (`Generator[EngineReceiver]`, ...):

| receiver          | implemented by               | the receiver of              | transports                  |
|-------------------|------------------------------|------------------------------|-----------------------------|
| `EngineReceiver`  | `vllm.client.EngineClient`   | `engine.VllmGenerator`       | inproc, shm, nccl, cuda-ipc |
| `ServerReceiver`  | `server.client.ServerClient` | `server.ServerGenerator`     | http                        |
| `ReplicaReceiver` | `ray.generator.RayGenerator` | itself (the router)          | ray                         |

Each `add_*`/`load` leaves the version registered under `int_id` or raises (`AdapterError` for
values the engine refuses, `handoff.PackError` for a damaged transfer, anything else for a
broken carrier); then nothing is registered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from ..handoff import PackMeta


class EngineReceiver(Protocol):
    """A vLLM engine of this run, on the thread that owns it, between engine steps."""

    @property
    def in_process(self) -> bool:
        """The engine shares this process's memory: tensors may be lent to it by reference."""

    def add_tensors(self, int_id: int, tensors: dict[str, torch.Tensor], peft_config: dict[str, Any],
                    borrowed: bool = False, flat: torch.Tensor | None = None, structure: tuple | None = None) -> None:
        """Tensors in this process (`borrowed`: still the caller's; the engine copies them and
        checks their values on that copy). `flat`: the one buffer they are views of, in order;
        `structure`: their `AdapterVersion.structure`."""

    def add_shm(self, int_id: int, segment: str, meta: PackMeta) -> None:
        """A packed version in the POSIX shared-memory segment `segment`, copied out once."""

    def add_ipc(self, int_id: int, handle: bytes, meta: PackMeta) -> None:
        """A packed version in another process's CUDA buffer (a pickled `reduce_tensor` handle)."""

    def join_group(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> list[int]:
        """Have every worker join a sender's process group (ranks 1..); returns their ranks."""

    def add_broadcast(self, int_id: int, meta: PackMeta) -> None:
        """A packed version broadcast by the sender (rank 0) of the group the workers joined."""

    def workers(self) -> int:
        """How many workers the engine has (each holds a copy of every version)."""


class ServerReceiver(Protocol):
    """Remote `vllm serve` replicas, through their HTTP client."""

    def load(self, served_name: str, path: str, timeout_s: float | None = None,
             retry_budget_s: float | None = None) -> None:
        """Load the PEFT directory `path` (readable by the servers) on every replica, or on none."""


class ReplicaReceiver(Protocol):
    """Engine replicas on Ray, through the router's fan-out."""

    def add_object(self, ref: Any, meta: PackMeta) -> float:
        """Register the packed version in the Ray object `ref` on every routable replica; returns
        the longest time (ms) a replica waited for its engine to finish a step."""
