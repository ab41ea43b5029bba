"""Transports: how a new adapter version gets from the learner into the vLLM engine.

Each transport is a small class behind `Transport`; `make_transport` picks one from the run's
`sync` config. All of them end in the same place: the generator registers the version under a
fresh int id beside the live ones (`VllmGenerator.register`), so generation never pauses.

| transport  | engine                           | what moves                                   |
|------------|----------------------------------|----------------------------------------------|
| `inproc`   | in this process                  | owned tensors, handed over by reference      |
| `shm`      | own process, same host           | packed buffer in a POSIX shared-memory segment |
| `nccl`     | own process(es), any local device | one broadcast over a dedicated process group (`gloo` on CPU) |
| `cuda-ipc` | own process, same host's GPUs    | a CUDA IPC handle to the learner's packed buffer |
| `http`     | remote `vllm serve` replicas     | a PEFT directory + `/v1/load_lora_adapter` (generator/server.py) |
"""

from __future__ import annotations

import concurrent.futures
import logging
import pickle
import socket
import threading
import time
from typing import Any, Protocol

import torch

from ..generator.types import AdapterVersion, PublishStats
from .pack import PackedAdapter, PackError, TensorMeta, layout, pack

log = logging.getLogger(__name__)


class TransportError(RuntimeError):
    """A transport that cannot deliver (receiver gone, timed out, or broken by an earlier fault)."""


class Transport(Protocol):
    name: str

    def publish(self, version: AdapterVersion) -> PublishStats:
        """Deliver and register `version`; blocks until requests can name it."""

    def close(self) -> None: ...


class InprocTransport:
    """The engine lives in this process: hand over owned tensors (the foundation's path)."""

    name = "inproc"

    def __init__(self, generator: Any) -> None:
        self.generator = generator

    def publish(self, version: AdapterVersion) -> PublishStats:
        stats = self.generator.publish(version)
        stats.transport = self.name
        return stats

    def close(self) -> None:
        pass


class HttpTransport(InprocTransport):
    """Remote `vllm serve` replicas: the server generator writes the PEFT directory and loads
    it on every replica itself (`generator.server.ServerGenerator.publish`)."""

    name = "http"


