"""The generator on the real vLLM CPU engine (one engine shared by the session)."""

from __future__ import annotations

import gc
import os
import threading
import time

import psutil
import pytest
import torch

from lora_async.adapters import save_peft_dir
from lora_async.generator.registry import RegistryError
from lora_async.generator.types import AdapterVersion, GenRequest, GenStatus
from lora_async.generator.validate import AdapterError

from .helpers import PROMPTS, generate, publish, random_adapter, submit_many

pytestmark = pytest.mark.vllm


def fleet_config(tiny_model, max_staleness=1):
    """A 3-adapter fleet on the tiny model, as a run would configure it."""
    from lora_async.config import TrainConfig

    return TrainConfig.model_validate({
        "model": {"name": str(tiny_model)},
        "generator": {"kv_cache_gb": 0.25, "max_model_len": 512, "max_batched_tokens": 384},
        "buffer": {"max_staleness": max_staleness},
        "adapters": [{"name": name, "task": {"type": "arithmetic"}} for name in ("a", "b", "c")]})


@pytest.fixture(scope="module")
def engine(tiny_model):
    """One in-process vLLM engine for this module, built from a run config the way a run builds it.

    vLLM keeps its distributed state in process globals, so an in-process engine must not
    outlive another one's shutdown: engines in one process are strictly one after another.
    """
    from lora_async.generator.engine import EngineSpec, VllmGenerator
    from lora_async.placement import Placement

    generator = VllmGenerator(EngineSpec.from_config(fleet_config(tiny_model), tiny_model, "cpu"), Placement("cpu", None))
    yield generator
    generator.close()


def test_lora_slots_are_sized_from_the_config(engine, tiny_model):
    """What the engine really holds (vLLM's lora_config), not what a formula says it should.

    Every live version of every adapter (max_staleness + 1 each) plus one being published may
    share a batch; one draining version per adapter may stay registered beside them."""
    assert engine.lora_slots() == (3 * (1 + 1) + 1, 3 * (1 + 1) + 1 + 3)
    from lora_async.generator.engine import EngineSpec

    wider = EngineSpec.from_config(fleet_config(tiny_model, max_staleness=2), tiny_model, "cpu")
    assert (wider.max_loras, wider.max_cpu_loras) == (3 * 3 + 1, 3 * 3 + 1 + 3)


def test_engine_steps_schedule_at_most_generator_max_batched_tokens(engine):
    """`generator.max_batched_tokens` reaches vLLM's scheduler (the engine here has 384)."""
    limit = engine.run_in_engine(lambda client: client.engine.vllm_config.scheduler_config.max_num_batched_tokens)
    assert limit == 384

GREEDY = dict(temperature=0.0, n=1)


def first_token(result):
    sample = result.samples[0]
    return sample.token_ids[0], sample.logprobs[0]


def greedy(engine, adapter, prompt, max_tokens=6):
    return generate(engine, GenRequest(prompt, adapter, max_tokens=max_tokens, **GREEDY))


def next_version(engine, adapter: str) -> int:
    newest = engine.registry.newest(adapter)
    return 0 if newest is None else newest + 1


def test_tensor_publish_matches_peft_directory(engine, tiny_model, tmp_path):
    """(a) tensors handed over in memory serve exactly what vLLM loads from a PEFT directory."""
    version = random_adapter(tiny_model, "a", next_version(engine, "a"), seed=1)
    stats = publish(engine, version)
    assert stats.vllm_name == f"a@v{version.version}"
    peft_dir = save_peft_dir(tmp_path / "peft", version.tensors, version.peft_config)
    engine.publish_dir("b", next_version(engine, "b"), peft_dir)
    base = [first_token(greedy(engine, None, p)) for p in PROMPTS]
    for i, prompt in enumerate(PROMPTS):
        tok_mem, lp_mem = first_token(greedy(engine, "a", prompt))
        tok_dir, lp_dir = first_token(greedy(engine, "b", prompt))
        assert tok_mem == tok_dir
        assert lp_mem == pytest.approx(lp_dir, abs=1e-3)
    # ... and the adapter is really applied: it changes what the base model would say.
    assert [first_token(greedy(engine, "a", p)) for p in PROMPTS] != base


