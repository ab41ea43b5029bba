"""The vLLM multi-LoRA generator: one engine, many live adapter versions, no pauses.

The engine is driven by one thread that owns it. Everything else talks to that thread through
a command queue, and the thread runs commands *between* engine steps: a new version is
registered while requests on older versions keep decoding (a sync is "pack -> hand over ->
register", never a pause or a restart). Requests report the version they started on; the
registry counts them in flight and retires versions that are drained and out of the window.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..placement import Placement, pin_current_thread
from ..sync.pack import PackedAdapter, pack, unpack_views
from .registry import LiveVersion, VersionRegistry
from .types import AdapterVersion, GenRequest, GenResult, GeneratorClock, PublishStats, Sample
from .validate import AdapterError, BaseShapes, StructureCheck, check_finite, check_finite_all

log = logging.getLogger(__name__)

EXTENSION = "lora_async.generator.vllm_ext.LoraAsyncWorkerExtension"
IDLE_WAIT_S = 0.05  # how long the idle engine thread blocks on its queue before re-checking
STARTUP_TIMEOUT_S = 900.0  # engine start on a slow CPU with a larger model
ABORTED_STALE = "aborted: stale"  # a request cut short because its samples could not be trained


class GeneratorDead(RuntimeError):
    """The engine failed; nothing more can be generated or published."""


@dataclass
class _Pending:
    request: GenRequest
    on_done: Callable[[GenResult], None]
    live: LiveVersion | None


@dataclass(frozen=True)
class EngineSpec:
    """What the engine needs to start; built from the run config by `make_generator`."""

    model_dir: Path
    adapters: tuple[str, ...]
    max_staleness: int
    max_lora_rank: int
    dtype: str = "bfloat16"
    memory_fraction: float = 0.2
    kv_cache_gb: float | None = None
    max_model_len: int = 1024
    seed: int = 0
    fast_cpu_lora: bool = True
    engine_log: bool = False
    max_num_seqs: int = 256
    separate_process: bool = False  # the engine core (and its worker) in a child process

    @property
    def max_loras(self) -> int:
        """Adapters in one batch: every live version of every adapter, plus one being published."""
        return len(self.adapters) * (self.max_staleness + 1) + 1

    @property
    def max_cpu_loras(self) -> int:
        """Registered versions: the batch slots plus one draining version per adapter."""
        return self.max_loras + len(self.adapters)


class VllmGenerator(GeneratorClock):
    """An in-process vLLM engine on its own thread (implements `types.Generator`)."""

    def __init__(self, spec: EngineSpec, placement: Placement) -> None:
        self.spec = spec
        self.placement = placement
        self.registry = VersionRegistry(spec.max_staleness, spec.max_cpu_loras)
        self.check_structure = StructureCheck(BaseShapes.from_model_dir(spec.model_dir), spec.max_lora_rank)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[str, _Pending] = {}
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        self._stopping = False
        self._ready: Future = Future()
        self._watch_stop = threading.Event()  # ends the dead-engine watch (separate process)
        self._start_clock()
        self._thread = threading.Thread(target=self._run, name="lora-async-generator", daemon=True)
        self._thread.start()
        self._ready.result(timeout=STARTUP_TIMEOUT_S)

    # ------------------------------------------------------------------ public API
    def submit(self, request: GenRequest, on_done: Callable[[GenResult], None]) -> None:
        self._check_alive()
        self._commands.put(("submit", request, on_done))

    def publish(self, version: AdapterVersion) -> PublishStats:
        """Validate and register a version from in-memory tensors. Blocks until servable.

        vLLM keeps (and scales in place) the tensors it is given, so it must get copies it owns:
        tensors in another dtype than the serving one are cast by vLLM into fresh tensors;
        tensors already in the serving dtype are packed into a fresh buffer first.
        """
        self._check_alive()
        if self.spec.separate_process:
            raise AdapterError("the engine runs in its own process: publish through a transport "
                               "(sync.transport = 'shm', 'nccl' or 'cuda-ipc'), not in-process tensors")
        started = time.perf_counter()
        serving = _torch_dtype(self.spec.dtype)
        name = f"{version.adapter}@v{version.version}"
        try:
            self.check_structure(version)
            self.registry.check_new(version.adapter, version.version)
            if all(t.dtype != serving for t in version.tensors.values()):
                check_finite_all(name, list(version.tensors.values()))
                payload: Any = version
            else:
                payload = pack(version, dtype=serving)
                check_finite(name, payload.buffer.view(serving))
        except Exception:
            self.stats["rejected_versions"] += 1
            raise
        return self._call("publish", payload, started, time.perf_counter())

    def validate(self, version: AdapterVersion) -> None:
        """The structural and value checks `publish` runs, for transports that pack themselves."""
        name = f"{version.adapter}@v{version.version}"
        try:
            self.check_structure(version)
            self.registry.check_new(version.adapter, version.version)
            check_finite_all(name, list(version.tensors.values()))
        except Exception:
            self.stats["rejected_versions"] += 1
            raise

    def register(self, adapter: str, version: int, nbytes: int, load: Callable[[Any, int], Any],
                 started: float) -> PublishStats:
        """Register a version whose tensors a transport delivers: `load(engine, int_id)` runs on
        the engine thread, between steps, and must leave the worker holding adapter `int_id`.
        A load that raises registers nothing; the versions already live keep serving."""
        self._check_alive()
        return self._call("register", adapter, version, nbytes, load, started, time.perf_counter())

    def publish_dir(self, adapter: str, version: int, path: Path) -> PublishStats:
        """Register a version that vLLM loads itself from a PEFT directory (its file path)."""
        self._check_alive()
        if not (Path(path) / "adapter_config.json").is_file():
            raise AdapterError(f"{path} is not a PEFT adapter directory")
        now = time.perf_counter()
        size = sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())

        def load(engine: Any, int_id: int) -> None:
            from vllm.lora.request import LoRARequest

            engine.add_lora(LoRARequest(f"{adapter}@v{version}", int_id, str(path)))
        return self._call("register", adapter, version, size, load, now, now, str(path))

    def abort_older(self, adapter: str, min_version: int, tag: object) -> None:
        """Abort requests tagged `tag` of `adapter` on versions below `min_version` (rollouts
        whose samples could only be dropped as stale): the engine's time goes to samples that
        can be trained. Does not wait; they complete with an error starting `ABORTED_STALE`."""
        if self._dead is None and self._thread.is_alive():
            self._commands.put(("fn", lambda: self._abort_older(adapter, min_version, tag), Future()))

    def live_versions(self, adapter: str) -> list[int]:
        return self._call("fn", lambda: self.registry.versions(adapter))

    def engine_lora_ids(self) -> list[int]:
        """The int ids vLLM's worker holds registered right now (ground truth, not our registry)."""
        return self._call("fn", lambda: self._engine.collective_rpc("lora_async_list")[0])

    def in_flight(self) -> int:
        return self._call("fn", lambda: len(self._pending))

    def run_in_engine(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps (benchmarks, diagnostics)."""
        return self._call("fn", lambda: fn(self._engine))

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def close(self) -> None:
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout=60)

    def __enter__(self) -> "VllmGenerator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            pin_current_thread(self.placement)
            self._engine = self._start_engine()
        except BaseException as exc:  # surfaced to the constructor
            self._ready.set_exception(exc)
            return
        self._ready.set_result(True)
        try:
            while not self._stopping:
                busy = self._engine.has_unfinished_requests()
                self._drain_commands(block=not busy)
                if self._engine.has_unfinished_requests():
                    began = time.perf_counter()
                    outputs = self._engine.step()
                    self.stats["busy_s"] += time.perf_counter() - began
                    for output in outputs:
                        if output.finished:
                            self._finish(output)
        except BaseException as exc:
            log.error("vLLM engine failed: %s", exc)
            self._dead = exc
            self._fail_all(f"engine failed: {exc}")
        finally:
            self._fail_all("generator closed")
            self._drain_commands(block=False, dead=True)
            self._shutdown_engine()

    def _start_engine(self) -> Any:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if self.spec.engine_log else "ERROR")
        # In-process: the engine core runs on this thread. Separate: vLLM starts a child process
        # for it and this thread drives it over ZMQ (same LLMEngine API).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if self.spec.separate_process and self.placement.device == "cpu" and self.placement.cpus:
            from ..placement import format_cpus

            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = format_cpus(self.placement.cpus)
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        from .vllm_ext import check_vllm_compat, install_fast_cpu_lora_ops

        check_vllm_compat()
        on_cpu = self.placement.device == "cpu"
        if on_cpu and self.spec.fast_cpu_lora and not self.spec.separate_process:
            install_fast_cpu_lora_ops()
        kv_bytes = int(self.spec.kv_cache_gb * (1 << 30)) if self.spec.kv_cache_gb else None
        args = EngineArgs(
            model=str(self.spec.model_dir),
            dtype=self.spec.dtype,
            seed=self.spec.seed,
            max_model_len=self.spec.max_model_len,
            max_num_seqs=self.spec.max_num_seqs,
            enable_lora=True,
            max_loras=self.spec.max_loras,
            max_cpu_loras=self.spec.max_cpu_loras,
            max_lora_rank=self.spec.max_lora_rank,
            gpu_memory_utilization=self.spec.memory_fraction,
            kv_cache_memory_bytes=kv_bytes,
            worker_extension_cls=EXTENSION,
            logprobs_mode="processed_logprobs",
            disable_log_stats=True,
        )
        engine = LLMEngine.from_engine_args(args, enable_multiprocessing=self.spec.separate_process)
        if self.spec.separate_process:
            from .vllm_ext import watch_engine_core

            watch_engine_core(engine, self._watch_stop)
            if on_cpu and self.spec.fast_cpu_lora:
                engine.collective_rpc("lora_async_install_fast_ops")
        self._tokenizer = engine.get_tokenizer()
        return engine

    def _shutdown_engine(self) -> None:
        self._watch_stop.set()
        engine = getattr(self, "_engine", None)
        if engine is None:
            return
        try:
            engine.engine_core.shutdown()
        except Exception as exc:  # best effort on the way out
            log.debug("engine shutdown: %s", exc)
        self._engine = None

    def _drain_commands(self, block: bool, dead: bool = False) -> None:
        while True:
            try:
                command = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
            except queue.Empty:
                return
            block = False
            kind = command[0]
            if kind == "stop":
                self._stopping = True
                continue
            if dead or self._stopping:
                self._reject(command)
                continue
            if kind == "submit":
                self._add_request(command[1], command[2])
            else:
                future: Future = command[-1]
                try:
                    future.set_result(self._run_command(command))
                except BaseException as exc:
                    if type(exc).__name__ == "EngineDeadError":  # its process is gone
                        exc = GeneratorDead(f"the vLLM engine died: {exc}")
                    future.set_exception(exc)

    def _reject(self, command: tuple) -> None:
        reason = f"generator stopped: {self._dead}" if self._dead else "generator closed"
        if command[0] == "submit":
            command[2](GenResult(command[1], command[1].adapter, None, [], error=reason))
        elif command[0] != "stop":
            command[-1].set_exception(GeneratorDead(reason))

    def _run_command(self, command: tuple) -> Any:
        kind = command[0]
        if kind == "publish":
            return self._register(command[1], command[2], command[3])
        if kind == "register":
            return self._register_with(*command[1:-1])
        if kind == "fn":
            return command[1]()
        raise ValueError(f"unknown command {kind!r}")

    def _call(self, kind: str, *args: Any) -> Any:
        future: Future = Future()
        self._commands.put((kind, *args, future))
        return future.result()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise GeneratorDead(f"vLLM engine failed earlier: {self._dead}")
        if not self._thread.is_alive():
            raise GeneratorDead("generator is closed")

    # ---- versions
    def _register(self, payload: PackedAdapter | AdapterVersion, started: float, queued: float) -> PublishStats:
        dequeued = time.perf_counter()
        registry = self.registry
        registry.check_new(payload.adapter, payload.version)
        if registry.is_full():
            self._evict(registry.oldest_outside_window())
        int_id = registry.reserve_id()
        if isinstance(payload, AdapterVersion):
            tensors = payload.tensors  # another dtype than the serving one: vLLM casts (copies)
        else:  # a packed buffer handed to us is an owned copy; reuse the views made packing it
            tensors = payload.views if payload.views is not None else unpack_views(payload)
        self._engine.collective_rpc("lora_async_add_tensors", args=(int_id, tensors, payload.peft_config))
        live = registry.add(payload.adapter, payload.version, int_id)
        retired = [self._retire(old) for old in registry.retirable()]
        return PublishStats(
            adapter=payload.adapter,
            version=payload.version,
            vllm_name=live.vllm_name,
            int_id=live.int_id,
            bytes=payload.nbytes,
            ms=(time.perf_counter() - dequeued + queued - started) * 1000,
            retired=retired,
            wait_ms=(dequeued - queued) * 1000,
        )

    def _register_with(self, adapter: str, version: int, nbytes: int, load: Callable[[Any, int], Any],
                       started: float, queued: float, path: str | None = None) -> PublishStats:
        dequeued = time.perf_counter()
        registry = self.registry
        registry.check_new(adapter, version)
        if registry.is_full():
            self._evict(registry.oldest_outside_window())
        int_id = registry.reserve_id()
        try:
            load(self._engine, int_id)
        except Exception:
            self.stats["rejected_versions"] += 1
            raise
        live = registry.add(adapter, version, int_id)
        live.path = path
        retired = [self._retire(old) for old in registry.retirable()]
        return PublishStats(adapter, version, live.vllm_name, int_id, nbytes,
                            (time.perf_counter() - dequeued + queued - started) * 1000, retired,
                            wait_ms=(dequeued - queued) * 1000)

    def _retire(self, live: LiveVersion) -> str:
        self._engine.collective_rpc("lora_async_remove", args=(live.int_id,))
        self.registry.remove(live)
        return live.vllm_name

    def _abort_older(self, adapter: str, min_version: int, tag: object) -> int:
        doomed = [rid for rid, p in self._pending.items() if p.request.tag == tag and p.live is not None
                  and p.live.adapter == adapter and p.live.version < min_version]
        if doomed:
            self._engine.abort_request(doomed)
        for rid in doomed:
            self._finish_aborted(rid, f"{ABORTED_STALE} (below v{min_version})")
        return len(doomed)

    def _evict(self, live: LiveVersion | None) -> None:
        """The engine is full: abort what still runs on the oldest out-of-window version."""
        if live is None:
            raise RuntimeError(
                "vLLM's LoRA cache is full of versions inside the staleness window; "
                "this is a sizing bug (max_cpu_loras)"
            )
        doomed = [rid for rid, p in self._pending.items() if p.live is live]
        if doomed:
            self._engine.abort_request(doomed)
        for rid in doomed:
            self._finish_aborted(rid, "aborted: its version fell out of the staleness window")
        self._retire(live)

    # ---- requests
    def _add_request(self, request: GenRequest, on_done: Callable[[GenResult], None]) -> None:
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import RequestOutputKind

        live = None
        lora_request = None
        try:
            if request.adapter is not None:
                live = self.registry.acquire(request.adapter)
                # The path is never read while the version is live (we never let vLLM evict
                # it); if it ever were, a missing path fails loudly instead of serving stale.
                path = live.path or f"lora-async://{live.vllm_name}"
                lora_request = LoRARequest(live.vllm_name, live.int_id, path)
            params = SamplingParams(
                n=request.n,
                max_tokens=request.max_tokens,
                min_tokens=request.min_tokens,
                temperature=request.temperature,
                top_p=request.top_p,
                seed=request.seed,
                logprobs=0,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            request_id = f"r{next(self._ids)}"
            self._pending[request_id] = _Pending(request, on_done, live)
            self._engine.add_request(
                request_id, {"prompt_token_ids": list(request.prompt_ids)}, params, lora_request=lora_request
            )
            self.stats["requests"] += 1
        except Exception as exc:
            if live is not None:
                self.registry.release(live)
            self._pending.pop(locals().get("request_id", ""), None)
            on_done(GenResult(request, request.adapter, None, [], error=f"rejected: {exc}"))

    def _finish(self, output: Any) -> None:
        pending = self._pending.pop(output.request_id, None)
        if pending is None:
            return
        samples = []
        for completion in output.outputs:
            ids = list(completion.token_ids)
            logprobs = [step[token].logprob for step, token in zip(completion.logprobs or [], ids)]
            samples.append(Sample(ids, logprobs, completion.finish_reason or "stop"))
            self.stats["tokens"] += len(ids)
        self._complete(pending, samples, None)

    def _finish_aborted(self, request_id: str, reason: str) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            self.stats["aborted"] += 1
            self._complete(pending, [], reason)

    def _complete(self, pending: _Pending, samples: list[Sample], error: str | None) -> None:
        live = pending.live
        version = live.version if live is not None else None
        if live is not None:
            self.registry.release(live)
            if live.in_flight == 0 and self.registry.outside_window(live) and not self._dead:
                self._retire(live)
        try:
            pending.on_done(GenResult(pending.request, pending.request.adapter, version, samples, error))
        except Exception:
            log.exception("generation callback failed")

    def _fail_all(self, reason: str) -> None:
        for request_id in list(self._pending):
            pending = self._pending.pop(request_id)
            try:
                pending.on_done(GenResult(pending.request, pending.request.adapter, None, [], error=reason))
            except Exception:
                log.exception("generation callback failed")


def _torch_dtype(name: str) -> Any:
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


__all__ = ["VllmGenerator", "EngineSpec", "GeneratorDead", "AdapterError"]
