"""The generator-to-transport seam without an engine: senders typed against a receiver, a fake
receiver that uses the real receiving halves (`handoff.receive`), and the layering rule that
keeps `generator/` and `handoff/` free of `sync/` (and the learner and the generator free of
each other)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from lora_async.adapter_version import AdapterVersion
from lora_async.generator.registry import LiveVersion, VersionRegistry, register_version
from lora_async.generator.types import Delivery, GeneratorStats, PublishStats
from lora_async.handoff import PackError, PackMeta
from lora_async.handoff.receive import receive_shm
from lora_async.staleness import StalenessWindow

PACKAGE = Path(__file__).resolve().parent.parent / "lora_async"


class FakeEngine:
    """An `EngineReceiver` that keeps what it receives; shared memory is read by the real
    receiving half, with the metadata as it crosses vLLM's RPC (plain data)."""

    def __init__(self, in_process: bool = True) -> None:
        self.in_process = in_process
        self.held: dict[int, dict[str, torch.Tensor]] = {}

    def add_tensors(self, int_id, tensors, peft_config, borrowed=False, flat=None, structure=None) -> None:
        self.held[int_id] = {k: t.clone() for k, t in tensors.items()}

    def add_shm(self, int_id: int, segment: str, meta: PackMeta) -> None:
        self.held[int_id] = receive_shm(segment, PackMeta.from_dict(meta.to_dict()))

    def remove(self, int_id: int) -> None:
        del self.held[int_id]


class FakeEngineGenerator:
    """A `Generator[FakeEngine]`: the shared register routine, the receiver used in this thread."""

    def __init__(self, engine: FakeEngine, serving_dtype: str = "bfloat16") -> None:
        self.engine, self.serving_dtype = engine, serving_dtype
        self.stats = GeneratorStats()
        self.registry = VersionRegistry(StalenessWindow(1), capacity=10)

    def validate(self, version: AdapterVersion, values: bool = True) -> None:
        pass

    def register(self, delivery: Delivery[FakeEngine]) -> PublishStats:
        return register_version(self.registry, delivery, self.engine, self.stats, retire=self._retire)

    def with_receiver(self, fn):
        return fn(self.engine)

    def _retire(self, live: LiveVersion) -> str:
        self.engine.remove(live.int_id)
        self.registry.remove(live)
        return live.served_name


def version(v: int = 0) -> AdapterVersion:
    torch.manual_seed(v)
    return AdapterVersion("a", v, {"m.q.lora_A.weight": torch.randn(8, 48), "m.q.lora_B.weight": torch.randn(40, 8)},
                          {"r": 8})


def test_inproc_refuses_an_engine_in_another_process():
    from lora_async.sync.transports import InprocTransport, TransportError

    with pytest.raises(TransportError, match="own process"):
        InprocTransport(FakeEngineGenerator(FakeEngine(in_process=False)))
    generator = FakeEngineGenerator(FakeEngine())
    stats = InprocTransport(generator).publish(version())
    assert stats.transport == "inproc" and torch.equal(generator.engine.held[stats.int_id]["m.q.lora_B.weight"],
                                                       version().tensors["m.q.lora_B.weight"])


@pytest.mark.parametrize("serving", ["bfloat16", "float32"])
def test_shm_delivers_the_tensors_in_the_serving_dtype(serving):
    from lora_async.sync.transports import ShmTransport

    generator = FakeEngineGenerator(FakeEngine(), serving)
    transport = ShmTransport(generator)
    try:
        for v in range(3):
            stats = transport.publish(version(v))
            got = generator.engine.held[stats.int_id]
            assert {k: t.dtype for k, t in got.items()} == dict.fromkeys(got, getattr(torch, serving))
            assert all(torch.equal(got[k], t.to(getattr(torch, serving))) for k, t in version(v).tensors.items())
            assert (stats.transport, stats.served_name) == ("shm", f"a@v{v}") and stats.bytes >= 8 * 48 * 2
        assert sorted(generator.registry.versions("a")) == [1, 2] and len(generator.engine.held) == 2  # v0 retired
    finally:
        transport.close()


