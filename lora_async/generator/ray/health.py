"""The replicas' side of `RayGenerator`: their state, starting them, and watching them.

- `ReplicaState` is the router's view of one replica (routable, outstanding tokens, the newest
  version it registered, its incarnation); `RayStats` adds the replicas' counters to
  `GeneratorStats`.
- `ReplicaHealth` (the base of `versions.ReplicaVersions`, itself the base of `RayGenerator`)
  starts every replica's engine at the run's start, and runs one watcher per replica: a ping
  every `WATCH_S`; a dead or silent replica leaves routing; a new incarnation (Ray restarted the
  actor) ends the wait of every call still held by the old one (`answer`), and is started and
  caught up (`ReplicaVersions._catch_up`) before it routes again; every replica down longer
  than `down_timeout_s` kills the generator. It runs on the generator's asyncio loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, TypeVar

from ..types import GeneratorStats
from . import cluster as ray_cluster

log = logging.getLogger(__name__)
T = TypeVar("T")

WATCH_S = 0.5  # how often each replica is pinged
PING_TIMEOUT_S = 15.0  # a replica that does not answer a ping for this long is taken out of routing


class RayStats(GeneratorStats):
    """GeneratorStats plus the replicas: restarts, resubmitted and lost requests, work per replica.
    `busy_s`, `steps` and `running` are the replicas' engine figures, averaged over replicas
    (so `1 - busy/elapsed` is the mean replica idle share)."""

    def __init__(self, replicas: int) -> None:
        super().__init__()
        self.replica_restarts = 0
        self.groups_resubmitted = 0
        self.groups_lost = 0
        self.replica_requests = [0] * replicas
        self.replica_tokens = [0] * replicas
        self.replicas_routable = 0

    def replica_request(self, index: int) -> None:
        with self._lock:
            self.replica_requests[index] += 1

    def replica_tokens_drawn(self, index: int, tokens: int) -> None:
        with self._lock:
            self.replica_tokens[index] += tokens

    def request_resubmitted(self) -> None:
        with self._lock:
            self.groups_resubmitted += 1

    def request_lost(self) -> None:
        with self._lock:
            self.groups_lost += 1

    def replica_restarted(self) -> None:
        with self._lock:
            self.replica_restarts += 1

    def replica_figures(self) -> dict[str, Any]:
        with self._lock:
            return {"replica_tokens": list(self.replica_tokens), "replica_requests": list(self.replica_requests),
                    "replicas_routable": self.replicas_routable, "replica_restarts": self.replica_restarts,
                    "groups_resubmitted": self.groups_resubmitted, "groups_lost": self.groups_lost}


@dataclass
class ReplicaState:
    """The router's view of one replica."""

    index: int
    actor: Any
    slot: int | None  # its position among the replicas on its node (which of the node's cores it pins)
    incarnation: str | None = None
    node: str | None = None
    pid: int | None = None
    routable: bool = False
    versions: dict[str, int] = field(default_factory=dict)  # the newest version it registered, per adapter
    outstanding: int = 0  # tokens it was asked for and has not returned
    in_flight: int = 0
    seen: dict[str, float] = field(default_factory=dict)  # engine counters at the last ping (this incarnation)
    down_since: float | None = None
    last_error: str | None = None
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # set when this incarnation is replaced

    def replaced(self) -> None:
        """Its process was replaced: wake every call still waiting on the old one (`answer`)."""
        self.gone.set()
        self.gone = asyncio.Event()


class ReplicaGone(Exception):
    """A call's replica was replaced while the call waited: its answer will never come."""


