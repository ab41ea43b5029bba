"""Recycled registration on the real vLLM CPU engine (`generator/vllm/hotswap.py`): versions
written straight into free slots (their retired LoRAModel filled from the slot when vLLM frees
it), or copied into retired versions' LoRAModels, hold and serve exactly what vLLM's own build
and activation would; anything else takes vLLM's own path."""

from __future__ import annotations

import pytest
import torch

from lora_async.adapter_version import AdapterVersion
from lora_async.adapters import save_peft_dir
from lora_async.generator.types import GenRequest
from lora_async.generator.validate import AdapterError

from .helpers import GREEDY, PROMPTS, generate, greedy, next_version, publish, random_adapter, wait_for

pytestmark = pytest.mark.vllm


@pytest.fixture
def engine(shared_engine):
    """The session's in-process vLLM engine (tests/conftest.py), the fleet a run configures."""
    return shared_engine


def lora_manager(client):
    """vLLM's worker-side LoRA manager of the in-process engine (tests reach into vLLM here)."""
    return client.engine.model_executor.driver_worker.worker.model_runner.lora_manager


def hotswap_stats(engine) -> dict:
    return engine.run_in_engine(lambda client: client.hotswap_stats())


def registered_model(engine, int_id):
    """The LoRAModel object vLLM holds for `int_id` (in-process: the object itself)."""
    return engine.run_in_engine(lambda client: lora_manager(client)._adapter_manager.get_adapter(int_id))


def _weights(model) -> dict:
    out = {}
    for key, weights in model.loras.items():
        for part, value in (("a", weights.lora_a), ("b", weights.lora_b)):
            for i, tensor in enumerate(value if isinstance(value, list) else [value]):
                out[(key, part, i)] = tensor
    return out


def equals_vllms_own_build(engine, int_id, version) -> bool:
    """The model registered under `int_id` holds, bit for bit, what vLLM builds and merges from
    the same tensors (`from_lora_tensors` + the merge `add_adapter` does)."""
    from lora_async.generator.vllm.hotswap import build_lora_model

    def check(client):
        manager = lora_manager(client)
        ours = manager._adapter_manager.get_adapter(int_id)
        reference = build_lora_model(manager, 999_999, {k: t.clone() for k, t in version.tensors.items()},
                                     version.peft_config)
        manager._adapter_manager._create_merged_loras_inplace(reference)
        mine, theirs = _weights(ours), _weights(reference)
        return mine.keys() == theirs.keys() and all(
            (mine[k] is None and theirs[k] is None) or torch.equal(mine[k], theirs[k]) for k in mine)
    return engine.run_in_engine(check)


def slot_equals_vllms_own_activation(engine, int_id) -> bool:
    """`int_id` is active, and its slot holds what vLLM's own `activate_adapter` writes there
    from its LoRAModel (freeing the slot first fills that model from the slot, where the version
    was written straight into it: `equals_vllms_own_build` then checks the model)."""
    def check(client):
        cache = lora_manager(client)._adapter_manager
        if int_id not in cache.lora_index_to_id:
            return False

        def slot(index):
            return [stack[index].clone() for module in cache.modules.values()
                    for stacked in (module.lora_a_stacked, module.lora_b_stacked)
                    for stack in (stacked if isinstance(stacked, (list, tuple)) else [stacked])]
        ours = slot(cache.lora_index_to_id.index(int_id))
        cache.deactivate_adapter(int_id)
        cache.activate_adapter(int_id)  # vLLM's set_lora / reset_lora, module by module
        theirs = slot(cache.lora_index_to_id.index(int_id))
        return all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    return engine.run_in_engine(check)


def dirty_free_slots(engine) -> None:
    """Fill every free slot of the engine's stacked LoRA tensors with junk (what a previous
    occupant of another rank or module set could leave): activation must clear what it does not write."""
    def dirty(client):
        cache = lora_manager(client)._adapter_manager
        for index, owner in enumerate(cache.lora_index_to_id):
            if owner is None:
                for module in cache.modules.values():
                    for stacked in (module.lora_a_stacked, module.lora_b_stacked):
                        for stack in (stacked if isinstance(stacked, (list, tuple)) else [stacked]):
                            stack[index].fill_(0.5)
    engine.run_in_engine(dirty)


