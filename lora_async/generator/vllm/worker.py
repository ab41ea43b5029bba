"""The receiving half inside vLLM's worker: register adapter versions from tensors.

Why: vLLM has no public API to register a LoRA adapter from tensors; it only loads from a path
(`WorkerLoRAManager._load_adapter` -> `LoRAModel.from_local_checkpoint`). This class is mixed
into vLLM's worker (`worker_extension_cls`) and reached through `collective_rpc` (only ever by
`client.EngineClient`). It builds the `LoRAModel` with `LoRAModel.from_lora_tensors` (what
`_load_adapter` does after reading the files) and puts it in the worker's adapter cache under a
fresh int id. A request that later names that id finds it registered and never touches
`lora_path`. Every cross-process transport's receiving half (`handoff/receive.py`) ends here.
A version with the structure of one seen before is copied into a retired version's LoRAModel
and activated into a free slot directly (`hotswap.py`).

Arguments and replies are plain data, because vLLM's RPC decodes arguments without custom types
and keeps only the text of a worker's exception: a packed version's metadata arrives as
`PackMeta.to_dict()` and is rebuilt here; a transfer the worker refuses (malformed metadata,
checksum, truncation) comes back as `{"rejected": why}` and the client raises `PackError` from
it; values it refuses (NaN, Inf: checked here for borrowed tensors) as `{"invalid": why}`,
raised as `AdapterError`; success is `{"registered": n}`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

from ...handoff import PackError, PackMeta
from .hotswap import HotSwap, InvalidValues

if TYPE_CHECKING:
    import torch

Received = Callable[[PackMeta], "dict[str, torch.Tensor]"]  # a receiving half, given the version's metadata


class LoraAsyncWorkerExtension:
    """Mixed into vLLM's worker class. Method names carry a `lora_async_` prefix: vLLM refuses
    extensions whose attributes clash with the worker's own."""

    # Provided by the vLLM worker this class is mixed into (an annotation only: no attribute
    # of ours, so nothing clashes with the worker's own).
    model_runner: Any

    def _lora_async_manager(self) -> Any:
        manager = getattr(self.model_runner, "lora_manager", None)
        if manager is None:
            raise RuntimeError("LoRA is not enabled in this vLLM engine")
        return manager

    def _lora_async_swap(self) -> HotSwap:
        swap = getattr(self, "_lora_async_hotswap", None)
        if swap is None:
            swap = self._lora_async_hotswap = HotSwap()
        return swap

    def _lora_async_register(self, int_id: int, meta: dict[str, Any], receive: Received) -> dict[str, Any]:
        try:
            packed = PackMeta.from_dict(meta)
            tensors = receive(packed)
        except PackError as exc:
            return {"rejected": str(exc)}
        return self.lora_async_add_tensors(int_id, tensors, packed.peft_config)

    def lora_async_add_tensors(self, int_id: int, tensors: dict[str, torch.Tensor], peft_config: dict[str, Any],
                               borrowed: bool = False, flat: torch.Tensor | None = None,
                               structure: tuple | None = None) -> dict[str, Any]:
        """Register adapter `int_id` from tensors: owned copies the caller no longer touches, or
        (`borrowed`, an in-process sender) the sender's own, copied here and value-checked;
        `flat`: the one buffer they are views of, in order (copied with one op when it can);
        `structure`: their `AdapterVersion.structure`, from an in-process sender.

        Never evicts: the caller sizes the cache and retires versions itself, so a live version
        is never lazily reloaded from its (fake) path. An id registered here before is refused,
        even after its removal (vLLM keys caches by id)."""
        manager = self._lora_async_manager()
        try:
            self._lora_async_swap().add(manager, int_id, tensors, peft_config, borrowed, flat, structure)
        except InvalidValues as exc:
            return {"invalid": str(exc)}
        return {"registered": len(manager._adapter_manager)}

    def lora_async_add_shm(self, int_id: int, segment: str, meta: dict[str, Any]) -> dict[str, Any]:
        """Register from a POSIX shared-memory segment the sender owns (one copy out of it)."""
        from lora_async.handoff.receive import receive_shm

        return self._lora_async_register(int_id, meta, lambda packed: receive_shm(segment, packed))

    def lora_async_add_ipc(self, int_id: int, handle: bytes, meta: dict[str, Any]) -> dict[str, Any]:
        """Register from a CUDA IPC handle to the sender's packed buffer (one copy out of it)."""
        from lora_async.handoff.receive import receive_ipc

        return self._lora_async_register(int_id, meta, lambda packed: receive_ipc(handle, packed))

    def lora_async_join_group(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> int:
        """Join the sender's dedicated process group as rank 1 + this worker's rank."""
        from lora_async.handoff.receive import CollectiveReceiver

        rank = 1 + int(getattr(self, "rank", 0))
        device = str(getattr(self, "device", "cpu")) if backend == "nccl" else "cpu"
        self._lora_async_receiver = CollectiveReceiver(host, port, rank, world_size, backend, timeout_s, device)
        return rank

    def lora_async_add_broadcast(self, int_id: int, meta: dict[str, Any]) -> dict[str, Any]:
        """Receive one broadcast of a packed adapter from the sender (rank 0), then register it."""
        receiver = getattr(self, "_lora_async_receiver", None)
        if receiver is None:
            raise RuntimeError("this worker has not joined a lora-async process group")
        return self._lora_async_register(int_id, meta, receiver.receive)

    def lora_async_remove(self, int_id: int) -> bool:
        """Remove a retired version (nothing in flight uses it); its LoRAModel may be recycled."""
        return self._lora_async_swap().remove(self._lora_async_manager(), int_id)

    def lora_async_hotswap_stats(self) -> dict[str, int]:
        """How versions were registered: built, recycled, and activated by us or by vLLM."""
        swap = self._lora_async_swap()
        return {**dataclasses.asdict(swap.stats), "spares": sum(len(s) for s in swap.spares.values())}

    def lora_async_list(self) -> list[int]:
        return sorted(self._lora_async_manager().list_adapters())

    def lora_async_pid(self) -> int:
        """The worker's process id (where the engine really runs)."""
        import os

        return os.getpid()

    def lora_async_install_fast_ops(self) -> bool:
        """Install the grouped CPU LoRA ops in this (worker) process."""
        from .cpu_lora_ops import install_fast_cpu_lora_ops

        return install_fast_cpu_lora_ops()

    def lora_async_load_base_weights(self, state_dict: dict) -> int:
        """A full-weight sync, for comparison (benchmark only): the whole base state dict goes
        through vLLM's in-place reload (`load_weights` plus kernel re-processing). vLLM drops
        its LoRA state afterwards, so the generator must not be used for adapters after this."""
        self.model_runner.reload_weights(weights_iterator=iter(state_dict.items()))
        return len(state_dict)
