"""The vLLM multi-LoRA generator: one engine, many live adapter versions, no pauses.

One thread owns the engine (through `vllm.client.EngineClient`, this generator's receiver).
Everything else talks to that thread through a queue of commands (closures), which it runs
*between* engine steps: a new version is registered while requests on older versions keep
decoding (a sync is "pack -> hand over -> register", never a pause or a restart). Requests
report the version they started on; the registry counts them in flight and retires versions
that are drained and out of the window.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from ..adapter_version import AdapterVersion, served_name
from ..placement import Placement, pin_current_thread
from ..tokenizer import Tokenizer
from .registry import LiveVersion, VersionRegistry, register_version
from .spec import EngineSpec
from .types import (Delivery, GenRequest, GenResult, GeneratorDead, GeneratorStats, GenStatus, PublishStats, Sample,
                    hand_back)
from .validate import AdapterError, BaseShapes, VersionCheck

if TYPE_CHECKING:
    from .vllm.client import EngineClient

log = logging.getLogger(__name__)
T = TypeVar("T")

IDLE_WAIT_S = 0.05  # how long the idle engine thread blocks on its queue before re-checking
STARTUP_TIMEOUT_S = 900.0  # engine start on a slow CPU with a larger model


@dataclass
class _Pending:
    request: GenRequest
    on_done: Callable[[GenResult], None]
    live: LiveVersion | None
    drawn: dict[int, Sample] = field(default_factory=dict)  # streamed so far (keep_partial), by index

    def add(self, delta: dict[int, Sample]) -> None:
        for index, piece in delta.items():
            sample = self.drawn.setdefault(index, Sample([], [], ""))
            sample.token_ids.extend(piece.token_ids)
            sample.logprobs.extend(piece.logprobs)
            sample.finish_reason = piece.finish_reason or sample.finish_reason

    def samples(self, finish_reason: str | None = None) -> list[Sample]:
        """What was drawn, in completion order (`finish_reason` for the unfinished ones)."""
        return [Sample(s.token_ids, s.logprobs, s.finish_reason or finish_reason or "abort")
                for _, s in sorted(self.drawn.items())]


@dataclass
class _Command:
    """Work for the engine thread; `future` gets its result or error, `refuse` runs if the engine is dead or closing."""

    run: Callable[[], Any]
    future: Future[Any] | None = None
    refuse: Callable[[GenStatus, str], None] | None = None


class VllmGenerator:
    """An in-process vLLM engine on its own thread (implements `types.Generator[EngineClient]`)."""

    def __init__(self, spec: EngineSpec, placement: Placement) -> None:
        self.spec = spec
        self.placement = placement
        self.stats = GeneratorStats()
        self.registry = VersionRegistry(spec.window, spec.max_cpu_loras)
        self.check = VersionCheck(BaseShapes.from_model_dir(spec.model_dir), spec.max_lora_rank, self.registry,
                                  self.stats)
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()  # None: stop
        self._pending: dict[str, _Pending] = {}
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        self._stopping = False
        self._client: EngineClient | None = None
        self._tokenizer: Tokenizer | None = None
        self._ready: Future[bool] = Future()
        self._thread = threading.Thread(target=self._run, name="lora-async-generator", daemon=True)
        self._thread.start()
        self._ready.result(timeout=STARTUP_TIMEOUT_S)

    # ------------------------------------------------------------------ the Generator protocol
    @property
    def serving_dtype(self) -> str:
        return self.spec.dtype

    def submit(self, request: GenRequest, on_done: Callable[[GenResult], None]) -> None:
        self._check_alive()
        self._commands.put(_Command(lambda: self._add_request(request, on_done),
                                    refuse=lambda status, why: on_done(GenResult.failed(request, status, why))))

    def validate(self, version: AdapterVersion, values: bool = True) -> None:
        self.check(version, values)

    def register(self, delivery: Delivery[EngineClient]) -> PublishStats:
        """Run `delivery.load` on the engine thread between steps; then new requests use it."""
        self._check_alive()
        queued = time.perf_counter()
        return self._call(lambda: self._register(delivery, queued))

    def with_receiver(self, fn: Callable[[EngineClient], T]) -> T:
        """Run fn(engine client) on the engine thread between steps."""
        return self._call(lambda: fn(self._engine))

    def abort_older(self, adapter: str, min_version: int, tag: object) -> None:
        if self._dead is None and self._thread.is_alive():
            self._commands.put(_Command(lambda: self._abort_older(adapter, min_version, tag)))

    def live_versions(self, adapter: str) -> list[int]:
        return self._call(lambda: self.registry.versions(adapter))

    def keep(self, adapter: str, version: int) -> None:
        self._call(lambda: self.registry.keep(adapter, version))

    def let_go(self, adapter: str, version: int) -> None:
        def let_go() -> None:
            if (live := self.registry.let_go(adapter, version)) is not None:
                self._retire(live)

        self._call(let_go)

    def close(self) -> None:
        if self._thread.is_alive():
            self._commands.put(None)
            self._thread.join(timeout=60)

    # ------------------------------------------------------------------ more, for tools and tests
    def publish_dir(self, adapter: str, version: int, path: Path) -> PublishStats:
        """Register a version that vLLM loads itself from a PEFT directory (eval, benchmarks)."""
        path = Path(path).resolve()
        if not (path / "adapter_config.json").is_file():
            raise AdapterError(f"{path} is not a PEFT adapter directory")
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        name = served_name(adapter, version)

        def load(client: EngineClient, int_id: int) -> None:
            client.add_dir(name, int_id, str(path))

        return self.register(Delivery(adapter, version, size, "peft-dir", load, path=str(path)))

    def retire_adapter(self, adapter: str) -> list[str]:
        """Remove every version of `adapter`, aborting what runs on them (a run ending on an engine
        others use: `lora-async bench staleness`); its numbers stay taken, never served again."""
        return self._call(lambda: self._retire_adapter(adapter))

    def engine_lora_ids(self) -> list[int]:
        return self.run_in_engine(lambda client: client.lora_ids())

    def lora_slots(self) -> tuple[int, int]:
        """(max_loras, max_cpu_loras) the running engine really has."""
        return self.run_in_engine(lambda client: client.lora_slots())

    def in_flight(self) -> int:
        return self._call(lambda: len(self._pending))

    def run_in_engine(self, fn: Callable[[EngineClient], T]) -> T:
        """`with_receiver` by its vLLM name: fn(engine client) on the engine thread between steps."""
        return self.with_receiver(fn)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._tokenizer

    def __enter__(self) -> "VllmGenerator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the engine thread
    @property
    def _engine(self) -> "EngineClient":
        assert self._client is not None, "the engine is not running"
        return self._client

    def _run(self) -> None:
        from .vllm.client import EngineClient

        try:
            pin_current_thread(self.placement)
            self._client = EngineClient.start(self.spec, self.placement)
            self._tokenizer = self._client.tokenizer()
        except BaseException as exc:  # surfaced to the constructor
            self._ready.set_exception(exc)
            return
        self._ready.set_result(True)
        try:
            while not self._stopping:
                self._drain_commands(block=not self._engine.busy())
                if self._engine.busy():
                    began = time.perf_counter()
                    reports = self._engine.step()
                    self.stats.engine_busy(time.perf_counter() - began, steps=1,
                                           running=sum(p.request.n for p in self._pending.values()))
                    for request_id, samples, finished in reports:
                        self._progress(request_id, samples, finished)
        except BaseException as exc:
            log.error("vLLM engine failed: %s", exc)
            self._dead = exc
            self._fail_all(GenStatus.ENGINE_DEAD, f"the vLLM engine failed: {exc}")
        finally:
            self._fail_all(GenStatus.CLOSED, "generator closed")
            self._drain_commands(block=False)
            try:
                self._engine.shutdown()
            except Exception as exc:  # best effort on the way out
                log.debug("engine shutdown: %s", exc)

    def _drain_commands(self, block: bool) -> None:
        while True:
            try:
                command = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
            except queue.Empty:
                return
            block = False
            if command is None:
                self._stopping = True
            elif self._dead is not None or self._stopping:
                self._refuse(command)
            else:
                try:
                    result = command.run()
                except BaseException as exc:
                    if command.future is None:
                        raise
                    command.future.set_exception(exc)
                else:
                    if command.future is not None:
                        command.future.set_result(result)

    def _refuse(self, command: _Command) -> None:
        status = GenStatus.ENGINE_DEAD if self._dead is not None else GenStatus.CLOSED
        reason = f"the vLLM engine failed: {self._dead}" if self._dead is not None else "generator closed"
        if command.refuse is not None:
            command.refuse(status, reason)
        if command.future is not None:
            command.future.set_exception(GeneratorDead(reason))

    def _call(self, fn: Callable[[], T]) -> T:
        future: Future[T] = Future()
        self._commands.put(_Command(fn, future))
        return future.result()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise GeneratorDead(f"the vLLM engine failed earlier: {self._dead}")
        if not self._thread.is_alive():
            raise GeneratorDead("generator is closed")

    # ---- versions
    def _register(self, delivery: Delivery[EngineClient], queued: float) -> PublishStats:
        """Registered between steps; the time it queued behind the step in flight is its wait."""
        return register_version(self.registry, delivery, self._engine, self.stats, retire=self._retire,
                                make_room=lambda: self._evict(self.registry.oldest_outside_window()),
                                waited_ms=(time.perf_counter() - queued) * 1000)

    def _retire(self, live: LiveVersion) -> str:
        self._engine.remove(live.int_id)
        self.registry.remove(live)
        return live.served_name

    def _abort_older(self, adapter: str, min_version: int, tag: object) -> None:
        doomed = [rid for rid, p in self._pending.items() if p.request.tag == tag and p.live is not None
                  and p.live.adapter == adapter and p.live.version < min_version]
        self._abort(doomed, GenStatus.ABORTED_STALE, f"aborted: too stale to train (below v{min_version})")

    def _retire_adapter(self, adapter: str) -> list[str]:
        doomed = [rid for rid, p in self._pending.items() if p.live is not None and p.live.adapter == adapter]
        self._abort(doomed, GenStatus.ABORTED_STALE, f"aborted: {adapter} was retired")
        return [self._retire(live) for live in self.registry.all_live() if live.adapter == adapter]

    def _evict(self, live: LiveVersion | None) -> None:
        """The engine is full: abort what still runs on the oldest out-of-window version."""
        if live is None:
            raise RuntimeError("vLLM's LoRA cache is full of versions inside the staleness window; "
                               "this is a sizing bug (EngineSpec.max_cpu_loras)")
        doomed = [rid for rid, p in self._pending.items() if p.live is live]
        self._abort(doomed, GenStatus.EVICTED, "aborted: its version fell out of the staleness window")
        self._retire(live)

    def _abort(self, request_ids: list[str], status: GenStatus, reason: str) -> None:
        if request_ids:
            self._engine.abort(request_ids)
            self.stats.requests_aborted(len(request_ids))
        for request_id in request_ids:
            pending = self._pending.get(request_id)
            if pending is not None and pending.request.keep_partial and status is GenStatus.ABORTED_STALE:
                self._complete(request_id, pending.samples("abort"), GenStatus.STOPPED, reason)
            else:
                self._complete(request_id, [], status, reason)

    # ---- requests
    def _add_request(self, request: GenRequest, on_done: Callable[[GenResult], None]) -> None:
        from .vllm.client import LoraRef

        live = None
        request_id = f"r{next(self._ids)}"
        try:
            lora = None
            if request.adapter is not None:
                live = self.registry.acquire(request.adapter, request.version)
                # The path is never read while the version is live (we never let vLLM evict
                # it); if it ever were, a missing path fails loudly instead of serving stale.
                lora = LoraRef(live.served_name, live.int_id, live.path or f"lora-async://{live.served_name}")
            self._pending[request_id] = _Pending(request, on_done, live)
            self._engine.add_request(request_id, request, lora)
            self.stats.request_started()
        except Exception as exc:
            if live is not None:
                self.registry.release(live)
            self._pending.pop(request_id, None)
            on_done(GenResult.failed(request, GenStatus.REFUSED, f"refused: {exc}"))

    def _progress(self, request_id: str, samples: dict[int, Sample], finished: bool) -> None:
        pending = self._pending.get(request_id)
        if pending is None:
            return
        if pending.request.keep_partial:
            pending.add(samples)
            if finished:
                self._complete(request_id, pending.samples("stop"), GenStatus.OK, None)
        elif finished:
            self._complete(request_id, [s for _, s in sorted(samples.items())], GenStatus.OK, None)

    def _complete(self, request_id: str, samples: list[Sample], status: GenStatus, error: str | None) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return
        live = pending.live
        if live is not None and self.registry.release(live) and self._dead is None:
            self._retire(live)
        self.stats.tokens_drawn(sum(len(s.token_ids) for s in samples))
        hand_back(pending.on_done, GenResult(pending.request, pending.request.adapter,
                                             live.version if live else None, samples, status, error))

    def _fail_all(self, status: GenStatus, reason: str) -> None:
        for request_id in list(self._pending):
            pending = self._pending.pop(request_id)
            hand_back(pending.on_done, GenResult.failed(pending.request, status, reason))
