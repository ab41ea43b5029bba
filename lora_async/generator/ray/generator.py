"""`RayGenerator`: engine replicas on a Ray cluster behind the one `Generator` contract.

Each replica is a Ray actor (`replica.Replica`) that owns one `VllmGenerator`, the engine code a
single node runs. This class is the router in front of them, in the orchestrator's process, and
routes requests; registering versions on every replica is `versions.ReplicaVersions`'s
(all or nothing, catch-up), starting and watching the replicas `health.ReplicaHealth`'s.

- **Versions.** A version becomes the newest here, the one new requests get, only once every
  routable replica registered it (`add_object`, this generator's receiver).
- **Requests name their version.** The router counts a request in flight on the newest version
  (its registry is the run's view of what is live) and sends it pinned to that version
  (`GenRequest.version`), so no replica serves a newer version before every replica has it.
  A version is dropped here once it is out of the staleness window and drained on every
  replica; its object goes with it. Each replica's own engine keeps one version more than the
  window (`StalenessWindow.widened`), so a version a request may still be pinned to is never gone.
- **Routing.** A request goes to the routable replica with the fewest outstanding tokens
  (prompt + `n * max_tokens`). A group's samples are one request, so they share one replica
  and their prompt is computed once. Requests that share `GenRequest.group` (the episodes of an
  environment group, turn after turn) go where the first went while that replica is up, so
  their contexts stay in its prefix cache; a turn moves only when its replica goes down.
- **Faults.** A request whose replica died is resubmitted to another (on the newest version),
  up to `MAX_RESUBMITS` times, then counted lost. Its wait ends when Ray reports the death, or
  when the watcher finds the replica restarted (`health.answer`), whichever comes first.
  Watching, restarts and the all-down timeout are `health.py`'s.

Blocking calls (`register`, `close`) come from the orchestrator's threads; requests and the
watchers run on this generator's own asyncio loop thread, which awaits Ray's object refs.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Coroutine, TypeVar

from ...adapter_version import AdapterVersion, served_name
from ...handoff import PackMeta
from ..registry import LiveVersion, VersionRegistry, register_version
from ..spec import EngineSpec
from ..types import (CannotKeep, Delivery, GenRequest, GenResult, GeneratorDead, GenStatus, PublishStats,
                     hand_back)
from ..validate import BaseShapes, VersionCheck
from . import cluster as ray_cluster
from .health import PING_TIMEOUT_S, RayStats, ReplicaGone, ReplicaState, answer
from .replica import Replica
from .versions import ReplicaVersions

if TYPE_CHECKING:
    from ...config import RayGeneratorConfig, TrainConfig

T = TypeVar("T")

log = logging.getLogger(__name__)

ROUTE_POLL_S = 0.02  # how often a request waiting for a routable replica looks again
MAX_RESUBMITS = 3  # a request whose replica died is sent elsewhere this often, then counted lost
STICKY_GROUPS = 65536  # remembered group -> replica assignments (least recently used dropped)
REGISTRY_CAPACITY = 1 << 20  # the router only counts; each replica's engine bounds its own slots


class RayGenerator(ReplicaVersions):
    """Replicas of the in-process engine as Ray actors (implements `types.Generator[RayGenerator]`:
    its own receiver, through `add_object`); versions on the replicas are `versions.ReplicaVersions`'s,
    starting and watching them `health.ReplicaHealth`'s."""

    def __init__(self, spec: EngineSpec, model_name: str, replicas: int, *, address: str | None = None,
                 namespace: str = "lora-async", object_store_gb: float | None = None, device: str = "auto",
                 cpus_per_replica: int = 1, placement: str = "PACK", max_restarts: int = 3,
                 down_timeout_s: float = 180.0, start_timeout_s: float = 900.0, register_timeout_s: float = 120.0,
                 build_base: Callable[[Path], Path] | None = None) -> None:
        # Each replica keeps one version more than the window: see the module docstring.
        self.spec = dataclasses.replace(spec, window=spec.window.widened())
        self.down_timeout_s, self.start_timeout_s = down_timeout_s, start_timeout_s
        self.register_timeout_s = register_timeout_s
        self.stats = RayStats(replicas)
        self.registry = VersionRegistry(spec.window, REGISTRY_CAPACITY)
        self._lock = threading.RLock()  # the registry and the replica table, shared with the caller's threads
        self.check = VersionCheck(BaseShapes.from_model_dir(spec.model_dir), spec.max_lora_rank, self.registry,
                                  self.stats, self._lock)
        self._objects: dict[tuple[str, int], tuple[Any, PackMeta]] = {}  # live versions' (ref, meta), for catch-up
        self._sticky: collections.OrderedDict[object, int] = collections.OrderedDict()
        self._dead: str | None = None
        self._closed = False
        self._all_down_since: float | None = None
        self.cluster = ray_cluster.connect(address, namespace, object_store_gb, replicas, device, cpus_per_replica,
                                           placement)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lora-async-ray", daemon=True)
        self._thread.start()
        self._publish_lock = self._on_loop(self._make_lock()).result()
        self.replicas: list[ReplicaState] = []
        try:
            self.replicas = [ReplicaState(i, ray_cluster.create_replica(self.cluster, Replica, i, max_restarts,
                                                                        self.spec, model_name, i, build_base), None)
                             for i in range(replicas)]
            self._on_loop(self._start_all()).result(timeout=start_timeout_s + 60)
        except BaseException:
            self.close()
            raise
        self._watchers = [self._on_loop(self._watch(r)) for r in self.replicas]

    @classmethod
    def from_config(cls, config: TrainConfig, gen: RayGeneratorConfig, model_dir: Path,
                    build_base: Callable[[Path], Path] | None = None) -> "RayGenerator":
        """The replicas a run's `[generator]` (type "ray", `gen`) and `[ray]` describe."""
        from ...placement import cuda_available

        ray_config = config.ray
        here = cuda_available()
        on_gpu = gen.device == "gpu" or (gen.device == "auto" and here)
        spec = EngineSpec.from_config(config, model_dir, "cuda:0" if on_gpu and here else "cpu",
                                      separate_process=False)
        if on_gpu and not here and config.model.dtype == "auto":  # GPU replicas driven from a CPU-only machine
            spec = dataclasses.replace(spec, dtype="bfloat16")
        return cls(spec, config.model.name, gen.replicas, address=ray_config.address,
                   namespace=ray_config.namespace, object_store_gb=ray_config.object_store_gb,
                   device=gen.device, cpus_per_replica=gen.cpus_per_replica,
                   placement=gen.placement, max_restarts=gen.max_restarts,
                   down_timeout_s=gen.down_timeout_s, start_timeout_s=gen.start_timeout_s,
                   register_timeout_s=getattr(config.sync_config, "timeout_s", 120.0), build_base=build_base)

    # ------------------------------------------------------------------ the Generator protocol
    @property
    def serving_dtype(self) -> str:
        return self.spec.dtype

    def submit(self, request: GenRequest, on_done: Callable[[GenResult], None]) -> None:
        if self._dead is not None:
            raise GeneratorDead(self._dead)
        if self._closed:
            raise GeneratorDead("generator is closed")
        self._on_loop(self._run(request, on_done))

    def validate(self, version: AdapterVersion, values: bool = True) -> None:
        self.check(version, values)

    def register(self, delivery: Delivery[RayGenerator]) -> PublishStats:
        """`delivery.load(self, int_id)` registers the version on every routable replica
        (`add_object`: it returns the longest wait for a replica's engine step); only then is
        it the version new requests get."""
        if self._dead is not None:
            raise GeneratorDead(self._dead)
        return register_version(self.registry, delivery, self, self.stats, retire=self._retire, lock=self._lock)

    def with_receiver(self, fn: Callable[[RayGenerator], T]) -> T:
        return fn(self)

    def abort_older(self, adapter: str, min_version: int, tag: object) -> None:
        if self._closed:
            return
        for replica in self.replicas:
            if replica.routable:
                self._loop.call_soon_threadsafe(replica.actor.abort_older.remote, adapter, min_version, tag)

    def live_versions(self, adapter: str) -> list[int]:
        with self._lock:
            return self.registry.versions(adapter)

    def keep(self, adapter: str, version: int) -> None:
        raise CannotKeep(f"Ray replicas cannot keep frozen versions yet (needed for {served_name(adapter, version)})")

    def let_go(self, adapter: str, version: int) -> None:
        """Nothing is kept here."""

    def close(self) -> None:
        """Stop routing, stop every replica's engine, remove the actors and the placement group
        (and stop Ray if this run started it)."""
        import ray

        if self._closed:
            return
        self._closed = True
        for watcher in getattr(self, "_watchers", []):
            watcher.cancel()
        stops = [r.actor.shutdown.remote() for r in self.replicas]
        try:
            ray.get(stops, timeout=60)
        except Exception as exc:  # dead replicas have nothing to stop
            log.debug("replica shutdown: %s", exc)
        for replica in self.replicas:
            try:
                ray.kill(replica.actor, no_restart=True)
            except Exception as exc:
                log.debug("replica kill: %s", exc)
        self._objects.clear()
        try:  # requests still waiting end as CLOSED
            self._on_loop(self._cancel_tasks()).result(timeout=10)
        except Exception as exc:
            log.debug("cancelling requests: %s", exc)
        self.cluster.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ more, for tests and benchmarks
    def replica_info(self) -> list[dict]:
        """Each replica's ping (incarnation, pid, node, engine counters, live versions)."""
        import ray

        return ray.get([r.actor.ping.remote() for r in self.replicas], timeout=PING_TIMEOUT_S)

    def call_replica(self, index: int, method: str, *args: Any, timeout_s: float = PING_TIMEOUT_S * 4) -> Any:
        """Call a replica actor's method and wait up to `timeout_s` (tests, benchmarks)."""
        import ray

        return ray.get(getattr(self.replicas[index].actor, method).remote(*args), timeout=timeout_s)

    def routable(self) -> list[int]:
        return [r.index for r in self.replicas if r.routable]

    def __enter__(self) -> "RayGenerator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ requests (on the loop)
    async def _run(self, request: GenRequest, on_done: Callable[[GenResult], None]) -> None:
        try:
            await self._serve(request, on_done)
        except asyncio.CancelledError:  # the generator is closing
            hand_back(on_done, GenResult.failed(request, GenStatus.CLOSED, "generator closed"))
            raise

    async def _serve(self, request: GenRequest, on_done: Callable[[GenResult], None]) -> None:
        errors: tuple[type[BaseException], ...] = (*ray_cluster.actor_errors(), ReplicaGone)
        resubmits = 0
        while True:
            replica = await self._route(request)
            if replica is None:
                status = GenStatus.CLOSED if self._closed and self._dead is None else GenStatus.ENGINE_DEAD
                hand_back(on_done, GenResult.failed(request, status, self._dead or "generator closed"))
                return
            try:
                with self._lock:
                    live = self.registry.acquire(request.adapter) if request.adapter is not None else None
            except Exception as exc:
                hand_back(on_done, GenResult.failed(request, GenStatus.REFUSED, f"refused: {exc}"))
                return
            pinned = dataclasses.replace(request, version=live.version if live is not None else None)
            cost = len(request.prompt_ids) + request.n * request.max_tokens
            replica.outstanding += cost
            replica.in_flight += 1
            self.stats.request_started()
            self.stats.replica_request(replica.index)
            failure: BaseException | None = None
            try:
                result: GenResult = await answer(replica.actor.generate.remote(pinned), replica.gone,
                                                 f"replica {replica.index}")
            except errors as exc:
                failure = exc
            except Exception as exc:  # the replica raised: this request failed, the replica is fine
                result = GenResult.failed(request, GenStatus.FAILED, f"replica {replica.index}: {exc}")
            finally:
                replica.outstanding -= cost
                replica.in_flight -= 1
                self._release(live)
            if failure is None:
                result.request = request
                tokens = sum(len(s.token_ids) for s in result.samples)
                self.stats.tokens_drawn(tokens)
                self.stats.replica_tokens_drawn(replica.index, tokens)
                hand_back(on_done, result)
                return
            self._mark_down(replica, failure)
            if resubmits >= MAX_RESUBMITS or self._closed:
                self.stats.request_lost()
                hand_back(on_done, GenResult.failed(request, GenStatus.FAILED,
                                                    f"lost: its replica died {resubmits + 1} times ({failure})"))
                return
            resubmits += 1
            self.stats.request_resubmitted()

    async def _route(self, request: GenRequest) -> ReplicaState | None:
        """The replica for `request`, waiting while none is routable; None once dead or closed."""
        while True:
            if self._dead is not None or self._closed:
                return None
            up = [r for r in self.replicas if r.routable]
            if up:
                return self._pick(request, up)
            await asyncio.sleep(ROUTE_POLL_S)

    def _pick(self, request: GenRequest, up: list[ReplicaState]) -> ReplicaState:
        if request.group is not None:
            index = self._sticky.get(request.group)
            if index is not None and self.replicas[index].routable:
                self._sticky.move_to_end(request.group)
                return self.replicas[index]
        replica = min(up, key=lambda r: (r.outstanding, r.in_flight, r.index))
        if request.group is not None:
            self._sticky[request.group] = replica.index
            self._sticky.move_to_end(request.group)
            while len(self._sticky) > STICKY_GROUPS:
                self._sticky.popitem(last=False)
        return replica

    def _release(self, live: LiveVersion | None) -> None:
        if live is None:
            return
        with self._lock:
            if self.registry.release(live):
                self._retire(live)

    def _retire(self, live: LiveVersion) -> str:
        """Drained on every replica and out of the window: forget it (each replica's engine
        drops its own copy by the wider window) and let its object go."""
        self.registry.remove(live)
        self._objects.pop((live.adapter, live.version), None)
        return live.served_name

    # ------------------------------------------------------------------ plumbing
    @staticmethod
    async def _make_lock() -> asyncio.Lock:
        return asyncio.Lock()

    @staticmethod
    async def _cancel_tasks() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _on_loop(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)
