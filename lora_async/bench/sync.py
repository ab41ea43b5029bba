"""`lora-async bench sync`: hot-swap latency of a new adapter version, per path.

For each path and each of N successive versions: the time from "tensors ready" to "the first
generation on the new version returns", minus the median time of the same generation on the
version once it is loaded (measured right after, so slow drift of the machine cancels). Every measurement uses a prompt the engine has not seen, so the prefix
cache never helps one side. The full-weight row pushes the base state dict through the worker's
model `load_weights` (what a full-weight sync ends with) and generates on the base model. The
`torch-copy` row is the floor: the same tensors copied, on the engine's cores, into preallocated
tensors of the shapes and dtype the engine holds (no engine, no generation).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch

from ..adapter_version import AdapterVersion, peft_config_dict
from ..adapters import save_peft_dir
from ..generator.types import GenRequest

if TYPE_CHECKING:
    from ..generator.engine import VllmGenerator

P = TypeVar("P")  # what one publish takes: a version, or a whole state dict
PROBE_TOKENS = 1  # "first generation returns": one new token
BASELINE_REPS = 5


def _adapter(model_dir: Path, rank: int, seed: int = 0) -> AdapterVersion:
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False)
    model = get_peft_model(base, cfg)
    tensors = {k: v.detach().clone() * 0.1 for k, v in get_peft_model_state_dict(model).items()}
    return AdapterVersion("bench", 0, tensors, peft_config_dict(cfg))


ENGINE = ("inproc", "peft-dir-disk", "peft-dir-devshm", "full-reload")  # in-process engine
REFERENCE = ("torch-copy",)  # no engine: a plain copy of the same bytes, the floor for the rows above
LOCAL = ENGINE + REFERENCE
SEPARATE = ("shm", "gloo")  # engine core in a child process
SERVER = ("http",)  # a `vllm serve` child on 127.0.0.1
GPU_ONLY = ("cuda-ipc", "nccl")
ALL = LOCAL + SEPARATE + SERVER + GPU_ONLY


def run_sync_bench(model: str, ranks: list[int], versions: int, transports: tuple[str, ...] = LOCAL,
                   console: Any = None, cpus: str | None = "0") -> list[dict[str, Any]]:
    """One row per (transport, rank): median and max hot-swap latency (`p50_ms`, `max_ms`:
    tensors ready -> first token on the new version, less the same on a loaded one) and the
    median publish time alone (`publish_p50_ms`: ready -> registered).

    One engine of each kind serves every rank (its `max_lora_rank` is the largest asked for).
    The engine runs on the cores `cpus` (one core by default: a probe on 2 OpenMP threads
    varies by tens of ms on a shared machine, on one it varies by a few); the sender runs on
    the rest, as a learner would."""
    from ..config import vllm_rank
    from ..models import resolve_model

    say = console.print if console is not None else (lambda *a, **k: None)
    model_dir = resolve_model(model)
    adapters = {r: _adapter(model_dir, r) for r in ranks}
    max_rank = vllm_rank(max(ranks))
    rows: list[dict[str, Any]] = []
    wanted = [t for t in ALL if t in transports]
    if "torch-copy" in wanted:
        say("plain copy on the engine's cores: torch-copy")
        rows += [_torch_copy(adapter, rank, versions, cpus) for rank, adapter in adapters.items()]
    local = [t for t in wanted if t in ENGINE]
    if local:
        say(f"in-process engine: {', '.join(local)}")
        rows += _with_engine(model_dir, max_rank, False, local, adapters, versions, cpus)
    separate = [t for t in wanted if t in SEPARATE]
    if separate:
        say(f"engine in its own process: {', '.join(separate)}")
        rows += _with_engine(model_dir, max_rank, True, separate, adapters, versions, cpus)
    if "http" in wanted:
        say("vllm serve on 127.0.0.1: http")
        rows += _with_server(model_dir, max_rank, adapters, versions, cpus)
    for name in (t for t in wanted if t in GPU_ONLY):
        rows.append({"transport": name, "rank": None, "measured": False,
                     "why": "needs CUDA (this machine has no GPU); see bench/gpu_transport_check.py"})
    full = next((r["p50_ms"] for r in rows if r["transport"] == "full-reload"), None)
    for row in rows:
        if full and row.get("p50_ms"):
            row["speedup_vs_full"] = full / max(row["p50_ms"], 1e-3)
    return rows


def _fresh_prompts() -> Callable[[], list[int]]:
    counter = iter(range(10**9))

    def fresh() -> list[int]:
        n = next(counter)  # never seen before: the prefix cache never helps one side
        return [1, 504, 3056, 314, 100 + n % 20000, 200 + n // 20000, 30]
    return fresh


def _measure(gen: Any, label: str, rank: int | None, prepare: Callable[[int], P], publish: Callable[[P], Any],
             adapter_name: str | None, versions: int, fresh: Callable[[], list[int]]) -> dict[str, Any]:
    """Publish versions 1..`versions` (each `prepare(v)`, what exists before "tensors ready", made
    before the clock starts) and time each until a generation on it is done."""
    from .common import blocking_generate

    def probe() -> float:
        started = time.perf_counter()
        result = blocking_generate(gen, GenRequest(fresh(), adapter_name, max_tokens=PROBE_TOKENS, temperature=0.0))
        assert result.ok, result.error
        return time.perf_counter() - started

    publish(prepare(0))  # warm this path up
    probe()
    swaps, publishes, size = [], [], 0
    for v in range(1, versions + 1):
        payload = prepare(v)  # the learner's new tensors
        started = time.perf_counter()
        stats = publish(payload)
        registered = time.perf_counter()
        probe()
        elapsed = time.perf_counter() - started
        loaded = statistics.median(probe() for _ in range(BASELINE_REPS))  # same generation, loaded
        swaps.append((elapsed - loaded) * 1000)
        publishes.append((registered - started) * 1000)
        size = stats if isinstance(stats, int) else stats.bytes
    return {"transport": label, "rank": rank, "measured": True, "versions": versions, "bytes": size,
            "p50_ms": statistics.median(swaps), "max_ms": max(swaps),
            "publish_p50_ms": statistics.median(publishes)}




def _versions_of(adapter: AdapterVersion, name: str) -> Callable[[int], AdapterVersion]:
    def make(v: int) -> AdapterVersion:
        # as the learner hands a version over: one buffer, every tensor a view (AdapterVersion.gather)
        return AdapterVersion.gather(name, v, {k: t * (1 + 0.01 * v) for k, t in adapter.tensors.items()},
                                     adapter.peft_config)
    return make


def _with_engine(model_dir: Path, max_rank: int, separate: bool, transports: list[str],
                 adapters: dict[int, AdapterVersion], versions: int, cpus: str | None) -> list[dict[str, Any]]:
    from ..generator.engine import EngineSpec, VllmGenerator
    from ..placement import Placement, parse_cpus
    from ..staleness import StalenessWindow
    from ..sync.collective import CollectiveTransport
    from ..sync.transports import InprocTransport, ShmTransport, Transport

    names = tuple(f"{t}-r{r}" for t in transports for r in adapters)
    spec = EngineSpec(model_dir=model_dir, adapters=names, window=StalenessWindow(0), max_lora_rank=max_rank,
                      kv_cache_gb=1.0, max_model_len=512, seed=0, separate_process=separate)
    fresh = _fresh_prompts()
    rows = []
    placement = Placement("cpu", parse_cpus(cpus) if cpus else None)
    with VllmGenerator(spec, placement) as gen:
        senders: dict[str, Callable[[], Transport]] = {
            "inproc": lambda: InprocTransport(gen), "shm": lambda: ShmTransport(gen),
            "gloo": lambda: CollectiveTransport(gen, backend="gloo")}
        for transport in transports:
            if transport == "full-reload":
                rows.append(_measure(gen, transport, None, *_full_reload(gen, model_dir), None, versions, fresh))
                continue
            for rank, adapter in adapters.items():
                name = f"{transport}-r{rank}"
                make = _versions_of(adapter, name)
                if transport.startswith("peft-dir"):
                    root = Path(tempfile.mkdtemp(dir="/dev/shm" if transport.endswith("devshm") else Path.cwd()))

                    def publish(version: AdapterVersion, root: Path = root, name: str = name) -> Any:
                        path = save_peft_dir(root / f"v{version.version}", version.tensors, version.peft_config)
                        return gen.publish_dir(name, version.version, path)
                    try:
                        rows.append(_measure(gen, transport, rank, make, publish, name, versions, fresh))
                    finally:
                        shutil.rmtree(root, ignore_errors=True)
                    continue
                sender = senders[transport]()
                try:
                    rows.append(_measure(gen, transport, rank, make, sender.publish, name, versions, fresh))
                finally:
                    sender.close()
    return rows


def _with_server(model_dir: Path, max_rank: int, adapters: dict[int, AdapterVersion],
                 versions: int, cpus: str | None) -> list[dict[str, Any]]:
    from ..generator.server import ServerClient, ServerGenerator
    from ..staleness import StalenessWindow
    from ..sync.http import HttpTransport
    from .server import training_server

    rows = []
    with training_server(model_dir, max_rank, max_loras=4, max_model_len=512, cpus=cpus) as url, \
            tempfile.TemporaryDirectory(dir="/dev/shm") as sync_dir, \
            ServerGenerator(ServerClient([url]), model_dir, StalenessWindow(0), max_rank) as gen:
        transport = HttpTransport(gen, Path(sync_dir))
        fresh = _fresh_prompts()
        for rank, adapter in adapters.items():
            make = _versions_of(adapter, f"http-r{rank}")
            rows.append(_measure(gen, "http", rank, make, transport.publish, f"http-r{rank}", versions, fresh))
    return rows


def _torch_copy(adapter: AdapterVersion, rank: int, versions: int, cpus: str | None) -> dict[str, Any]:
    """Each version's tensors copied into preallocated tensors of the same shapes in the dtype
    the bench's engines serve (`EngineSpec`'s default), with torch's fastest list copy
    (`_foreach_copy_`), on a thread placed as the engine's is."""
    import threading

    from ..dtypes import torch_dtype
    from ..generator.spec import EngineSpec
    from ..placement import Placement, parse_cpus, pin_current_thread

    dtype = EngineSpec.dtype

    make = _versions_of(adapter, "torch-copy")
    out: dict[str, Any] = {}

    def run() -> None:
        pin_current_thread(Placement("cpu", parse_cpus(cpus) if cpus else None))
        first = list(make(0).tensors.values())  # the order the learner hands tensors over in
        dst = [torch.empty_like(t, dtype=torch_dtype(dtype)) for t in first]
        torch._foreach_copy_(dst, first)  # warm up (first touch of dst)
        times = []
        for v in range(1, versions + 1):
            src = list(make(v).tensors.values())  # the learner's new tensors: made before the clock
            started = time.perf_counter()
            torch._foreach_copy_(dst, src)
            times.append((time.perf_counter() - started) * 1000)
        out["times"] = times

    thread = threading.Thread(target=run, name="lora-async-bench-copy")  # leaves this thread unpinned
    thread.start()
    thread.join()
    times = out["times"]
    return {"transport": "torch-copy", "rank": rank, "measured": True, "versions": versions,
            "bytes": adapter.nbytes, "p50_ms": statistics.median(times), "max_ms": max(times),
            "publish_p50_ms": statistics.median(times)}


def _full_reload(gen: VllmGenerator, model_dir: Path
                 ) -> tuple[Callable[[int], dict[str, torch.Tensor]], Callable[[dict[str, torch.Tensor]], int]]:
    """(prepare, publish) of the full-weight row: the base state dict through vLLM's reload."""
    from safetensors.torch import load_file

    state = {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    size = sum(t.numel() * t.element_size() for t in state.values())

    def prepare(v: int) -> dict[str, torch.Tensor]:
        return {k: t.clone() for k, t in state.items()}  # what a learner would hand over

    def publish(tensors: dict[str, torch.Tensor]) -> int:
        if gen.spec.separate_process:
            raise RuntimeError("the full-weight row runs on the in-process engine")
        gen.run_in_engine(lambda client: client.load_base_weights(tensors))
        return size

    return prepare, publish