class _PackingTransport:
    """Shared by the cross-process transports: validate, pack into a reused buffer, register.

    One publish at a time (a lock): the packed buffer is reused, and a collective must see
    its broadcasts in the same order on every rank.
    """

    name = "?"

    def __init__(self, generator: Any, checksum: bool, timeout_s: float) -> None:
        self.generator = generator
        self.checksum = checksum
        self.timeout_s = timeout_s
        self.dtype = _torch_dtype(generator.spec.dtype)
        self._lock = threading.Lock()
        self._layouts: dict[tuple, list[TensorMeta]] = {}
        self._broken: str | None = None
        self.device = "cpu"
        self._storage: torch.Tensor | None = None

    def publish(self, version: AdapterVersion) -> PublishStats:
        if self._broken:
            raise TransportError(f"{self.name} transport is unusable after an earlier fault: {self._broken}")
        started = time.perf_counter()
        self.generator.validate(version)
        with self._lock:
            metas = self._layout(version)
            end = metas[-1].offset + metas[-1].nbytes if metas else 0
            out = self._buffer(end)
            # blake3 reads host memory; device buffers (nccl, cuda-ipc) go unchecksummed
            packed = pack(version, self.dtype, with_checksum=self.checksum and out.device.type == "cpu",
                          out=out, metas=metas)
            packed.views = None  # the receiver makes its own copy; drop our views of the buffer
            meta = packed.meta()
            stats = self.generator.register(version.adapter, version.version, packed.nbytes,
                                            _recognising_rejections(self._loader(packed, meta)), started)
        stats.transport = self.name
        return stats

    def _layout(self, version: AdapterVersion) -> list[TensorMeta]:
        key = tuple((k, tuple(t.shape)) for k, t in version.tensors.items())
        if key not in self._layouts:
            self._layouts[key] = layout(version.tensors, self.dtype)
        return self._layouts[key]

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """The reused packing buffer on `self.device`, grown with headroom when too small."""
        if self._storage is None or self._storage.numel() < nbytes:
            self._storage = torch.empty(nbytes * 5 // 4 + 4096, dtype=torch.uint8, device=self.device)
        return self._storage[:nbytes]

    def _loader(self, packed: PackedAdapter, meta: dict) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        pass


class ShmTransport(_PackingTransport):
    """POSIX shared memory: the learner packs straight into a segment it owns; the worker
    (in vLLM's engine process) copies out of it once. The segment is reused and grown."""

    name = "shm"

    def __init__(self, generator: Any, checksum: bool = True, timeout_s: float = 60.0) -> None:
        super().__init__(generator, checksum, timeout_s)
        self._segment: Any = None
        self._tensor: torch.Tensor | None = None

    def _buffer(self, nbytes: int) -> torch.Tensor:
        from multiprocessing import shared_memory

        if self._segment is None or self._segment.size < nbytes:
            self._release()
            self._segment = shared_memory.SharedMemory(create=True, size=max(nbytes, 1) * 5 // 4 + 4096)
            self._tensor = torch.frombuffer(self._segment.buf, dtype=torch.uint8)
        assert self._tensor is not None
        return self._tensor[:nbytes]

    def _loader(self, packed: PackedAdapter, meta: dict) -> Any:
        segment = self._segment.name
        del packed  # only the segment's name and the metadata cross the process boundary

        def load(engine: Any, int_id: int) -> Any:
            return engine.collective_rpc("lora_async_add_shm", args=(int_id, segment, meta))
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


class CollectiveTransport(_PackingTransport):
    """One broadcast of the packed buffer over a process group of our own: rank 0 is the
    learner, ranks 1.. are vLLM's workers (each joins through the worker extension).
    `backend='nccl'` between GPUs; `backend='gloo'` runs the same code on CPU."""

    def __init__(self, generator: Any, backend: str = "nccl", device: str = "cpu", checksum: bool = True,
                 timeout_s: float = 60.0, host: str = "127.0.0.1") -> None:
        if backend == "nccl" and (not device.startswith("cuda") or not torch.cuda.is_available()):
            raise TransportError("sync.backend 'nccl' needs the learner on a GPU (learner.device = 'cuda:N'); "
                                 "use sync.backend = 'gloo' on CPU")
        super().__init__(generator, checksum, timeout_s)
        from .receive import make_group

        self.name = "nccl" if backend == "nccl" else "gloo"
        self.backend = backend
        self.device = device if backend == "nccl" else "cpu"
        workers = len(generator.run_in_engine(lambda engine: engine.collective_rpc("lora_async_list")))
        world = 1 + workers
        port = free_port(host)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            joined = pool.submit(generator.run_in_engine, lambda engine: engine.collective_rpc(
                "lora_async_join_group", args=(host, port, world, backend, timeout_s)))
            try:
                self.group = make_group(host, port, 0, world, backend, timeout_s)
                ranks = joined.result(timeout=timeout_s)
            except Exception as exc:
                raise TransportError(f"vLLM's workers did not join the {backend} group within "
                                     f"{timeout_s:.0f} s: {exc}") from exc
        log.info("%s group up: learner rank 0, workers %s", backend, ranks)

    def _loader(self, packed: PackedAdapter, meta: dict) -> Any:
        from .receive import broadcast

        buffer = packed.buffer

        def load(engine: Any, int_id: int) -> Any:
            outcome: dict[str, BaseException] = {}

            def send() -> None:
                try:
                    broadcast(self.group, buffer)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    outcome["error"] = exc

            sender = threading.Thread(target=send, name="lora-async-broadcast", daemon=True)
            sender.start()
            try:
                return engine.collective_rpc("lora_async_add_broadcast", args=(int_id, meta))
            finally:
                sender.join(self.timeout_s + 5)
                if sender.is_alive() or "error" in outcome:
                    self._broken = f"broadcast of {meta['adapter']}@v{meta['version']} did not complete"
                    raise TransportError(
                        f"{self.name}: the receiver did not take {meta['adapter']}@v{meta['version']} within "
                        f"{self.timeout_s:.0f} s ({outcome.get('error', 'no answer')})")
        return load


class CudaIpcTransport(_PackingTransport):
    """The learner's packed buffer on its GPU, shared by a CUDA IPC handle; the worker copies
    it once. The buffer stays alive (and unchanged: one publish at a time) until it has."""

    name = "cuda-ipc"

    def __init__(self, generator: Any, device: str, timeout_s: float = 60.0) -> None:
        if not device.startswith("cuda") or not torch.cuda.is_available():
            raise TransportError("cuda-ipc needs the learner on a CUDA device (learner.device = 'cuda:N')")
        super().__init__(generator, False, timeout_s)
        self.device = device

    def _loader(self, packed: PackedAdapter, meta: dict) -> Any:
        from torch.multiprocessing.reductions import reduce_tensor

        torch.cuda.current_stream(packed.buffer.device).synchronize()  # packed before shared
        handle = pickle.dumps(reduce_tensor(packed.buffer))

        def load(engine: Any, int_id: int) -> Any:
            return engine.collective_rpc("lora_async_add_ipc", args=(int_id, handle, meta))
        return load


def _recognising_rejections(load: Any) -> Any:
    """A refusal inside vLLM's worker (checksum, truncation) arrives as plain text: make it a
    PackError again, so the run counts it as one rejected version instead of failing."""

    def wrapped(engine: Any, int_id: int) -> Any:
        try:
            return load(engine, int_id)
        except PackError:
            raise
        except Exception as exc:
            raise PackError.from_remote(exc) from exc
    return wrapped


def make_transport(sync: Any, generator_config: Any, generator: Any, learner_device: str) -> Transport:
    """The transport the config names (`sync.transport`, 'auto' resolved), bound to `generator`."""
    kind = sync.resolved(generator_config)
    if kind == "inproc":
        return InprocTransport(generator)
    if kind == "http":
        return HttpTransport(generator)
    if kind == "shm":
        return ShmTransport(generator, sync.checksum, sync.timeout_s)
    if kind == "nccl":
        return CollectiveTransport(generator, sync.backend, learner_device, sync.checksum, sync.timeout_s)
    if kind == "cuda-ipc":
        return CudaIpcTransport(generator, learner_device, sync.timeout_s)
    raise ValueError(f"unknown transport {kind!r}")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _torch_dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]
