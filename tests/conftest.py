"""Shared fixtures (a tiny random-weight Llama with the real tokenizer, the session's in-process
vLLM engine) and the tiers' guard.

Tiers (markers in pyproject.toml): unit tests run on fakes and tiny models with no engine;
`vllm` tests start the real vLLM CPU engine; `slow` tests run training end to end (the CLI, or
`train` on real parts); `ray` tests start a local Ray cluster; `long` and `gpu` tests are not in
`make test`. `make test-fast` runs the unit tier with `LORA_ASYNC_TEST_TIER=unit`, and then a
test that starts an engine, Ray, or a training run without its marker fails at once, naming the
marker it lacks: a tier cannot quietly grow slow.

The session's in-process engine (`engine_lease`, `shared_engine`) serves every test whose
engine spec is the shared one (the generator, hot-swap, QLoRA and transport-reference tests),
so it starts once. vLLM keeps distributed state in process globals, so two in-process engines
must never live at once: any other in-process engine that starts (a training run, an eval, a
test's own spec) first closes the shared one, and the lease starts it again when asked.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Trackio reads its store's place once, at import: one store for the session, never the user's.
os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="lora-async-trackio-")

REPO = Path(__file__).resolve().parent.parent
TIER_ENV = "LORA_ASYNC_TEST_TIER"
CLI_NAMES = ("lora_async", "lora-async")
HEAVY_COMMANDS = ("train", "eval", "bench", "serve", "server")
CONFIG_ERROR_EXIT = 2  # the CLI's exit code for a config mistake, found before anything loads


# Adapters the shared engine is sized for (LoRA slots): every name a test publishes on it.
SHARED_ADAPTERS = ("a", "b", "c", "x", "ref", "main", "gone")
REFERENCE_SEEDS = (1, 2)  # the reference adapter's versions 0 and 1 (random LoRAs from these seeds)


class EngineLease:
    """The session's one in-process vLLM engine, kept while the specs asked for match."""

    def __init__(self) -> None:
        self.engine: Any = None
        self.spec: Any = None
        self.starts = 0
        self._starting = False

    def get(self, spec: Any) -> Any:
        from lora_async.generator.engine import VllmGenerator
        from lora_async.generator.types import GeneratorDead
        from lora_async.placement import Placement

        if self.engine is not None and self.spec == spec:
            try:
                self.engine.live_versions("a")  # answers only while its engine thread runs
                return self.engine
            except GeneratorDead:
                pass
        self.close()
        self._starting = True
        try:
            self.engine = VllmGenerator(spec, Placement("cpu", None))
        finally:
            self._starting = False
        self.spec, self.starts = spec, self.starts + 1
        return self.engine

    def before_start(self, spec: Any) -> None:
        """Another in-process engine is about to start: the shared one must be gone first."""
        if not self._starting and not spec.separate_process:
            self.close()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.engine = self.spec = None


@pytest.fixture(scope="session", autouse=True)
def engine_lease() -> Any:
    from lora_async.generator.vllm.client import EngineClient

    lease = EngineLease()
    start = EngineClient.start.__func__  # type: ignore[attr-defined]

    def guarded_start(cls: Any, spec: Any, placement: Any) -> Any:
        lease.before_start(spec)
        return start(cls, spec, placement)

    patch = pytest.MonkeyPatch()
    patch.setattr(EngineClient, "start", classmethod(guarded_start))
    yield lease
    lease.close()
    patch.undo()


def shared_spec(tiny_model: Path, **changes: Any) -> Any:
    """The shared engine: the 3-adapter fleet a run configures (`helpers.fleet_config`), sized
    for every adapter name the tests publish on it."""
    import dataclasses

    from lora_async.generator.engine import EngineSpec

    from .helpers import fleet_config

    spec = EngineSpec.from_config(fleet_config(tiny_model), tiny_model, "cpu", adapters=SHARED_ADAPTERS)
    # bfloat16 on every machine (not `auto`): the reference must match what the transports'
    # engines and `vllm serve` compute, which serve the tiny model's own bfloat16.
    return dataclasses.replace(spec, **{"dtype": "bfloat16", **changes})