def test_two_versions_in_one_batch_each_use_their_own_weights(engine, tiny_model):
    """(b) v_k and v_k+1 decode side by side; each answers as it does alone."""
    k = next_version(engine, "a")
    old = random_adapter(tiny_model, "a", k, seed=11, scale=3.0)
    new = random_adapter(tiny_model, "a", k + 1, seed=12, scale=3.0)
    prompt = PROMPTS[0]
    publish(engine, old)
    alone_old = greedy(engine, "a", prompt, max_tokens=8).samples[0].token_ids
    publish(engine, new)
    alone_new = greedy(engine, "a", prompt, max_tokens=8).samples[0].token_ids
    assert alone_old != alone_new

    # Now mix them: a long request starts on v_k+1 ... publish v_k+2 = old weights ... then both.
    third = AdapterVersion("a", k + 2, old.tensors, old.peft_config)
    box = {}
    started = threading.Event()

    def on_done(result):
        box["long"] = result
    engine.submit(GenRequest(prompt, "a", max_tokens=40, min_tokens=40, **GREEDY), on_done)
    time.sleep(0.05)
    publish(engine, third)
    short = greedy(engine, "a", prompt, max_tokens=8)
    deadline = time.time() + 60
    while "long" not in box and time.time() < deadline:
        time.sleep(0.02)
    long = box["long"]
    assert long.version == k + 1 and short.version == k + 2
    assert long.samples[0].token_ids[:8] == alone_new
    assert short.samples[0].token_ids == alone_old
    del started


def test_new_weights_are_served_never_stale(engine, tiny_model):
    """(c) the stale-cache trap: every publish gets a new id and name, so new weights show."""
    prompt = PROMPTS[1]
    seen = []
    for seed in (21, 22, 23):
        version = random_adapter(tiny_model, "c", next_version(engine, "c"), seed=seed, scale=3.0)
        stats = publish(engine, version)
        seen.append((stats.int_id, stats.vllm_name))
        result = greedy(engine, "c", prompt, max_tokens=8)
        assert result.version == version.version
        # reference: the same weights under a fresh adapter name
        ref = AdapterVersion("b", next_version(engine, "b"), version.tensors, version.peft_config)
        publish(engine, ref)
        assert greedy(engine, "b", prompt, max_tokens=8).samples[0].token_ids == result.samples[0].token_ids
    ids = [i for i, _ in seen]
    assert len(set(ids)) == len(ids) and ids == sorted(ids)


def test_reusing_an_int_id_serves_stale_weights_in_vllm(engine, tiny_model):
    """Why (c) matters: vLLM itself keeps the old weights when a known int id is re-added.

    This pins the vLLM behaviour the registry exists for; if vLLM ever reloads on re-add, this
    test tells us the workaround became unnecessary.
    """
    from vllm.lora.request import LoRARequest

    first = random_adapter(tiny_model, "x", 0, seed=31, scale=3.0)
    second = random_adapter(tiny_model, "x", 1, seed=32, scale=3.0)
    int_id = 10_000  # outside the registry's range
    prompt = PROMPTS[2]

    def run(tensors):
        def fn(client):
            from lora_async.sync.pack import pack, unpack_views

            if int_id not in client.lora_ids():
                client.add_tensors(int_id, unpack_views(pack(tensors, torch.bfloat16)), tensors.peft_config)
            return True
        engine.run_in_engine(fn)

    try:
        run(first)
        box = []
        request = LoRARequest("trap@same", int_id, "lora-async://trap")

        def gen_raw():
            from vllm import SamplingParams
            from vllm.sampling_params import RequestOutputKind

            def fn(client):
                eng = client.engine  # vLLM's own API, to pin vLLM's own behaviour
                rid = f"trap-{len(box)}-{time.time()}"
                eng.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(
                    max_tokens=6, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY), lora_request=request)
                while True:
                    for out in eng.step():
                        if out.request_id == rid and out.finished:
                            return list(out.outputs[0].token_ids)
            return engine.run_in_engine(fn)

        out_first = gen_raw()
        run(second)  # "publishing" new weights under the same id does nothing...
        assert gen_raw() == out_first  # ...the old weights keep being served
    finally:
        engine.run_in_engine(lambda client: client.remove(int_id))


