"""Version bookkeeping: names, ids, in-flight counts, retirement by the staleness window, and
the one register routine every generator uses (with a fake receiver: no engine)."""

import threading
from pathlib import Path

import pytest

from lora_async.adapter_version import parse_served_name, served_name
from lora_async.generator.registry import LiveVersion, RegistryError, VersionRegistry, register_version
from lora_async.generator.spec import EngineSpec
from lora_async.generator.types import Delivery, GeneratorStats
from lora_async.staleness import StalenessWindow


def test_names_embed_versions_and_ids_are_never_reused():
    reg = VersionRegistry(StalenessWindow(1), capacity=10)
    seen = set()
    for v in range(6):
        live = reg.add("a", v)
        assert live.served_name == f"a@v{v}"
        assert live.int_id not in seen
        seen.add(live.int_id)
        for old in reg.retirable():
            reg.remove(old)
    reg.reserve_id()  # a failed registration still burns its id
    assert reg.add("b", 0).int_id == max(seen) + 2


@pytest.mark.parametrize("adapter, version", [("a", 0), ("fine-name_2", 13), ("_x", 100000)])
def test_a_served_name_parses_back_to_its_adapter_and_version(adapter, version):
    assert parse_served_name(served_name(adapter, version)) == (adapter, version)


@pytest.mark.parametrize("name", ["a", "a@v", "a@vx", "a@v-1", "@v1", "a b@v1", "../a@v1", "a@v1/..", ".a@v1.tmp"])
def test_anything_but_a_served_name_is_refused(name):
    with pytest.raises(ValueError, match="is not '<name>@v<k>'"):
        parse_served_name(name)


def test_versions_must_increase():
    reg = VersionRegistry(StalenessWindow(1), 10)
    reg.add("a", 3)
    with pytest.raises(RegistryError):
        reg.add("a", 3)
    with pytest.raises(RegistryError):
        reg.add("a", 2)


def test_a_kept_version_outlives_the_window_until_it_is_let_go():
    """A frozen opponent (a league's past version) stays registered however far the newest moves
    on, is never the one evicted from a full engine, and retires once let go and drained."""
    reg = VersionRegistry(StalenessWindow(1), capacity=10)
    v0 = reg.add("a", 0)
    reg.keep("a", 0)
    for v in range(1, 6):
        reg.add("a", v)
        for old in reg.retirable():
            reg.remove(old)
    assert reg.versions("a") == [0, 4, 5] and reg.kept() == [("a", 0)]
    assert reg.oldest_outside_window() is None  # nothing else is outside: the kept one is not a candidate
    held = reg.acquire("a", 0)  # a request pinned to it
    assert reg.let_go("a", 0) is None  # in flight: not yet
    assert reg.release(held) and reg.retirable() == [v0]
    with pytest.raises(RegistryError, match="not live"):
        reg.keep("a", 1)  # retired long ago: nothing to keep


def test_retire_only_drained_versions_outside_the_window():
    reg = VersionRegistry(StalenessWindow(1), capacity=10)
    v0 = reg.add("a", 0)
    held = reg.acquire("a")
    assert held is v0 and v0.in_flight == 1
    reg.add("a", 1)
    assert reg.retirable() == []  # v0 is inside the window (newest - 1)
    reg.add("a", 2)
    assert reg.retirable() == []  # v0 is outside, but still in flight
    reg.release(held)
    assert reg.retirable() == [v0]
    reg.remove(v0)
    assert reg.versions("a") == [1, 2]


def test_new_requests_take_the_newest_version():
    reg = VersionRegistry(StalenessWindow(0), 10)
    reg.add("a", 0)
    reg.add("a", 1)
    assert reg.acquire("a").version == 1
    with pytest.raises(RegistryError):
        reg.acquire("missing")


def test_capacity_and_eviction_candidate():
    reg = VersionRegistry(StalenessWindow(0), capacity=2)
    v0 = reg.add("a", 0)
    reg.acquire("a")
    reg.add("a", 1)
    assert reg.is_full()
    assert reg.oldest_outside_window() is v0


