"""Transports: how a new adapter version gets from the learner into the generator.

Each transport is a small sender behind `Transport`. It checks the version with the generator
(`validate`), moves the tensors its way, and hands the generator one `Delivery`, whose `load`
runs where the generator registers versions (`Generator.register`): the version lands under a
fresh int id beside the live ones, so generation never pauses. `make_transport` picks the
sender from the run's `[sync]` config (a union on `transport`).

| transport  | engine                            | what moves                                             |
|------------|-----------------------------------|--------------------------------------------------------|
| `inproc`   | in this process                   | tensors by reference; the worker copies them once      |
| `shm`      | own process, same host            | packed buffer in a POSIX shared-memory segment         |
| `nccl`     | own process(es), any local device | one broadcast over a dedicated group (`gloo` on CPU): collective.py |
| `cuda-ipc` | own process, same host's GPUs     | a CUDA IPC handle to the learner's packed buffer       |
| `http`     | remote `vllm serve` replicas      | a PEFT directory, loaded on every replica: http.py     |
| `ray`      | engine replicas as Ray actors     | a packed buffer put once in Ray's object store: objectstore.py |
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from ..dtypes import torch_dtype
from ..generator.types import AdapterVersion, Delivery, PublishStats
from ..generator.validate import AdapterError
from .pack import PackedAdapter, TensorMeta, layout, pack

if TYPE_CHECKING:
    from ..config import TrainConfig
    from ..generator.engine import VllmGenerator
    from ..generator.types import Generator

log = logging.getLogger(__name__)

BUFFER_HEADROOM = 5 / 4  # a reused packing buffer grows to 1.25x what it must hold (fewer regrowths)


class TransportError(RuntimeError):
    """A transport that cannot deliver (receiver gone, timed out, or broken by an earlier fault)."""


class Transport(Protocol):
    name: str

    def publish(self, version: AdapterVersion) -> PublishStats:
        """Deliver and register `version`; blocks until requests can name it."""

    def close(self) -> None: ...


Loader = Callable[[Any, int], Any]


class InprocTransport:
    """The engine lives in this process: hand the version's tensors over by reference.

    The worker borrows them for the length of the registration and makes the one copy vLLM
    keeps: into a retired version's buffers on the hot-swap path (where it also checks the
    values, with one reduction over that copy), or a copy in the serving dtype before vLLM's
    own build (vLLM keeps, and scales in place, the tensors it is given)."""

    name = "inproc"

    def __init__(self, generator: "VllmGenerator") -> None:
        if generator.spec.separate_process:
            raise TransportError("the engine runs in its own process: in-process tensors cannot reach it "
                                 "(use sync.transport 'shm', 'nccl' or 'cuda-ipc')")
        self.generator = generator

    def publish(self, version: AdapterVersion) -> PublishStats:
        started = time.perf_counter()
        self.generator.validate(version, values=False)  # the worker checks the values on its copy
        tensors, config, flat = version.tensors, version.peft_config, version.flat

        def load(client: Any, int_id: int) -> None:
            try:
                client.add_tensors(int_id, tensors, config, borrowed=True, flat=flat)
            except AdapterError as exc:
                raise AdapterError(f"{version.name}: {exc}") from None

        return self.generator.register(Delivery(version.adapter, version.version, version.nbytes, self.name,
                                                load, started))

    def close(self) -> None:
        pass


class PackingTransport:
    """Shared by the cross-process transports: validate, pack into a reused buffer, deliver.

    One publish at a time (a lock): the packed buffer is reused, and a collective must see its
    broadcasts in the same order on every rank. A transport that failed mid-transfer refuses
    further use (`_broken`): its receivers' state is unknown."""

    name = "?"
    device = "cpu"  # where the packing buffer lives

    def __init__(self, generator: "VllmGenerator", checksum: bool, timeout_s: float) -> None:
        self.generator = generator
        self.dtype = torch_dtype(generator.spec.dtype)  # tensors travel in the dtype vLLM serves
        self.checksum = checksum
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._layouts: dict[tuple, list[TensorMeta]] = {}
        self._broken: str | None = None
        self._storage: torch.Tensor | None = None

    def publish(self, version: AdapterVersion) -> PublishStats:
        if self._broken:
            raise TransportError(f"{self.name} transport is unusable after an earlier fault: {self._broken}")
        started = time.perf_counter()
        self.generator.validate(version)
        with self._lock:
            metas = self._layout(version)
            out = self._buffer(metas[-1].offset + metas[-1].nbytes if metas else 0)
            # blake3 reads host memory; device buffers (nccl, cuda-ipc) go unchecksummed
            packed = pack(version, self.dtype, with_checksum=self.checksum and out.device.type == "cpu",
                          out=out, metas=metas)
            packed.views = None  # the receiver makes its own copy; drop our views of the buffer
            return self.generator.register(Delivery(version.adapter, version.version, packed.nbytes, self.name,
                                                    self._loader(packed, packed.meta()), started))

    def _layout(self, version: AdapterVersion) -> list[TensorMeta]:
        key = tuple((k, tuple(t.shape)) for k, t in version.tensors.items())
        if key not in self._layouts:
            self._layouts[key] = layout(version.tensors, self.dtype)
        return self._layouts[key]

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """The reused packing buffer on `self.device`, grown with headroom when too small."""
        if self._storage is None or self._storage.numel() < nbytes:
            self._storage = torch.empty(int(nbytes * BUFFER_HEADROOM) + 4096, dtype=torch.uint8, device=self.device)
        return self._storage[:nbytes]

    def _loader(self, packed: PackedAdapter, meta: dict) -> Loader:
        raise NotImplementedError

    def close(self) -> None:
        pass