async def answer(call: Awaitable[T], gone: asyncio.Event, what: str) -> T:
    """`call`'s result, or ReplicaGone once `gone` is set. A call to an actor that was killed can
    stay pending after Ray restarts the actor (seen under load: a request waited 600 s on a
    replica restarted at its second minute), so the watcher's proof that the process was
    replaced ends the wait, and the request goes to another replica."""
    pending = asyncio.ensure_future(call)
    waiter = asyncio.ensure_future(gone.wait())
    try:
        await asyncio.wait({pending, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not pending.done():
            pending.cancel()
    if pending.done() and not pending.cancelled():
        return pending.result()
    raise ReplicaGone(f"{what}: its process was replaced while it held this call")


class ReplicaHealth:
    """Starting and watching the replicas; `RayGenerator` provides the state named here."""

    replicas: list[ReplicaState]
    cluster: ray_cluster.Cluster
    stats: RayStats
    start_timeout_s: float
    down_timeout_s: float
    _dead: str | None
    _closed: bool
    _all_down_since: float | None

    async def _catch_up(self, replica: ReplicaState) -> None:
        raise NotImplementedError

    async def _start_all(self) -> None:
        """Start every replica's engine at once; one that fails stops the run with its error."""
        infos = await asyncio.gather(*(r.actor.ping.remote() for r in self.replicas))
        by_node: dict[str | None, int] = {}
        for replica, info in zip(self.replicas, infos):
            replica.slot = None if self.cluster.use_gpu else by_node.setdefault(info["node"], 0)
            by_node[info["node"]] = (replica.slot or 0) + 1
        await asyncio.gather(*(self._first_start(r) for r in self.replicas))

    async def _first_start(self, replica: ReplicaState) -> None:
        """`_bring_up` at the run's start, its failure as one line (RayError)."""
        from ray.exceptions import RayTaskError

        try:
            await self._bring_up(replica)
        except asyncio.TimeoutError:
            raise ray_cluster.RayError(f"replica {replica.index}: its engine did not start within "
                                       f"{self.start_timeout_s:.0f} s (generator.start_timeout_s)") from None
        except RayTaskError as exc:
            cause = getattr(exc, "cause", None) or exc
            raise ray_cluster.RayError(f"replica {replica.index}: its engine did not start: "
                                       f"{type(cause).__name__}: {str(cause).splitlines()[-1] if str(cause) else ''}"
                                       ) from None

    async def _bring_up(self, replica: ReplicaState) -> None:
        info = await asyncio.wait_for(replica.actor.start.remote(replica.slot, self.cluster.cpus_per_replica),
                                      self.start_timeout_s)
        replica.incarnation, replica.node, replica.pid = info["incarnation"], info["node"], info["pid"]
        replica.versions, replica.seen = {}, {}
        await self._catch_up(replica)

    async def _watch(self, replica: ReplicaState) -> None:
        """Ping one replica for the life of the generator: notice deaths, restarts, catch-ups."""
        silent: tuple[type[BaseException], ...] = (asyncio.TimeoutError, *ray_cluster.actor_errors())
        while not self._closed:
            await asyncio.sleep(WATCH_S)
            try:
                info = await asyncio.wait_for(replica.actor.ping.remote(), PING_TIMEOUT_S)
            except silent as exc:
                self._mark_down(replica, exc)
                self._check_all_down()
                continue
            except Exception as exc:  # Ray itself failing: treat like a silent replica
                self._mark_down(replica, exc)
                self._check_all_down()
                continue
            try:
                if info["incarnation"] != replica.incarnation:
                    await self._restarted(replica)
                elif not replica.routable:
                    await self._catch_up(replica)
                else:
                    self._count(replica, info)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # its engine failed to start or to register: try again next round
                replica.routable = False
                if str(exc) != replica.last_error:  # shown once, not on every round
                    log.warning("replica %d is not back yet: %s", replica.index, exc)
                replica.last_error = str(exc)
            self._check_all_down()

    async def _restarted(self, replica: ReplicaState) -> None:
        replica.routable = False
        replica.replaced()
        self.stats.replica_restarted()
        log.warning("replica %d was restarted by Ray; starting its engine and registering the live versions",
                    replica.index)
        await self._bring_up(replica)

    def _mark_down(self, replica: ReplicaState, error: BaseException) -> None:
        if replica.routable:
            log.warning("replica %d is down (%s); out of routing", replica.index, type(error).__name__)
        replica.routable = False
        replica.last_error = str(error)
        if replica.down_since is None:
            replica.down_since = time.monotonic()

    def _check_all_down(self) -> None:
        up = sum(r.routable for r in self.replicas)
        self.stats.replicas_routable = up
        if up:
            self._all_down_since = None
            return
        now = time.monotonic()
        if self._all_down_since is None:
            self._all_down_since = now
        elif now - self._all_down_since > self.down_timeout_s and self._dead is None:
            errors = "; ".join(f"replica {r.index}: {r.last_error}" for r in self.replicas)
            self._dead = (f"every generator replica has been down for more than {self.down_timeout_s:.0f} s "
                          f"(generator.down_timeout_s): {errors}")
            log.error(self._dead)

    def _count(self, replica: ReplicaState, info: dict) -> None:
        """Add the engine counters' growth since the last ping (averaged over replicas)."""
        n = len(self.replicas)
        deltas = {}
        for key in ("busy_s", "steps", "running"):
            value = float(info.get(key) or 0.0)
            deltas[key] = max(0.0, value - replica.seen.get(key, 0.0)) / n
            replica.seen[key] = value
        self.stats.engine_busy(deltas["busy_s"], steps=deltas["steps"], running=deltas["running"])