@pytest.fixture
def shared_engine(engine_lease: EngineLease, tiny_model: Path, reference: dict) -> Any:
    """The shared engine; the reference is taken on it first, so that a test with an engine of its
    own later (QLoRA's float32 one) does not make the transports' tests start it again."""
    return engine_lease.get(shared_spec(tiny_model))


@pytest.fixture(scope="session")
def reference(engine_lease: EngineLease, tiny_model: Path) -> dict[int, list[tuple[int, int, float]]]:
    """The path every transport must serve alike: versions 0 and 1 of adapter "ref" (random,
    `REFERENCE_SEEDS`) published in process on the shared engine; for each version, the
    (version, first greedy token, its logprob) of every prompt in `helpers.PROMPTS`."""
    from lora_async.generator.types import GenRequest

    from .helpers import PROMPTS, generate, publish, random_adapter

    engine = engine_lease.get(shared_spec(tiny_model))
    out: dict[int, list[tuple[int, int, float]]] = {}
    for version, seed in enumerate(REFERENCE_SEEDS):
        assert publish(engine, random_adapter(tiny_model, "ref", version, seed=seed)).transport == "inproc"
        out[version] = []
        for prompt in PROMPTS:
            result = generate(engine, GenRequest(prompt, "ref", max_tokens=2, temperature=0.0, version=version))
            assert result.ok, result.error
            out[version].append((result.version, result.samples[0].token_ids[0], result.samples[0].logprobs[0]))
    assert out[0] != out[1]  # the two versions answer differently, so a stale one would show
    return out


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    from lora_async.models import embedded_tokenizer

    return embedded_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, 128-wide Llama with random bf16 weights and the SmolLM2 tokenizer."""
    from lora_async.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", tokenizer_dir)


def _heavy_cli(args: Any) -> str | None:
    """The lora-async command a subprocess runs, when it is one that loads models."""
    argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
    if not any(name in part for part in argv for name in CLI_NAMES):
        return None
    return next((a for a in argv if a in HEAVY_COMMANDS), None)


@pytest.fixture(autouse=True)
def _unit_tier_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """In the unit tier, refuse what belongs to another: a vLLM engine (`vllm`), a training run
    on real parts or a CLI command that went past its config check (`slow`), Ray (`ray`)."""
    if os.environ.get(TIER_ENV) != "unit":
        yield
        return
    node = request.node.nodeid

    def refuse(what: str, marker: str) -> Any:
        def refused(*args: Any, **kwargs: Any) -> Any:
            pytest.fail(f"{node} {what} but is not marked `{marker}`: mark it (it does not belong in the unit tier)",
                        pytrace=False)
        return refused

    from lora_async.generator.vllm.client import EngineClient
    from lora_async.orchestrator import lifecycle

    monkeypatch.setattr(EngineClient, "start", classmethod(refuse("starts a vLLM engine", "vllm")))
    monkeypatch.setattr(lifecycle.LocalParts, "__init__", refuse("trains on real parts (model, engine, learner)",
                                                                "slow"))
    monkeypatch.setattr("lora_async.generator.ray.cluster.connect", refuse("starts Ray", "ray"))
    started: list[tuple[subprocess.Popen, str]] = []
    popen_init = subprocess.Popen.__init__

    def watched(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        popen_init(self, args, *rest, **kwargs)
        command = _heavy_cli(args)
        if command is not None:
            started.append((self, command))

    monkeypatch.setattr(subprocess.Popen, "__init__", watched)
    yield
    for process, command in started:
        if process.returncode != CONFIG_ERROR_EXIT:
            pytest.fail(f"{node} ran `lora-async {command}` past its config check (exit {process.returncode}) but is "
                        "not marked `slow`: mark it (it does not belong in the unit tier)", pytrace=False)


@pytest.fixture
def listener() -> Any:
    """A TCP listener on the host's 127.0.0.1, non-blocking: `accept()` raises BlockingIOError
    while no connection has arrived (a connect() that returned has its connection queued)."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    yield server
    server.close()