def test_in_flight_request_finishes_on_its_version(engine, tiny_model):
    """(d) a request running on v_k when v_k+1 is published finishes on v_k and says so."""
    k = next_version(engine, "a")
    v_k = random_adapter(tiny_model, "a", k, seed=41, scale=3.0)
    v_next = random_adapter(tiny_model, "a", k + 1, seed=42, scale=3.0)
    publish(engine, v_k)
    reference = greedy(engine, "a", PROMPTS[0], max_tokens=48).samples[0].token_ids
    box = []
    engine.submit(GenRequest(PROMPTS[0], "a", max_tokens=48, min_tokens=48, **GREEDY), box.append)
    time.sleep(0.05)
    stats = publish(engine, v_next)
    assert engine.in_flight() >= 0
    after = greedy(engine, "a", PROMPTS[0], max_tokens=4)
    deadline = time.time() + 60
    while not box and time.time() < deadline:
        time.sleep(0.02)
    assert box[0].version == k
    assert box[0].samples[0].token_ids == reference
    assert after.version == k + 1
    assert f"a@v{k}" not in stats.retired  # it was still in flight then


def test_stale_rollouts_are_cut_short_and_other_requests_are_not(engine, tiny_model):
    """Rollouts on versions a step makes too old stop at once; evals on the same version go on."""
    k = next_version(engine, "c")
    publish(engine, random_adapter(tiny_model, "c", k, seed=51))
    rollout, evaluation = [], []
    long = dict(max_tokens=200, min_tokens=200, **GREEDY)
    engine.submit(GenRequest(PROMPTS[0], "c", tag="rollout", **long), rollout.append)
    engine.submit(GenRequest(PROMPTS[1], "c", tag="eval", max_tokens=24, min_tokens=24, **GREEDY),
                  evaluation.append)
    time.sleep(0.1)
    publish(engine, random_adapter(tiny_model, "c", k + 1, seed=52))
    engine.abort_older("c", k + 1, "rollout")
    deadline = time.time() + 60
    while not (rollout and evaluation) and time.time() < deadline:
        time.sleep(0.02)
    assert rollout[0].status is GenStatus.ABORTED_STALE and not rollout[0].samples
    assert evaluation[0].ok and evaluation[0].version == k and len(evaluation[0].samples[0].token_ids) == 24
    # a rollout on the new version is not touched
    fresh = []
    engine.submit(GenRequest(PROMPTS[2], "c", tag="rollout", max_tokens=8, **GREEDY), fresh.append)
    engine.abort_older("c", k + 1, "rollout")
    deadline = time.time() + 60
    while not fresh and time.time() < deadline:
        time.sleep(0.02)
    assert fresh[0].ok and fresh[0].version == k + 1