def free_a_slot(client) -> None:
    """Evict the oldest active versions until a slot is free (vLLM activates them again when a
    request names them): a version is written straight into its slot only where one is free."""
    cache = lora_manager(client)._adapter_manager
    while None not in cache.lora_index_to_id:
        cache._active_adapters.remove_oldest()


def answers(engine, adapter):
    return [greedy(engine, adapter, p).samples[0] for p in PROMPTS]


def assert_same_answers(got, expected):
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.token_ids == theirs.token_ids
        assert mine.logprobs == pytest.approx(theirs.logprobs, abs=1e-4)


@pytest.mark.parametrize("gathered", [False, True], ids=["separate", "gathered"])
def test_recycled_versions_serve_what_vllm_loads_itself(engine, tiny_model, tmp_path, gathered):
    """Invariant 2: successive versions copied into retired versions' LoRAModels (and written
    into a free slot by lora-async) hold the tensors vLLM's own build holds, fill the slot as
    vLLM's activation does, and answer exactly as the same tensors loaded by vLLM from a PEFT
    directory: greedy tokens and logprobs, over seven versions (with one spare per structure
    and two live versions, the 7th reuses the LoRAModel the 4th reused: v0's). Versions come
    as separate tensors, or gathered in one buffer as the learner hands them over (then each
    recycled version is written straight into its slot with one op, and its LoRAModel filled
    from the slot when the check below frees it)."""
    before = hotswap_stats(engine)
    models, previous = [], None
    for i in range(7):
        version = random_adapter(tiny_model, "a", next_version(engine, "a"), seed=300 + i, scale=3.0,
                                 gathered=gathered)
        dirty_free_slots(engine)
        stats = publish(engine, version)
        models.append(registered_model(engine, stats.int_id))
        mine = answers(engine, "a")
        engine.publish_dir("b", next_version(engine, "b"),
                           save_peft_dir(tmp_path / f"v{i}", version.tensors, version.peft_config))
        assert_same_answers(mine, answers(engine, "b"))
        if previous is not None:  # the versions differ, so serving a stale one would show
            assert [s.logprobs for s in mine] != [s.logprobs for s in previous]
        previous = mine
        assert slot_equals_vllms_own_activation(engine, stats.int_id)
        assert equals_vllms_own_build(engine, stats.int_id, version)
        assert_same_answers(answers(engine, "a"), mine)  # activated again, by vLLM, from that model
    after = hotswap_stats(engine)
    assert after["recycled"] - before["recycled"] >= 4
    assert after["fast_activated"] - before["fast_activated"] >= 4
    straight = after["straight"] - before["straight"]  # one buffer: straight into the slot
    assert straight >= 3 if gathered else straight == 0
    assert after["filled_from_slot"] - before["filled_from_slot"] == straight
    assert after["one_copy"] - before["one_copy"] == (after["recycled"] - before["recycled"] if gathered else 0)
    reused = [sum(other is model for other in models) for model in models]
    assert max(reused) >= 3, "no LoRAModel served three versions"