def test_tensors_whose_sizes_are_not_aligned_pack_into_the_reused_buffer():
    """The reused buffer holds the packed length (the last tensor's end, aligned), not less."""
    from lora_async.sync.transports import ShmTransport

    generator = FakeEngineGenerator(FakeEngine(), "float32")
    odd = AdapterVersion("a", 0, {"m.q.lora_A.weight": torch.randn(3, 5), "m.q.lora_B.weight": torch.randn(5, 3)}, {})
    transport = ShmTransport(generator)
    try:
        got = generator.engine.held[transport.publish(odd).int_id]
        assert all(torch.equal(got[k], t) for k, t in odd.tensors.items())
    finally:
        transport.close()


def test_a_damaged_segment_is_refused_and_nothing_is_registered():
    from lora_async.sync.transports import ShmTransport

    generator = FakeEngineGenerator(FakeEngine())
    transport = ShmTransport(generator)
    loader = transport._loader

    def flip(packed):
        transport._tensor[packed.meta.nbytes // 2] ^= 0xFF
        return loader(packed)

    try:
        transport.publish(version(0))
        transport._loader = flip
        with pytest.raises(PackError, match="checksum mismatch"):
            transport.publish(version(1))
        assert generator.stats.rejected_versions == 1
        assert generator.registry.versions("a") == [0] and len(generator.engine.held) == 1
    finally:
        transport.close()


def test_the_factory_picks_the_configured_sender(tmp_path):
    from lora_async.config import TrainConfig
    from lora_async.sync.factory import make_transport
    from lora_async.sync.transports import InprocTransport, ShmTransport

    def config(process: str) -> TrainConfig:
        return TrainConfig.model_validate({"generator": {"engine_process": process}})

    inproc = make_transport(config("same"), FakeEngineGenerator(FakeEngine()), "cpu", tmp_path)
    shm = make_transport(config("separate"), FakeEngineGenerator(FakeEngine(in_process=False)), "cpu", tmp_path)
    try:
        assert isinstance(inproc, InprocTransport) and isinstance(shm, ShmTransport)
    finally:
        shm.close()


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at any level (function-level imports too), made absolute."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return found


@pytest.mark.parametrize("layer, below", [("generator", ("lora_async.sync",)),
                                          ("handoff", ("lora_async.sync", "lora_async.generator"))])
def test_the_handoff_sits_below_both_sides(layer, below):
    """Nothing in `generator/` imports the senders; `handoff/` imports neither side."""
    offenders = sorted(f"{path.relative_to(PACKAGE)}: {name}" for path in (PACKAGE / layer).rglob("*.py")
                       for name in _imports(path) if name.startswith(below))
    assert offenders == []
    assert "lora_async.handoff.packed" in _imports(PACKAGE / "sync" / "pack.py")  # the scan sees relative imports


SIDES = ("lora_async.learner", "lora_async.generator", "lora_async.sync", "lora_async.handoff",
         "lora_async.orchestrator")


@pytest.mark.parametrize("layer, above", [("learner", ("lora_async.generator", "lora_async.orchestrator")),
                                          ("generator", ("lora_async.learner",)),
                                          ("bench", ("lora_async.serve",)),
                                          ("adapter_version.py", SIDES),
                                          ("base_recipe.py", SIDES)])
def test_what_both_sides_share_sits_below_them(layer, above):
    """The learner and the generator import nothing of each other (an adapter version, its
    served name and the base's recipe sit below both), the learner nothing of the orchestrator,
    and the benchmarks nothing of `serve`."""
    root = PACKAGE / layer
    files = [root] if root.suffix == ".py" else sorted(root.rglob("*.py"))
    offenders = sorted(f"{path.relative_to(PACKAGE)}: {name}" for path in files for name in _imports(path)
                       if any(name == module or name.startswith(module + ".") for module in above))
    assert files and offenders == []
    assert "lora_async.adapter_version.AdapterVersion" in _imports(PACKAGE / "learner" / "learner.py")
