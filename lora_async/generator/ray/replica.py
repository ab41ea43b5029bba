"""`Replica`: one generator replica, a Ray actor that owns one `VllmGenerator`.

The engine code is the one a single node runs (`generator.engine.VllmGenerator`, its engine
thread, its registry); this class only adapts it to Ray calls. It is an async actor, so many
`generate` calls wait on the engine at once and a `ping` is answered while they run.

- `start(slot, cores)` builds the engine on this actor's GPU (Ray sets CUDA_VISIBLE_DEVICES), or
  on CPU pinned to its share of its node's cores: the `slot`-th run of `cores` cores. The router
  calls it after creation and again after Ray restarts the actor, then registers the live
  versions before it routes anything here.
- `add_version(meta, array)` registers a version from the object store (Ray hands the array
  over zero-copy on this node; `meta` is a `handoff.PackMeta`, pickled by Ray); the checksum is
  checked here, on every replica (`handoff.receive.receive_object`).
- A request names the exact version the router chose (`GenRequest.version`).
- An engine that dies takes the actor down with it (`os._exit`), so that Ray restarts it and
  the router sees one kind of failure: a dead actor.

This module imports neither Ray nor vLLM at import time: the router wraps the class with
`ray.remote` and the engine imports vLLM when it starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NoReturn

from ...handoff import PackMeta
from ..spec import EngineSpec
from ..types import Delivery, GenRequest, GenResult, GeneratorDead, GenStatus, PublishStats

if TYPE_CHECKING:
    from ..engine import VllmGenerator
    from ..vllm.client import EngineClient

log = logging.getLogger(__name__)


class Replica:
    def __init__(self, spec: EngineSpec, model_name: str, index: int,
                 build_base: Callable[[Path], Path] | None = None) -> None:
        from ...quiet import quiet_start

        quiet_start(spec.engine_log)  # before vLLM is imported here: the CLI's quiet start, in this process
        self.spec, self.model_name, self.index = spec, model_name, index
        self.build_base = build_base  # when the run serves the learner's dequantised base: what builds it
        self.incarnation = uuid.uuid4().hex  # a new one each time Ray (re)starts this actor
        self.generator: VllmGenerator | None = None
        self.started_s: float | None = None
        self.in_flight = 0  # `generate` calls this incarnation holds (received, not yet answered)

    # ---------------------------------------------------------------- lifecycle
    async def start(self, slot: int | None, cores: int) -> dict:
        """Build the engine (once per incarnation); returns what `ping` returns."""
        if self.generator is None:
            began = time.perf_counter()
            self.generator = await asyncio.to_thread(self._build, slot, cores)
            self.started_s = time.perf_counter() - began
        return self.ping()

    def _build(self, slot: int | None, cores: int) -> VllmGenerator:
        import torch

        from ...placement import Placement
        from ..engine import VllmGenerator

        spec = self.spec
        if not spec.model_dir.is_dir():  # another node: build or find the model in this node's cache
            from rich.console import Console

            from ...models import resolve_model

            model_dir = Path(resolve_model(self.model_name, Console(quiet=True)))
            if self.build_base is not None:  # the learner's dequantised base, built here as the learner's node did
                model_dir = self.build_base(model_dir)
            spec = dataclasses.replace(spec, model_dir=model_dir)
        on_gpu = bool(os.environ.get("CUDA_VISIBLE_DEVICES")) and torch.cuda.is_available()
        if on_gpu:
            return VllmGenerator(spec, Placement("cuda:0", None))
        node = sorted(os.sched_getaffinity(0))
        share = node[slot * cores:(slot + 1) * cores] if slot is not None else []
        # A node with too few cores for a share per replica: no pinning (the replicas share them).
        return VllmGenerator(spec, Placement("cpu", frozenset(share) if len(share) == cores else None))

    def ping(self) -> dict:
        """Who this is (the incarnation changes on restart), what it has done, and how many requests
        it holds now (`in_flight`)."""
        info = {"index": self.index, "incarnation": self.incarnation, "pid": os.getpid(), "started": False,
                "node": _node_id(), "in_flight": self.in_flight}
        gen = self.generator
        if gen is not None:
            stats = gen.stats
            info.update(started=True, start_s=self.started_s, busy_s=stats.busy_s, steps=stats.steps,
                        running=stats.running, tokens=stats.tokens, requests=stats.requests,
                        live={name: gen.registry.versions(name) for name in gen.spec.adapters})
        return info

    def shutdown(self) -> None:
        if self.generator is not None:
            self.generator.close()
            self.generator = None

    # ---------------------------------------------------------------- versions
    async def add_version(self, meta: PackMeta, array: object) -> dict[str, float]:
        """Register a packed version from the object store; returns the milliseconds it took here
        (`ms`) and, of those, the wait for the engine to finish its current step (`wait_ms`).
        A damaged or malformed buffer raises PackError and nothing is registered."""
        began = time.perf_counter()
        stats = await asyncio.to_thread(self._register, meta, array)  # off the actor's loop: pings go on
        return {"ms": (time.perf_counter() - began) * 1000, "wait_ms": stats.wait_ms}

    def _register(self, meta: PackMeta, array: object) -> PublishStats:
        from ...handoff.receive import receive_object

        gen = self._engine()
        tensors = receive_object(meta, array)  # the one copy, and the checksum check

        def load(engine: EngineClient, int_id: int) -> None:
            engine.add_tensors(int_id, tensors, meta.peft_config)

        return gen.register(Delivery(meta.adapter, meta.version, meta.nbytes, "ray", load))

    def live_versions(self, adapter: str) -> list[int]:
        return self._engine().registry.versions(adapter)

    def engine_lora_ids(self) -> list[int]:
        return self._engine().engine_lora_ids()

    # ---------------------------------------------------------------- requests
    async def generate(self, request: GenRequest) -> GenResult:
        gen = self._engine()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[GenResult] = loop.create_future()

        def settle(result: GenResult) -> None:
            if not future.done():
                future.set_result(result)

        def done(result: GenResult) -> None:  # on the engine thread
            loop.call_soon_threadsafe(settle, result)

        self.in_flight += 1
        try:
            gen.submit(request, done)
        except GeneratorDead as exc:
            self._die(str(exc))
        try:
            result: GenResult = await future
        finally:
            self.in_flight -= 1
        if result.status is GenStatus.ENGINE_DEAD:
            self._die(result.error or "the engine died")
        return result

    def abort_older(self, adapter: str, min_version: int, tag: object) -> None:
        if self.generator is not None:
            self.generator.abort_older(adapter, min_version, tag)

    # ---------------------------------------------------------------- internals
    def _engine(self) -> VllmGenerator:
        if self.generator is None:
            raise RuntimeError(f"replica {self.index}: the engine is not started")
        return self.generator

    def _die(self, why: str) -> NoReturn:
        """A dead engine ends the actor, so Ray restarts it (an ordinary exit would not be restarted)."""
        log.error("replica %d: %s; exiting so that Ray restarts it", self.index, why)
        os._exit(1)


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # outside Ray (unit use)
        return None