@pytest.mark.parametrize("gathered", [False, True], ids=["separate", "gathered"])
def test_the_worker_keeps_none_of_the_senders_tensors(engine, tiny_model, gathered):
    """The in-process transport lends the learner's tensors for the registration only: built
    the first time, recycled after, a version answers the same after the sender overwrote
    every tensor it handed over. (A structure of its own, gate_proj and up_proj only, so the
    first versions are built here.)"""
    before = hotswap_stats(engine)
    for i in range(4):
        version = only_modules(random_adapter(tiny_model, "b", next_version(engine, "b"), seed=650 + i, scale=3.0),
                               ("gate_proj", "up_proj"))
        if gathered:
            version = AdapterVersion.gather(version.adapter, version.version, version.tensors, version.peft_config)
        publish(engine, version)
        mine = answers(engine, "b")
        with torch.no_grad():
            for tensor in version.tensors.values():
                tensor.fill_(7.0)
        assert_same_answers(answers(engine, "b"), mine)
    after = hotswap_stats(engine)
    assert after["built"] > before["built"] and after["recycled"] > before["recycled"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_bad_values_on_the_recycled_path_are_refused_and_the_spare_survives(engine, tiny_model, bad):
    """The worker checks a recycled version's values on the copy it makes (in its slot): a NaN or
    Inf is one clear error naming the version, nothing is registered, the live version keeps
    answering, and the next good version still recycles (the spare went back) and holds vLLM's
    own build."""
    for i in range(3):  # enough for a plan and a spare of this structure
        publish(engine, random_adapter(tiny_model, "c", next_version(engine, "c"), seed=700 + i, gathered=True))
    live = next_version(engine, "c") - 1
    expected = answers(engine, "c")
    before = hotswap_stats(engine)
    version = random_adapter(tiny_model, "c", live + 1, seed=710, gathered=True)
    key = next(k for k in version.tensors if k.endswith("lora_B.weight"))
    version.tensors[key][0, 0] = bad
    with pytest.raises(AdapterError, match=rf"c@v{live + 1}: .*NaN or Inf") as err:
        publish(engine, version)
    assert "\n" not in str(err.value)
    assert engine.live_versions("c")[-1] == live
    assert_same_answers(answers(engine, "c"), expected)
    good = random_adapter(tiny_model, "c", live + 2, seed=711, gathered=True)
    stats = publish(engine, good)
    assert hotswap_stats(engine)["recycled"] == before["recycled"] + 1
    assert slot_equals_vllms_own_activation(engine, stats.int_id)
    assert equals_vllms_own_build(engine, stats.int_id, good)


def only_modules(version, suffixes):
    """`version` cut down to the modules ending in `suffixes` (peft's target_modules)."""
    tensors = {k: t for k, t in version.tensors.items() if k.split(".")[-3] in suffixes}
    return AdapterVersion(version.adapter, version.version, tensors,
                          {**version.peft_config, "target_modules": sorted(suffixes)})


@pytest.mark.parametrize("structure", ["rank4", "q_and_v_only", "rslora"])
def test_another_structure_takes_the_normal_path_then_recycles(engine, tiny_model, tmp_path, structure):
    """A new structure (rank 4 under max_lora_rank 8; q_proj and v_proj only, so the packed qkv
    module lacks a slice and the MLP has none; rsLoRA, whose scaling 16/sqrt(8) is no power of
    two) is built by vLLM's own path first, then recycled; every version holds vLLM's own
    tensors bit for bit, answers as vLLM's PEFT-directory load, and what a free slot held
    outside the adapter's rows and modules is cleared."""
    before = hotswap_stats(engine)
    for i in range(4):
        version = random_adapter(tiny_model, "b", next_version(engine, "b"), seed=400 + i, scale=3.0,
                                 rank=4 if structure == "rank4" else 8,
                                 **({"use_rslora": True} if structure == "rslora" else {}))
        if structure == "q_and_v_only":
            version = only_modules(version, ("q_proj", "v_proj"))
        dirty_free_slots(engine)
        stats = publish(engine, version)
        mine = answers(engine, "b")
        engine.publish_dir("c", next_version(engine, "c"),
                           save_peft_dir(tmp_path / f"v{i}", version.tensors, version.peft_config))
        assert_same_answers(mine, answers(engine, "c"))
        assert slot_equals_vllms_own_activation(engine, stats.int_id)
        assert equals_vllms_own_build(engine, stats.int_id, version)
    after = hotswap_stats(engine)
    assert after["built"] - before["built"] >= 1 and after["recycled"] - before["recycled"] >= 1
    assert after["fast_activated"] > before["fast_activated"]


def test_a_version_vllm_evicts_from_its_slot_serves_the_same_when_activated_again(engine, tiny_model):
    """A version written straight into its slot has a LoRAModel vLLM has not filled. When vLLM's
    LRU frees that slot (`LRUCacheLoRAModelManager.activate_adapter` evicting its oldest active
    adapter, here called as it calls it), the model is filled from the slot first: it holds
    vLLM's own build, and the next request on the version, activated by vLLM from that model,
    answers as before."""
    for i in range(3):  # a plan, a trusted slot plan and a spare: the last is written straight
        version = random_adapter(tiny_model, "a", next_version(engine, "a"), seed=800 + i, scale=3.0, gathered=True)
        engine.run_in_engine(free_a_slot)
        straight = hotswap_stats(engine)["straight"]
        stats = publish(engine, version)
    assert hotswap_stats(engine)["straight"] == straight + 1
    before = hotswap_stats(engine)
    expected = answers(engine, "a")

    def evict(client) -> int:
        cache = lora_manager(client)._adapter_manager
        evicted = 0
        while stats.int_id in cache._active_adapters:
            cache._active_adapters.remove_oldest()  # what activate_adapter does when no slot is free
            evicted += 1
        return evicted
    assert engine.run_in_engine(evict) >= 1
    after = hotswap_stats(engine)
    assert after["filled_from_slot"] > before["filled_from_slot"]
    assert equals_vllms_own_build(engine, stats.int_id, version)
    def active(client) -> bool:
        return stats.int_id in lora_manager(client)._adapter_manager._active_adapters
    assert not engine.run_in_engine(active)
    assert_same_answers(answers(engine, "a"), expected)  # vLLM activates it again, from its LoRAModel
    assert engine.run_in_engine(active)


def test_a_version_in_flight_is_never_recycled(engine, tiny_model):
    """Invariant 3: while a request decodes on v_k, v_k+1..v_k+3 are registered, at least two
    of them into retired versions' LoRAModels (v_k-2's, v_k-1's), none into v_k's; the request
    finishes on v_k's weights, and a request pinned to v_k+1 right after v_k+2 was registered
    gets v_k+1's weights."""
    prompt = PROMPTS[0]
    start = next_version(engine, "c")
    weights = [random_adapter(tiny_model, "c", start + i, seed=500 + i, scale=3.0) for i in range(6)]
    k = start + 2
    publish(engine, weights[0])
    publish(engine, weights[1])
    first = publish(engine, weights[2])  # v_k; retires v_k-2, whose model becomes the spare
    alone = greedy(engine, "c", prompt, max_tokens=400).samples[0].token_ids
    pinned = registered_model(engine, first.int_id)
    box = []
    # Commands run in order on the engine thread: the request is added (on v_k) before any publish.
    engine.submit(GenRequest(prompt, "c", max_tokens=400, min_tokens=400, **GREEDY), box.append)
    before = hotswap_stats(engine)
    stats = [publish(engine, weights[3])]
    reference = greedy(engine, "c", PROMPTS[1], max_tokens=8).samples[0]  # v_k+1, the newest
    stats.append(publish(engine, weights[4]))
    on_previous = generate(engine, GenRequest(PROMPTS[1], "c", max_tokens=8, version=k + 1, **GREEDY))
    stats.append(publish(engine, weights[5]))
    assert not box, "the long request ended before the publishes: this test would prove nothing"
    assert hotswap_stats(engine)["recycled"] - before["recycled"] >= 2
    assert all(registered_model(engine, s.int_id) is not pinned for s in stats)
    assert all(f"c@v{k}" not in s.retired for s in stats)  # in flight, so still registered
    assert on_previous.version == k + 1 and on_previous.samples[0].token_ids == reference.token_ids
    assert on_previous.samples[0].logprobs == pytest.approx(reference.logprobs, abs=1e-4)
    wait_for(lambda: box, 120, "the request on v_k")
    assert box[0].version == k and box[0].samples[0].token_ids == alone


def test_the_worker_never_takes_an_id_twice(engine, tiny_model):
    """Invariant 1 at the worker: an id it registered once is refused even after its removal."""
    version = random_adapter(tiny_model, "a", 0, seed=600)
    int_id = 20_000  # outside the registry's range
    engine.run_in_engine(lambda client: client.add_tensors(int_id, dict(version.tensors), version.peft_config))
    engine.run_in_engine(lambda client: client.remove(int_id))
    with pytest.raises(ValueError, match="never reused"):
        engine.run_in_engine(lambda client: client.add_tensors(int_id, dict(version.tensors), version.peft_config))
    assert int_id not in engine.engine_lora_ids()