def test_a_stopped_partial_rollout_keeps_its_tokens_and_continues_on_the_newest_version(engine, tiny_model):
    """keep_partial: a turn cut short by `abort_older` comes back STOPPED with the tokens (and
    sampling logprobs) drawn so far on its version; the same turn continued from its context on
    the new version is a normal request; streaming changes no token."""
    k = next_version(engine, "c")
    publish(engine, random_adapter(tiny_model, "c", k, seed=61))
    whole = greedy(engine, "c", PROMPTS[0], max_tokens=40)
    streamed = generate(engine, GenRequest(PROMPTS[0], "c", max_tokens=40, keep_partial=True, **GREEDY))
    assert streamed.ok and streamed.samples[0].token_ids == whole.samples[0].token_ids
    assert streamed.samples[0].logprobs == pytest.approx(whole.samples[0].logprobs, abs=1e-4)
    stopped = []
    engine.submit(GenRequest(PROMPTS[0], "c", tag="rollout", max_tokens=400, min_tokens=400, keep_partial=True,
                             **GREEDY), stopped.append)
    time.sleep(0.5)
    publish(engine, random_adapter(tiny_model, "c", k + 1, seed=62))
    engine.abort_older("c", k + 1, "rollout")
    deadline = time.time() + 60
    while not stopped and time.time() < deadline:
        time.sleep(0.02)
    result = stopped[0]
    assert result.status is GenStatus.STOPPED and result.version == k
    drawn = result.samples[0]
    assert 0 < len(drawn.token_ids) < 400 and len(drawn.logprobs) == len(drawn.token_ids)
    same = min(len(drawn.token_ids), len(whole.samples[0].token_ids) - 1)  # before any end-of-text
    assert drawn.token_ids[:same] == whole.samples[0].token_ids[:same]  # greedy: the same path, streamed
    rest = generate(engine, GenRequest(PROMPTS[0] + drawn.token_ids, "c", tag="rollout", max_tokens=8,
                                       keep_partial=True, **GREEDY))
    assert rest.ok and rest.version == k + 1 and len(rest.samples[0].token_ids) == 8


def test_publish_retire_cycles_stay_bounded(engine, tiny_model):
    """(e) 50 publish/retire cycles: registered adapters stay within bounds, memory flat."""
    proc = psutil.Process(os.getpid())
    base = random_adapter(tiny_model, "b", 0, seed=51)
    bound = engine.spec.max_cpu_loras

    def cycle(n):
        for _ in range(n):
            v = next_version(engine, "b")
            tensors = {k: t * (1 + 0.01 * v) for k, t in base.tensors.items()}
            publish(engine, AdapterVersion("b", v, tensors, base.peft_config))
            assert len(engine.engine_lora_ids()) <= bound
            assert len(engine.live_versions("b")) <= engine.spec.max_staleness + 1
            assert greedy(engine, "b", PROMPTS[0], max_tokens=2).version == v

    cycle(10)  # warm up allocator pools
    gc.collect()
    rss_before = proc.memory_info().rss
    cycle(50)
    gc.collect()
    growth_mb = (proc.memory_info().rss - rss_before) / 2**20
    assert growth_mb < 150, f"RSS grew {growth_mb:.0f} MB over 50 cycles"
    # the engine holds exactly the versions the registry says are live
    live_ids = sorted(lv.int_id for lv in engine.registry.all_live())
    assert engine.engine_lora_ids() == live_ids


def test_live_versions_never_touch_lora_path(engine, tiny_model):
    """Live versions are registered in the worker; their lora_path is fake and never read."""
    v = next_version(engine, "c")
    publish(engine, random_adapter(tiny_model, "c", v, seed=61))
    live = [lv for lv in engine.registry.all_live() if lv.adapter == "c" and lv.version == v][0]
    assert live.int_id in engine.engine_lora_ids()
    assert greedy(engine, "c", PROMPTS[0]).version == v  # would fail loudly if the fake path were read


@pytest.mark.parametrize("case", ["rank", "dora", "bias", "modules_to_save", "targets", "shape", "nan", "inf", "name"])
def test_bad_adapters_are_rejected_before_the_engine(engine, tiny_model, case):
    """Each bad input is a clear error; the engine keeps serving the version it had."""
    v = next_version(engine, "c")
    good = random_adapter(tiny_model, "c", v, seed=71)
    publish(engine, good)
    before = greedy(engine, "c", PROMPTS[0])
    tensors = dict(good.tensors)
    config = dict(good.peft_config)
    name = "c"
    key = next(k for k in tensors if k.endswith("lora_A.weight"))
    if case == "rank":
        big = random_adapter(tiny_model, "c", v + 1, seed=72, rank=16)
        tensors, config = big.tensors, big.peft_config
    elif case == "dora":
        config["use_dora"] = True
    elif case == "bias":
        config["bias"] = "all"
    elif case == "modules_to_save":
        config["modules_to_save"] = ["lm_head"]
    elif case == "targets":
        config["target_modules"] = ["q_proj", "not_a_module"]
    elif case == "shape":
        tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 1)
    elif case == "nan":
        tensors[key] = tensors[key].clone()
        tensors[key][0, 0] = float("nan")
    elif case == "inf":
        tensors[key] = tensors[key].clone()
        tensors[key][0, 0] = float("inf")
    elif case == "name":
        name = "../evil"
    with pytest.raises(AdapterError) as err:
        publish(engine, AdapterVersion(name, v + 1, tensors, config))
    assert "\n" not in str(err.value)
    after = greedy(engine, "c", PROMPTS[0])
    assert after.version == v and after.samples[0].token_ids == before.samples[0].token_ids


