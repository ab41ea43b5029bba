"""The generator on the real vLLM CPU engine (one engine for this module): slots, versions side
by side, in-flight requests, aborts, retirement, refusals. Recycled registration (hotswap.py)
is test_hotswap.py's."""

from __future__ import annotations

import gc
import os
import threading
import time

import psutil
import pytest
import torch

from lora_async.adapter_version import AdapterVersion
from lora_async.adapters import save_peft_dir
from lora_async.generator.registry import RegistryError
from lora_async.generator.types import GenRequest, GenStatus
from lora_async.generator.validate import AdapterError

from .helpers import (GREEDY, PROMPTS, first_token, fleet_config, generate, greedy, next_version, publish,
                      random_adapter, submit_many, wait_for)

pytestmark = pytest.mark.vllm


@pytest.fixture
def engine(shared_engine):
    """The session's in-process vLLM engine, built from a run config the way a run builds it
    (tests/conftest.py: started once, shared with the hot-swap, QLoRA and reference tests)."""
    return shared_engine


def test_lora_slots_are_sized_from_the_config(engine, tiny_model):
    """What the engine really holds (vLLM's lora_config), not what a formula says it should.

    Every live version of every adapter (max_staleness + 1 each) plus one being published may
    share a batch; one draining version per adapter may stay registered beside them."""
    adapters = len(engine.spec.adapters)  # sized for every adapter the shared engine serves
    assert engine.lora_slots() == (adapters * (1 + 1) + 1, adapters * (1 + 1) + 1 + adapters)
    from lora_async.generator.engine import EngineSpec

    fleet = EngineSpec.from_config(fleet_config(tiny_model), tiny_model, "cpu")
    assert (fleet.max_loras, fleet.max_cpu_loras) == (3 * (1 + 1) + 1, 3 * (1 + 1) + 1 + 3)
    wider = EngineSpec.from_config(fleet_config(tiny_model, max_staleness=2), tiny_model, "cpu")
    assert (wider.max_loras, wider.max_cpu_loras) == (3 * 3 + 1, 3 * 3 + 1 + 3)


def test_engine_steps_schedule_at_most_generator_max_batched_tokens(engine):
    """`generator.max_batched_tokens` reaches vLLM's scheduler (the config asks 384); a CPU engine
    runs without chunked prefill (seeded requests would kill it: compat.SEEDED_CHUNK_REWIND), so
    its steps take at least a whole prompt, `max_model_len` (512 here)."""
    scheduler = engine.run_in_engine(lambda client: client.engine.vllm_config.scheduler_config)
    assert engine.spec.max_batched_tokens == 384
    assert scheduler.max_num_batched_tokens == 512 and not scheduler.enable_chunked_prefill

def test_tensor_publish_matches_peft_directory(engine, tiny_model, tmp_path):
    """(a) tensors handed over in memory serve exactly what vLLM loads from a PEFT directory."""
    version = random_adapter(tiny_model, "a", next_version(engine, "a"), seed=1)
    stats = publish(engine, version)
    assert stats.served_name == f"a@v{version.version}"
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
    # Commands run in order on the engine thread: the long request is added (on v_k+1) before
    # the publish is registered.
    engine.submit(GenRequest(prompt, "a", max_tokens=40, min_tokens=40, **GREEDY), on_done)
    publish(engine, third)
    short = greedy(engine, "a", prompt, max_tokens=8)
    long = wait_for(lambda: box.get("long"), 60, "the long request")
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
        seen.append((stats.int_id, stats.served_name))
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
            from lora_async.handoff.packed import unpack_views
            from lora_async.sync.pack import pack

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
    # The engine thread adds it before it answers (commands run in order), and 48 tokens take
    # 48 steps: it is running now, on v_k.
    assert engine.in_flight() == 1
    counted = engine.run_in_engine(lambda client: {lv.version: lv.in_flight for lv in engine.registry.all_live()
                                                   if lv.adapter == "a"})
    assert counted[k] == 1  # counted on the version it started on
    stats = publish(engine, v_next)
    after = greedy(engine, "a", PROMPTS[0], max_tokens=4)
    wait_for(lambda: box, 60, "the request begun on v_k")
    assert box[0].version == k
    assert box[0].samples[0].token_ids == reference
    assert after.version == k + 1
    assert f"a@v{k}" not in stats.retired  # it was still in flight then
    assert engine.in_flight() == 0  # nothing is left in flight once the results are in