# ---------------------------------------------------------------- the staleness window, as registry and engine ask it


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_the_registry_keeps_exactly_the_windows_live_versions(max_staleness):
    """Published in order with nothing in flight, each adapter keeps `live_versions` versions:
    the newest and the `max_staleness` before it (the ones the window admits)."""
    window = StalenessWindow(max_staleness)
    reg = VersionRegistry(window, capacity=100)
    for v in range(8):
        reg.add("a", v)
        for old in reg.retirable():
            assert window.retirable(old.version, v) and not window.admits(v - old.version)
            reg.remove(old)
        assert reg.versions("a") == list(range(max(0, v - max_staleness), v + 1))
        assert len(reg.versions("a")) == min(v + 1, window.live_versions)


def test_an_adapter_window_is_its_own():
    reg = VersionRegistry(StalenessWindow(0), capacity=100)
    reg.add("a", 0)
    reg.add("b", 0)
    reg.add("a", 1)
    assert [(lv.adapter, lv.version) for lv in reg.retirable()] == [("a", 0)]  # b@v0 is b's newest


@pytest.mark.parametrize("max_staleness, adapters, slots", [(0, 1, (2, 3)), (1, 1, (3, 4)), (1, 3, (7, 10)),
                                                            (2, 3, (10, 13))])
def test_engine_slots_hold_every_live_version_plus_one_being_published(max_staleness, adapters, slots):
    """max_loras: every live version of every adapter plus one being published share a batch;
    max_cpu_loras: one draining version per adapter beside them. Read off the window, so a
    registry of that window never outgrows the engine."""
    spec = EngineSpec(Path("."), tuple(f"a{i}" for i in range(adapters)), StalenessWindow(max_staleness), 8)
    assert (spec.max_loras, spec.max_cpu_loras) == slots
    assert spec.max_loras == adapters * spec.window.live_versions + 1
    reg = VersionRegistry(spec.window, spec.max_cpu_loras)

    def retire(live: LiveVersion) -> str:
        reg.remove(live)
        return live.served_name

    held: list[LiveVersion] = []
    most = 0
    for v in range(6):  # every adapter publishes while a request still runs on its oldest live version
        for i in range(adapters):
            register_version(reg, Delivery(f"a{i}", v, 1, "fake", lambda r, int_id: None), None, GeneratorStats(),
                             retire=retire, make_room=lambda: pytest.fail("a registry sized from its window is full"))
        most = max(most, reg.total_live())
        for live in held:  # those requests end now
            if reg.release(live):
                retire(live)
        held = [reg.acquire(f"a{i}", reg.versions(f"a{i}")[0]) for i in range(adapters)]
    assert most == adapters * (spec.window.live_versions + 1) <= spec.max_cpu_loras


def test_a_widened_window_keeps_one_version_more():
    window = StalenessWindow(1)
    assert window.widened() == StalenessWindow(2)
    assert window.widened().live_versions == window.live_versions + 1
    assert not window.widened().retirable(3, 5) and window.retirable(3, 5)


# ---------------------------------------------------------------- register_version


class FakeReceiver:
    """Holds what deliveries load into it; refuses the ids in `refuse`."""

    def __init__(self, refuse=()):
        self.held: dict[int, str] = {}
        self.refuse = set(refuse)
        self.removed: list[str] = []

    def load(self, name: str, int_id: int) -> float | None:
        if int_id in self.refuse:
            raise ValueError(f"refused {name}")
        self.held[int_id] = name
        return None


def delivery(adapter, version, wait_ms=None):
    def load(receiver: FakeReceiver, int_id: int) -> float | None:
        receiver.load(f"{adapter}@v{version}", int_id)
        return wait_ms
    return Delivery(adapter, version, 100, "fake", load, path=f"/tmp/{adapter}{version}")


def registrar(window=StalenessWindow(1), refuse=()):
    reg, receiver, stats = VersionRegistry(window, capacity=10), FakeReceiver(refuse), GeneratorStats()

    def retire(live):
        receiver.held.pop(live.int_id)
        receiver.removed.append(live.served_name)
        reg.remove(live)
        return live.served_name

    def register(d, **kwargs):
        return register_version(reg, d, receiver, stats, retire=retire, **kwargs)
    return reg, receiver, stats, register


