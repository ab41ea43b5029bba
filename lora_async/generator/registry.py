"""Which adapter versions are live in the engine, under which vLLM name and id, and who uses them.

Pure bookkeeping (no vLLM import), so the rules are unit-tested on their own:

- a version is served under the name `<adapter>@v<k>` (`adapter_version.served_name`) and an
  int id that is never reused (vLLM keys its prefix cache by name and its LoRA cache by id;
  reuse serves stale weights);
- versions of one adapter are published in increasing order;
- new requests always take the newest version; each request is counted in flight on the
  version it started with until it finishes;
- a version is retired once nothing in flight uses it and it is outside the staleness window
  (`StalenessWindow.retirable`), unless it is kept: a frozen opponent (a league's past version,
  a pinned `main@v0`) stays registered, outside the window's retirement, until it is let go.

`register_version` is how every generator registers a delivered version (the engine, remote
servers, the Ray router): each passes only what differs (a lock, making room, a queue wait).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from ..adapter_version import served_name
from ..staleness import StalenessWindow
from .types import Delivery, GeneratorStats, PublishStats

R = TypeVar("R")


@dataclass
class LiveVersion:
    adapter: str
    version: int
    int_id: int
    in_flight: int = 0
    path: str | None = None  # set when vLLM loaded this version from a PEFT directory

    @property
    def served_name(self) -> str:
        return served_name(self.adapter, self.version)


class RegistryError(Exception):
    pass


class VersionRegistry:
    def __init__(self, window: StalenessWindow, capacity: int) -> None:
        self.window = window
        self.capacity = capacity  # versions the engine can hold registered at once
        self._next_id = 1
        self._live: dict[str, dict[int, LiveVersion]] = {}
        self._newest: dict[str, int] = {}
        self._kept: set[tuple[str, int]] = set()  # frozen opponents: never retired while kept
        self.published = 0
        self.retired = 0

    # ---- publishing
    def check_new(self, adapter: str, version: int) -> None:
        newest = self._newest.get(adapter)
        if newest is not None and version <= newest:
            raise RegistryError(
                f"{adapter}: version {version} is not newer than the live v{newest} "
                "(versions are monotonic and never reused)"
            )

    def reserve_id(self) -> int:
        """A fresh int id; consumed even if the registration then fails (ids are never reused)."""
        int_id = self._next_id
        self._next_id += 1
        return int_id

    def add(self, adapter: str, version: int, int_id: int | None = None) -> LiveVersion:
        self.check_new(adapter, version)
        live = LiveVersion(adapter, version, self.reserve_id() if int_id is None else int_id)
        self._live.setdefault(adapter, {})[version] = live
        self._newest[adapter] = version
        self.published += 1
        return live

    def total_live(self) -> int:
        return sum(len(v) for v in self._live.values())

    def is_full(self) -> bool:
        return self.total_live() >= self.capacity

    # ---- requests
    def acquire(self, adapter: str, version: int | None = None) -> LiveVersion:
        """Count a request in flight on `version` (None: the newest) of `adapter`."""
        if adapter not in self._newest:
            raise RegistryError(f"adapter {adapter!r} has no published version")
        wanted = self._newest[adapter] if version is None else version
        live = self._live[adapter].get(wanted)
        if live is None:
            raise RegistryError(f"{served_name(adapter, wanted)} is not live here (live: {self.versions(adapter)})")
        live.in_flight += 1
        return live

    def release(self, live: LiveVersion) -> bool:
        """One request on `live` ended. True when the version should be retired now (drained
        and outside the window)."""
        if live.in_flight <= 0:
            raise RegistryError(f"{live.served_name}: release without acquire")
        live.in_flight -= 1
        return live.in_flight == 0 and self.outside_window(live)

    # ---- keeping (frozen opponents)
    def keep(self, adapter: str, version: int) -> None:
        """Keep a live version registered whatever the window says, until `let_go`."""
        if version not in self._live.get(adapter, {}):
            raise RegistryError(f"{served_name(adapter, version)} is not live here, so it cannot be kept "
                                f"(live: {self.versions(adapter)})")
        self._kept.add((adapter, version))

    def let_go(self, adapter: str, version: int) -> LiveVersion | None:
        """Stop keeping a version; returns it when it should be retired now (drained and outside
        the window)."""
        self._kept.discard((adapter, version))
        live = self._live.get(adapter, {}).get(version)
        return live if live is not None and live.in_flight == 0 and self.outside_window(live) else None

    def kept(self) -> list[tuple[str, int]]:
        return sorted(self._kept)

    # ---- retiring
    def outside_window(self, live: LiveVersion) -> bool:
        """Nothing will train on it any more and it is not kept: it may go once drained."""
        if (live.adapter, live.version) in self._kept:
            return False
        return self.window.retirable(live.version, self._newest[live.adapter])

    def retirable(self) -> list[LiveVersion]:
        """Versions to remove from the engine now: drained and outside the window."""
        return [
            live
            for versions in self._live.values()
            for live in versions.values()
            if live.in_flight == 0 and self.outside_window(live)
        ]

    def oldest_outside_window(self) -> LiveVersion | None:
        """The version to evict when the engine is full (its requests are aborted first)."""
        stale = [
            live for versions in self._live.values() for live in versions.values()
            if self.outside_window(live)
        ]
        return min(stale, key=lambda lv: lv.int_id) if stale else None

    def remove(self, live: LiveVersion) -> None:
        self._live[live.adapter].pop(live.version, None)
        self.retired += 1

    # ---- inspection
    def newest(self, adapter: str) -> int | None:
        return self._newest.get(adapter)

    def versions(self, adapter: str) -> list[int]:
        return sorted(self._live.get(adapter, {}))

    def all_live(self) -> list[LiveVersion]:
        return [live for versions in self._live.values() for live in versions.values()]


def register_version(registry: VersionRegistry, delivery: Delivery[R], receiver: R, stats: GeneratorStats, *,
                     retire: Callable[[LiveVersion], str], lock: contextlib.AbstractContextManager[Any] | None = None,
                     make_room: Callable[[], None] | None = None, waited_ms: float = 0.0) -> PublishStats:
    """Register `delivery` with `receiver`, the one way every generator does it.

    The version must be newer than the live ones; it gets a fresh int id, consumed even if the
    load fails (ids are never reused). A load that raises counts a rejected version and
    re-raises, leaving nothing registered. Then the version is live (new requests get it) and
    whatever it pushed out of the window and is drained is retired (`retire` removes it from
    the engines and returns its name). `lock` guards the registry where other threads share it
    (it is not held while loading); `make_room` runs when the registry is full (the engine's
    eviction). `waited_ms`: time already spent waiting for an engine step (the engine's queue),
    added to what the load reports it waited, and kept apart from the work in `ms`."""
    guard = lock if lock is not None else contextlib.nullcontext()
    with guard:
        registry.check_new(delivery.adapter, delivery.version)
        if make_room is not None and registry.is_full():
            make_room()
        int_id = registry.reserve_id()
    try:
        load_wait_ms = delivery.load(receiver, int_id)
    except Exception:
        stats.version_rejected()
        raise
    with guard:
        live = registry.add(delivery.adapter, delivery.version, int_id)
        live.path = delivery.path
        retired = [retire(old) for old in registry.retirable()]
    wait_ms = waited_ms + (load_wait_ms or 0.0)
    total_ms = (time.perf_counter() - delivery.started) * 1000
    return PublishStats(delivery.adapter, delivery.version, live.served_name, int_id, delivery.nbytes,
                        ms=total_ms - wait_ms, retired=retired, wait_ms=wait_ms, transport=delivery.transport)
