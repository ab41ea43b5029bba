"""Transports: how a new adapter version gets from the learner into the generator.

Each transport is a small sender behind `Transport`. It checks the version with the generator
(`validate`), moves the tensors its way, and hands the generator one `Delivery`, whose `load`
runs where the generator registers versions (`Generator.register`) with the generator's
receiver: the version lands under a fresh int id beside the live ones, so generation never
pauses. Each sender is typed against the receiver it needs (`generator.receivers`), so it only
takes a generator that offers it. `factory.make_transport` picks the sender from the run's
`[sync]` config (a union on `transport`).

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
from typing import TYPE_CHECKING, Callable, Generic, Protocol, TypeVar

import torch

from ..adapter_version import AdapterVersion
from ..dtypes import torch_dtype
from ..errors import RunError
from ..generator.receivers import EngineReceiver
from ..generator.types import Delivery, Generator, PublishStats
from ..generator.validate import AdapterError
from ..handoff.packed import PackedAdapter, TensorMeta, layout, packed_nbytes
from .pack import pack

if TYPE_CHECKING:
    from multiprocessing.shared_memory import SharedMemory

log = logging.getLogger(__name__)

BUFFER_HEADROOM = 5 / 4  # a reused packing buffer grows to 1.25x what it must hold (fewer regrowths)

R = TypeVar("R")  # the receiver a transport's deliveries load into
Loader = Callable[[R, int], float | None]  # `Delivery.load`


class TransportError(RunError):
    """A transport that cannot deliver (receiver gone, timed out, or broken by an earlier fault)."""


class Transport(Protocol):
    name: str

    def publish(self, version: AdapterVersion) -> PublishStats:
        """Deliver and register `version`; blocks until requests can name it."""

    def close(self) -> None: ...


class InprocTransport:
    """The engine lives in this process: hand the version's tensors over by reference.

    The worker borrows them for the length of the registration and makes the one copy vLLM
    keeps: into a retired version's buffers on the hot-swap path (where it also checks the
    values, with one reduction over that copy), or a copy in the serving dtype before vLLM's
    own build (vLLM keeps, and scales in place, the tensors it is given)."""

    name = "inproc"

    def __init__(self, generator: Generator[EngineReceiver]) -> None:
        if not generator.with_receiver(lambda engine: engine.in_process):
            raise TransportError("the engine runs in its own process: in-process tensors cannot reach it "
                                 "(use sync.transport 'shm', 'nccl' or 'cuda-ipc')")
        self.generator = generator

    def publish(self, version: AdapterVersion) -> PublishStats:
        started = time.perf_counter()
        self.generator.validate(version, values=False)  # the worker checks the values on its copy
        tensors, config, flat, structure = version.tensors, version.peft_config, version.flat, version.structure

        def load(engine: EngineReceiver, int_id: int) -> None:
            try:
                engine.add_tensors(int_id, tensors, config, borrowed=True, flat=flat, structure=structure)
            except AdapterError as exc:
                raise AdapterError(f"{version.served_name}: {exc}") from None

        return self.generator.register(Delivery(version.adapter, version.version, version.nbytes, self.name,
                                                load, started))

    def close(self) -> None:
        pass


class PackingTransport(Generic[R]):
    """Shared by the cross-process transports: validate, pack into a reused buffer in the dtype
    the generator serves, deliver (`_loader`: how the packed buffer reaches receiver `R`).

    One publish at a time (a lock): the packed buffer is reused, and a collective must see its
    broadcasts in the same order on every rank. A transport that failed mid-transfer refuses
    further use (`_broken`): its receivers' state is unknown."""

    name = "?"
    device = "cpu"  # where the packing buffer lives

    def __init__(self, generator: Generator[R], checksum: bool, timeout_s: float) -> None:
        self.generator = generator
        serving = generator.serving_dtype  # tensors travel in the dtype the engine serves
        self.dtype = torch_dtype(serving) if serving is not None else None
        self.checksum = checksum
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._layouts: dict[tuple[tuple[str, tuple[int, ...], torch.dtype], ...], list[TensorMeta]] = {}
        self._broken: str | None = None
        self._storage: torch.Tensor | None = None

    def publish(self, version: AdapterVersion) -> PublishStats:
        if self._broken:
            raise TransportError(f"{self.name} transport is unusable after an earlier fault: {self._broken}")
        started = time.perf_counter()
        self.generator.validate(version)
        with self._lock:
            metas = self._layout(version)
            out = self._buffer(packed_nbytes(metas))
            # blake3 reads host memory; device buffers (nccl, cuda-ipc) go unchecksummed
            packed = pack(version, self.dtype, with_checksum=self.checksum and out.device.type == "cpu",
                          out=out, metas=metas)
            packed.views = None  # the receiver makes its own copy; drop our views of the buffer
            return self.generator.register(Delivery(version.adapter, version.version, packed.nbytes, self.name,
                                                    self._loader(packed), started))

    def _layout(self, version: AdapterVersion) -> list[TensorMeta]:
        key = tuple((k, tuple(t.shape), t.dtype) for k, t in version.tensors.items())
        if key not in self._layouts:
            self._layouts[key] = layout(version.tensors, self.dtype)
        return self._layouts[key]

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """The reused packing buffer on `self.device`, grown with headroom when too small."""
        if self._storage is None or self._storage.numel() < nbytes:
            self._storage = torch.empty(int(nbytes * BUFFER_HEADROOM) + 4096, dtype=torch.uint8, device=self.device)
        return self._storage[:nbytes]

    def _loader(self, packed: PackedAdapter) -> Loader[R]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class ShmTransport(PackingTransport[EngineReceiver]):
    """POSIX shared memory: the learner packs straight into a segment it owns; the worker (in
    vLLM's engine process) copies out of it once. The segment is reused and grown."""

    name = "shm"

    def __init__(self, generator: Generator[EngineReceiver], checksum: bool = True, timeout_s: float = 60.0) -> None:
        super().__init__(generator, checksum, timeout_s)
        self._segment: SharedMemory | None = None
        self._tensor: torch.Tensor | None = None

    def _buffer(self, nbytes: int) -> torch.Tensor:
        from multiprocessing import shared_memory

        if self._segment is None or self._segment.size < nbytes:
            self._release()
            self._segment = shared_memory.SharedMemory(create=True, size=int(max(nbytes, 1) * BUFFER_HEADROOM) + 4096)
            self._tensor = torch.frombuffer(self._segment.buf, dtype=torch.uint8)
        assert self._tensor is not None
        return self._tensor[:nbytes]

    def _loader(self, packed: PackedAdapter) -> Loader[EngineReceiver]:
        assert self._segment is not None  # `_buffer` made it for this publish
        segment, meta = self._segment.name, packed.meta  # only the segment's name and the metadata cross over

        def load(engine: EngineReceiver, int_id: int) -> None:
            engine.add_shm(int_id, segment, meta)
        return load

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


class CudaIpcTransport(PackingTransport[EngineReceiver]):
    """The learner's packed buffer on its GPU, shared by a CUDA IPC handle; the worker copies it
    once. The buffer stays alive (and unchanged: one publish at a time) until it has."""

    name = "cuda-ipc"

    def __init__(self, generator: Generator[EngineReceiver], device: str, timeout_s: float = 60.0) -> None:
        if not device.startswith("cuda") or not torch.cuda.is_available():
            raise TransportError("cuda-ipc needs the learner on a CUDA device (learner.device = 'cuda:N')")
        super().__init__(generator, False, timeout_s)
        self.device = device

    def _loader(self, packed: PackedAdapter) -> Loader[EngineReceiver]:
        from torch.multiprocessing.reductions import reduce_tensor

        torch.cuda.current_stream(packed.buffer.device).synchronize()  # packed before shared
        handle, meta = pickle.dumps(reduce_tensor(packed.buffer)), packed.meta

        def load(engine: EngineReceiver, int_id: int) -> None:
            engine.add_ipc(int_id, handle, meta)
        return load