def test_a_registered_version_is_live_under_a_fresh_id_with_its_stats():
    reg, receiver, stats, register = registrar()
    published = register(delivery("a", 0))
    assert (published.adapter, published.version, published.served_name, published.bytes) == ("a", 0, "a@v0", 100)
    assert receiver.held == {published.int_id: "a@v0"} and reg.versions("a") == [0]
    assert reg.all_live()[0].path == "/tmp/a0" and published.transport == "fake" and published.retired == []
    assert published.ms >= 0 and published.wait_ms == 0 and stats.rejected_versions == 0


def test_a_failed_load_registers_nothing_counts_a_rejection_and_burns_its_id():
    reg, receiver, stats, register = registrar(refuse={2})
    first = register(delivery("a", 0))
    with pytest.raises(ValueError, match="refused a@v1"):
        register(delivery("a", 1))
    assert stats.rejected_versions == 1
    assert reg.versions("a") == [0] and reg.newest("a") == 0 and list(receiver.held) == [first.int_id]
    again = register(delivery("a", 1))  # the same version, delivered again, gets a new id
    assert again.int_id == 3 and receiver.held == {first.int_id: "a@v0", 3: "a@v1"}


def test_a_version_that_is_not_newer_is_refused_before_loading():
    reg, receiver, stats, register = registrar()
    register(delivery("a", 1))
    with pytest.raises(RegistryError, match="not newer"):
        register(delivery("a", 1))
    assert stats.rejected_versions == 0 and len(receiver.held) == 1  # a bookkeeping error, not a bad version


def test_registering_retires_what_left_the_window_and_ids_are_never_reused():
    reg, receiver, stats, register = registrar(StalenessWindow(1))
    ids = []
    for v in range(5):
        published = register(delivery("a", v))
        ids.append(published.int_id)
        assert published.retired == ([f"a@v{v - 2}"] if v >= 2 else [])
    assert len(set(ids)) == 5 and ids == sorted(ids)
    assert reg.versions("a") == [3, 4] and receiver.removed == ["a@v0", "a@v1", "a@v2"]


def test_a_version_in_flight_is_retired_only_once_it_drains():
    reg, receiver, stats, register = registrar(StalenessWindow(0))
    register(delivery("a", 0))
    held = reg.acquire("a")
    assert register(delivery("a", 1)).retired == []  # still in flight on v0
    assert reg.release(held)  # drained and outside: the generator retires it now
    assert register(delivery("a", 2)).retired == ["a@v0", "a@v1"]


def test_waits_are_kept_apart_from_the_work(monkeypatch):
    """The engine's queue wait and the replicas' reported wait are `wait_ms`, not `ms`: of a
    hand-off that took 80 ms from its tensors being ready, 20 + 30 waiting, 30 were work."""
    from types import SimpleNamespace

    from lora_async.generator import registry as registry_module

    reg, receiver, stats, register = registrar()
    handed = delivery("a", 0, wait_ms=30.0)
    monkeypatch.setattr(registry_module, "time", SimpleNamespace(perf_counter=lambda: handed.started + 0.080))
    published = register(handed, waited_ms=20.0)
    assert published.wait_ms == 50.0 and published.ms == pytest.approx(30.0)


def test_make_room_runs_under_the_lock_when_full_and_the_load_runs_outside_it():
    """The engine evicts (`make_room`) only when full; the router's and the servers' lock guards
    the bookkeeping but is not held while replicas load (requests go on meanwhile)."""
    reg, receiver, stats, register = registrar(StalenessWindow(5))
    reg.capacity = 2
    lock = threading.Lock()
    made_room = []

    def make_room() -> None:
        assert lock.locked()
        made_room.append(reg.total_live())

    def load(receiver: FakeReceiver, int_id: int) -> None:
        assert not lock.locked()

    for v in range(3):
        register(Delivery("a", v, 1, "fake", load), make_room=make_room, lock=lock)
    assert made_room == [2] and reg.versions("a") == [0, 1, 2]