class ShmTransport(PackingTransport):
    """POSIX shared memory: the learner packs straight into a segment it owns; the worker (in
    vLLM's engine process) copies out of it once. The segment is reused and grown."""

    name = "shm"

    def __init__(self, generator: "VllmGenerator", checksum: bool = True, timeout_s: float = 60.0) -> None:
        super().__init__(generator, checksum, timeout_s)
        self._segment: Any = None
        self._tensor: torch.Tensor | None = None

    def _buffer(self, nbytes: int) -> torch.Tensor:
        from multiprocessing import shared_memory

        if self._segment is None or self._segment.size < nbytes:
            self._release()
            self._segment = shared_memory.SharedMemory(create=True, size=int(max(nbytes, 1) * BUFFER_HEADROOM) + 4096)
            self._tensor = torch.frombuffer(self._segment.buf, dtype=torch.uint8)
        assert self._tensor is not None
        return self._tensor[:nbytes]

    def _loader(self, packed: PackedAdapter, meta: dict) -> Loader:
        segment = self._segment.name  # only the segment's name and the metadata cross over
        return lambda client, int_id: client.add_shm(int_id, segment, meta)

    def _release(self) -> None:
        if self._segment is not None:
            self._tensor = None
            try:
                self._segment.close()
                self._segment.unlink()
            except (BufferError, FileNotFoundError) as exc:  # views still alive / already gone
                log.debug("shm release: %s", exc)
            self._segment = None

    def close(self) -> None:
        with self._lock:
            self._release()


class CudaIpcTransport(PackingTransport):
    """The learner's packed buffer on its GPU, shared by a CUDA IPC handle; the worker copies it
    once. The buffer stays alive (and unchanged: one publish at a time) until it has."""

    name = "cuda-ipc"

    def __init__(self, generator: "VllmGenerator", device: str, timeout_s: float = 60.0) -> None:
        if not device.startswith("cuda") or not torch.cuda.is_available():
            raise TransportError("cuda-ipc needs the learner on a CUDA device (learner.device = 'cuda:N')")
        super().__init__(generator, False, timeout_s)
        self.device = device

    def _loader(self, packed: PackedAdapter, meta: dict) -> Loader:
        from torch.multiprocessing.reductions import reduce_tensor

        torch.cuda.current_stream(packed.buffer.device).synchronize()  # packed before shared
        handle = pickle.dumps(reduce_tensor(packed.buffer))
        return lambda client, int_id: client.add_ipc(int_id, handle, meta)


def make_transport(config: "TrainConfig", generator: "Generator", learner_device: str, out_dir: Path) -> Transport:
    """The sender the run's `[sync]` names (or the default for its generator), bound to `generator`.

    The config validated that the transport fits the generator (`needs` vs `engine_home`)."""
    from ..config import CudaIpcSync, HttpSync, InprocSync, NcclSync, RaySync, ShmSync

    sync = config.sync_config
    match sync:
        case InprocSync():
            return InprocTransport(generator)  # type: ignore[arg-type]
        case ShmSync():
            return ShmTransport(generator, sync.checksum, sync.timeout_s)  # type: ignore[arg-type]
        case NcclSync():
            from .collective import CollectiveTransport

            return CollectiveTransport(generator, sync.backend, learner_device, sync.checksum,  # type: ignore[arg-type]
                                       sync.timeout_s)
        case CudaIpcSync():
            return CudaIpcTransport(generator, learner_device, sync.timeout_s)  # type: ignore[arg-type]
        case HttpSync():
            from .http import HttpTransport

            sync_dir = Path(sync.dir) if sync.dir else out_dir / "sync"
            return HttpTransport(generator, sync_dir, sync.timeout_s, sync.retry_budget_s)  # type: ignore[arg-type]
        case RaySync():
            from .objectstore import RayTransport

            return RayTransport(generator, sync.checksum, sync.timeout_s)  # type: ignore[arg-type]
    raise TypeError(f"no transport for {type(sync).__name__}")
