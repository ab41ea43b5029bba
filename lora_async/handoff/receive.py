"""The receiving half of every cross-process transport: torch only, no vLLM.

Each function ends with tensors the receiver owns (one copy out of the transport's memory),
after the checksum and bounds checks of `packed.unpack_views`. The vLLM worker extension and
the Ray replicas call these; the GPU transport check (`bench/gpu_transport_check.py`) calls
them without vLLM.
"""

from __future__ import annotations

import pickle

import torch

from ..process_groups import broadcast, make_group, make_store
from .packed import PackedAdapter, PackError, PackMeta, unpack_views


def _owned(meta: PackMeta, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views into `buffer` (which must already be the receiver's own copy), checked."""
    return unpack_views(PackedAdapter.received(meta, buffer))


def receive_shm(segment: str, meta: PackMeta) -> dict[str, torch.Tensor]:
    """Copy a packed adapter out of the POSIX shared-memory segment `segment`.

    Opened with `shm_open` + `mmap` directly: `multiprocessing.shared_memory` would register
    the segment with a resource tracker that vLLM's child processes share with the sender."""
    import mmap
    import os

    import _posixshmem
    import numpy as np

    nbytes = meta.nbytes
    try:
        fd = _posixshmem.shm_open("/" + segment.lstrip("/"), os.O_RDONLY, mode=0)
    except FileNotFoundError as exc:
        raise PackError(f"shared-memory segment {segment!r} is gone") from exc
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise PackError(f"truncated buffer: segment holds {size} bytes, expected {nbytes}")
        mapped = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ) if nbytes else None
    finally:
        os.close(fd)
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if mapped is not None:
        source = np.frombuffer(mapped, dtype=np.uint8, count=nbytes)
        buffer.numpy()[:] = source  # the one copy: out of shared memory into our own buffer
        del source
        mapped.close()
    return _owned(meta, buffer)


def receive_object(meta: PackMeta, array: object) -> dict[str, torch.Tensor]:
    """Copy a packed adapter out of a Ray object (a read-only uint8 array, zero-copy from the
    object store on the receiver's node) into a buffer of our own."""
    import numpy as np

    if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 1:
        raise PackError(f"the object is not a packed adapter buffer ({type(array).__name__})")
    buffer = torch.empty(array.size, dtype=torch.uint8)
    buffer.numpy()[:] = array  # the one copy: out of the object store
    return _owned(meta, buffer)


def receive_ipc(handle: bytes, meta: PackMeta, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Copy a packed adapter out of another process's CUDA buffer (a `reduce_tensor` handle).

    The sender keeps its buffer alive until this returns."""
    rebuild, args = pickle.loads(handle)
    source = rebuild(*args)
    buffer = source.to(device, copy=True)
    del source
    return _owned(meta, buffer)


class CollectiveReceiver:
    """One member (rank >= 1) of the sender's dedicated process group; receives broadcasts."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str,
                 timeout_s: float, device: str = "cpu") -> None:
        self.rank, self.device = rank, device
        store = make_store(host, port, world_size, False, timeout_s)
        self.group = make_group(store, rank, world_size, backend, timeout_s)

    def receive(self, meta: PackMeta) -> dict[str, torch.Tensor]:
        buffer = torch.empty(meta.nbytes, dtype=torch.uint8, device=self.device)
        broadcast(self.group, buffer)
        if buffer.device.type != "cpu":
            buffer = buffer.cpu()  # vLLM builds LoRA models on the CPU, then activates them
        return _owned(meta, buffer)
