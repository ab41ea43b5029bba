"""The Ray router's versions: registering one on every replica, and catching a replica up.

- **All or nothing.** The `ray` transport packs a version once and `ray.put`s it; `add_object`
  (the router's receiver, `receivers.ReplicaReceiver`) has every routable replica register it
  from the object store (zero-copy on its node, one transfer per node), each checking the
  checksum itself. If every replica refuses it (a damaged object), it is refused (`PackError`)
  and the previous version keeps serving. A replica that fails to register while others
  succeed is taken out of routing and catches up from the same object before it takes traffic
  again, so it is never asked for a version it does not hold.
- **Catch-up.** A replica that comes back (restarted by Ray, or out of routing after a failed
  registration) registers every live version it lacks, oldest first, before it routes again
  (`_catch_up`, called by `health.ReplicaHealth`'s watcher). The objects of live versions are
  kept for that, and dropped with their version.

Runs on the generator's asyncio loop; one registration at a time (`_publish_lock`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Coroutine

from ...handoff import PackError, PackMeta
from ..types import GeneratorDead
from . import cluster as ray_cluster
from .health import WATCH_S, ReplicaHealth, ReplicaState

log = logging.getLogger(__name__)


class ReplicaVersions(ReplicaHealth):
    """Versions on the replicas; `RayGenerator` (the router) provides the state named here."""

    register_timeout_s: float
    _publish_lock: asyncio.Lock
    _objects: dict[tuple[str, int], tuple[Any, PackMeta]]  # live versions: (ref, meta), kept for catch-up

    def _on_loop(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        raise NotImplementedError

    def add_object(self, ref: Any, meta: PackMeta) -> float:
        """Register the packed version in `ref` (a Ray object) on every routable replica; the
        `ray` transport's deliveries call this. Raises PackError when every replica refused it.
        Returns the longest time a replica waited for its engine to finish a step (ms): like
        the in-process engine's `wait_ms`, generation going on, not sync work."""
        return float(self._on_loop(self._fan_out(ref, meta)).result())

    async def _fan_out(self, ref: Any, meta: PackMeta) -> float:
        async with self._publish_lock:
            while True:
                targets = await self._routable_or_wait()
                outcomes = await asyncio.gather(*(self._add_version(r, ref, meta) for r in targets),
                                                return_exceptions=True)
                done = [r for r, out in zip(targets, outcomes) if not isinstance(out, BaseException)]
                failed = [(r, out) for r, out in zip(targets, outcomes) if isinstance(out, BaseException)]
                refusals = [out for _, out in failed if isinstance(out, PackError)]
                if done:
                    self._objects[(meta.adapter, meta.version)] = (ref, meta)
                    waits = [out["wait_ms"] for out in outcomes if isinstance(out, dict)]
                    for replica, error in failed:  # out of routing until the watcher has caught it up
                        replica.routable = False
                        replica.last_error = f"could not register {meta.served_name}: {error}"
                        log.warning("replica %d: %s; out of routing until it catches up", replica.index,
                                    replica.last_error)
                    return float(max(waits, default=0.0))
                if refusals and len(refusals) == len(failed):
                    raise refusals[0]  # every replica refused the object: the version is refused
                if not refusals and self._dead is None and not self._closed:
                    continue  # every target died or hung (now out of routing): wait for one to come back
                raise refusals[0] if refusals else GeneratorDead(f"no replica could register {meta.served_name}: "
                                                                 f"{failed[0][1]}")

    async def _add_version(self, replica: ReplicaState, ref: Any, meta: PackMeta) -> dict[str, float]:
        """Register one version on one replica (its `ms` and `wait_ms`); a dead replica is marked
        down, a refusal is a PackError."""
        from ray.exceptions import RayTaskError

        try:
            timing: dict[str, float] = await asyncio.wait_for(replica.actor.add_version.remote(meta, ref),
                                                              self.register_timeout_s)
        except ray_cluster.actor_errors() as exc:
            self._mark_down(replica, exc)
            raise
        except asyncio.TimeoutError as exc:  # a hung replica leaves routing like a dead one
            error = GeneratorDead(f"replica {replica.index} did not register within {self.register_timeout_s:.0f} s")
            self._mark_down(replica, error)
            raise error from exc
        except RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, PackError) or isinstance(exc, PackError):
                raise PackError(f"replica {replica.index}: {cause or exc}") from None
            raise
        replica.versions[meta.adapter] = max(meta.version, replica.versions.get(meta.adapter, -1))
        return timing

    async def _routable_or_wait(self) -> list[ReplicaState]:
        while True:
            if self._dead is not None:
                raise GeneratorDead(self._dead)
            if self._closed:
                raise GeneratorDead("generator is closed")
            up = [r for r in self.replicas if r.routable]
            if up:
                return up
            await asyncio.sleep(WATCH_S)

    async def _catch_up(self, replica: ReplicaState) -> None:
        """Register every live version the replica lacks, oldest first; then route to it."""
        async with self._publish_lock:
            for (adapter, version), (ref, meta) in sorted(self._objects.items(), key=lambda kv: kv[0][1]):
                if version > replica.versions.get(adapter, -1):
                    await self._add_version(replica, ref, meta)
            replica.routable = True
            replica.down_since = None
            replica.last_error = None
