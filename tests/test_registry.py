"""Version bookkeeping: names, ids, in-flight counts, retirement."""

import pytest

from lora_async.generator.registry import RegistryError, VersionRegistry


def test_names_embed_versions_and_ids_are_never_reused():
    reg = VersionRegistry(max_staleness=1, capacity=10)
    seen = set()
    for v in range(6):
        live = reg.add("a", v)
        assert live.vllm_name == f"a@v{v}"
        assert live.int_id not in seen
        seen.add(live.int_id)
        for old in reg.retirable():
            reg.remove(old)
    reg.reserve_id()  # a failed registration still burns its id
    assert reg.add("b", 0).int_id == max(seen) + 2


def test_versions_must_increase():
    reg = VersionRegistry(1, 10)
    reg.add("a", 3)
    with pytest.raises(RegistryError):
        reg.add("a", 3)
    with pytest.raises(RegistryError):
        reg.add("a", 2)


def test_retire_only_drained_versions_outside_the_window():
    reg = VersionRegistry(max_staleness=1, capacity=10)
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
    reg = VersionRegistry(0, 10)
    reg.add("a", 0)
    reg.add("a", 1)
    assert reg.acquire("a").version == 1
    with pytest.raises(RegistryError):
        reg.acquire("missing")


def test_capacity_and_eviction_candidate():
    reg = VersionRegistry(max_staleness=0, capacity=2)
    v0 = reg.add("a", 0)
    reg.acquire("a")
    reg.add("a", 1)
    assert reg.is_full()
    assert reg.oldest_outside_window() is v0