def test_stale_rollouts_are_cut_short_and_other_requests_are_not(engine, tiny_model):
    """Rollouts on versions a step makes too old stop at once; evals on the same version go on."""
    k = next_version(engine, "c")
    publish(engine, random_adapter(tiny_model, "c", k, seed=51))
    newer = random_adapter(tiny_model, "c", k + 1, seed=52)  # built first: only the hand-off runs beside the rollout
    rollout, evaluation = [], []
    long = dict(max_tokens=400, min_tokens=400, **GREEDY)
    # Commands run in order on the engine thread: both requests are added before the publish,
    # and the rollout cannot draw 400 tokens during one hand-off.
    engine.submit(GenRequest(PROMPTS[0], "c", tag="rollout", **long), rollout.append)
    engine.submit(GenRequest(PROMPTS[1], "c", tag="eval", max_tokens=24, min_tokens=24, **GREEDY),
                  evaluation.append)
    publish(engine, newer)
    engine.abort_older("c", k + 1, "rollout")
    wait_for(lambda: rollout and evaluation, 60, "the rollout and the evaluation")
    assert rollout[0].status is GenStatus.ABORTED_STALE and not rollout[0].samples
    assert evaluation[0].ok and evaluation[0].version == k and len(evaluation[0].samples[0].token_ids) == 24
    # a rollout on the new version is not touched
    fresh = []
    engine.submit(GenRequest(PROMPTS[2], "c", tag="rollout", max_tokens=8, **GREEDY), fresh.append)
    engine.abort_older("c", k + 1, "rollout")
    wait_for(lambda: fresh, 60, "the rollout on the new version")
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
    newer = random_adapter(tiny_model, "c", k + 1, seed=62)  # built first: only the hand-off runs beside the rollout
    stopped = []
    steps = engine.stats.steps
    engine.submit(GenRequest(PROMPTS[0], "c", tag="rollout", max_tokens=400, min_tokens=400, keep_partial=True,
                             **GREEDY), stopped.append)
    # the rollout alone on the engine: a few engine steps, a few of its tokens drawn
    wait_for(lambda: engine.stats.steps >= steps + 4, 60, "the rollout to draw some tokens")
    publish(engine, newer)
    engine.abort_older("c", k + 1, "rollout")
    result = wait_for(lambda: stopped, 60, "the stopped rollout")[0]
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
            assert len(engine.live_versions("b")) <= engine.spec.window.live_versions
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


def test_a_kept_version_is_served_beside_newer_ones_until_let_go(engine, tiny_model):
    """A game's frozen opponent (a league's past version): kept as it is published, it outlives
    the staleness window, a request pinned to it is served its own weights, new requests still
    get the newest, and once let go it leaves the engine."""
    first = next_version(engine, "c")
    publish(engine, random_adapter(tiny_model, "c", first, seed=71, scale=3.0))
    engine.keep("c", first)
    before = greedy(engine, "c", PROMPTS[2])
    for seed in (72, 73, 74):
        publish(engine, random_adapter(tiny_model, "c", next_version(engine, "c"), seed=seed, scale=3.0))
    live = engine.live_versions("c")
    assert first in live and len(live) == engine.spec.window.live_versions + 1
    pinned = generate(engine, GenRequest(PROMPTS[2], "c", max_tokens=6, version=first, **GREEDY))
    assert pinned.version == first and pinned.samples[0].token_ids == before.samples[0].token_ids
    assert greedy(engine, "c", PROMPTS[2]).version == first + 3
    engine.let_go("c", first)
    assert first not in engine.live_versions("c")
    assert engine.engine_lora_ids() == sorted(lv.int_id for lv in engine.registry.all_live())


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


def test_retiring_an_adapter_removes_every_version_and_aborts_its_requests(engine, tiny_model):
    """What a run that ends on a shared engine leaves (`lora-async bench staleness`): nothing."""
    first = next_version(engine, "gone")
    for v in (first, first + 1):
        publish(engine, random_adapter(tiny_model, "gone", v, seed=71 + v))
    ids = {lv.int_id for lv in engine.registry.all_live() if lv.adapter == "gone"}
    assert len(ids) == 2 and ids <= set(engine.engine_lora_ids())
    other = next_version(engine, "a")
    publish(engine, random_adapter(tiny_model, "a", other, seed=73))
    running: list = []
    engine.submit(GenRequest(PROMPTS[0], "gone", max_tokens=200, min_tokens=200, **GREEDY), running.append)
    retired = engine.retire_adapter("gone")
    assert sorted(retired) == [f"gone@v{first}", f"gone@v{first + 1}"]
    wait_for(lambda: running, 60, "the request on the retired adapter")
    assert running[0].status is GenStatus.ABORTED_STALE
    assert engine.live_versions("gone") == [] and not ids & set(engine.engine_lora_ids())
    assert greedy(engine, "a", PROMPTS[0]).version == other  # the other adapters serve on
    with pytest.raises(RegistryError):  # its numbers stay taken
        publish(engine, random_adapter(tiny_model, "gone", first + 1, seed=75))
    refused = generate(engine, GenRequest(PROMPTS[0], "gone", max_tokens=2, **GREEDY))
    assert refused.status is GenStatus.REFUSED


def test_a_seeded_request_draws_the_same_completions_again(engine):
    """Runs of one seed sample alike (`rollout.sub_seed`): the same seed, one request at a time,
    gives the same tokens; its n completions differ from each other, and another seed differs."""
    def draw(seed: int) -> list[list[int]]:
        result = generate(engine, GenRequest(PROMPTS[1], None, n=4, max_tokens=12, temperature=1.0, seed=seed))
        assert result.ok
        return [s.token_ids for s in result.samples]

    once, again, other = draw(1234), draw(1234), draw(4321)
    assert once == again
    assert len({tuple(ids) for ids in once}) > 1
    assert once != other