def test_versions_are_monotonic(engine, tiny_model):
    v = next_version(engine, "c")
    publish(engine, random_adapter(tiny_model, "c", v, seed=81))
    with pytest.raises(RegistryError):
        publish(engine, random_adapter(tiny_model, "c", v, seed=82))


def test_base_and_adapters_share_a_batch(engine, tiny_model):
    v = next_version(engine, "a")
    publish(engine, random_adapter(tiny_model, "a", v, seed=91, scale=3.0))
    reqs = [GenRequest(p, adapter, max_tokens=6, **GREEDY) for p in PROMPTS for adapter in (None, "a")]
    results = submit_many(engine, reqs)
    for req, res in zip(reqs, results):
        assert res.ok and res.adapter == req.adapter
        assert res.version == (None if req.adapter is None else v)
        assert len(res.samples[0].token_ids) == len(res.samples[0].logprobs) > 0
        assert res.samples[0].finish_reason in ("stop", "length")


# ---------------------------------------------------------------- recycled registration (hotswap.py)


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
    """`int_id` is active, and its slot holds what vLLM's own `activate_adapter` writes there."""
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
    recycled version is copied in with one op)."""
    before = hotswap_stats(engine)
    models, previous = [], None
    for i in range(7):
        version = random_adapter(tiny_model, "a", next_version(engine, "a"), seed=300 + i, scale=3.0,
                                 gathered=gathered)
        dirty_free_slots(engine)
        stats = publish(engine, version)
        models.append(registered_model(engine, stats.int_id))
        assert equals_vllms_own_build(engine, stats.int_id, version)
        mine = answers(engine, "a")
        engine.publish_dir("b", next_version(engine, "b"),
                           save_peft_dir(tmp_path / f"v{i}", version.tensors, version.peft_config))
        assert_same_answers(mine, answers(engine, "b"))
        if previous is not None:  # the versions differ, so serving a stale one would show
            assert [s.logprobs for s in mine] != [s.logprobs for s in previous]
        previous = mine
        assert slot_equals_vllms_own_activation(engine, stats.int_id)
    after = hotswap_stats(engine)
    assert after["recycled"] - before["recycled"] >= 4
    assert after["fast_activated"] - before["fast_activated"] >= 4
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
    """The worker checks a recycled version's values on the copy it makes: a NaN or Inf is one
    clear error naming the version, nothing is registered, the live version keeps answering,
    and the next good version still recycles (the spare went back) and holds vLLM's own build."""
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
        assert equals_vllms_own_build(engine, stats.int_id, version)
        mine = answers(engine, "b")
        engine.publish_dir("c", next_version(engine, "c"),
                           save_peft_dir(tmp_path / f"v{i}", version.tensors, version.peft_config))
        assert_same_answers(mine, answers(engine, "c"))
        assert slot_equals_vllms_own_activation(engine, stats.int_id)
    after = hotswap_stats(engine)
    assert after["built"] - before["built"] >= 1 and after["recycled"] - before["recycled"] >= 1
    assert after["fast_activated"] > before["fast_activated"]


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
    engine.submit(GenRequest(prompt, "c", max_tokens=400, min_tokens=400, **GREEDY), box.append)
    time.sleep(0.05)
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
    deadline = time.time() + 120
    while not box and time.time() < deadline:
        time.sleep(0.02)
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
