"""`lora-async bench sync`: hot-swap latency of a new adapter version, per path.

For each path and each of N successive versions: the time from "tensors ready" to "the first
generation on the new version returns", minus the median time of the same generation on the
version once it is loaded (measured right after, so slow drift of the machine cancels). Every measurement uses a prompt the engine has not seen, so the prefix
cache never helps one side. The full-weight row pushes the base state dict through the worker's
model `load_weights` (what a full-weight sync ends with) and generates on the base model.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..adapters import save_peft_dir
from ..generator.types import AdapterVersion, GenRequest

PROBE_TOKENS = 1  # "first generation returns": one new token
BASELINE_REPS = 5


def _adapter(model_dir: Path, rank: int, seed: int = 0) -> AdapterVersion:
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from ..generator.validate import peft_config_dict

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False)
    model = get_peft_model(base, cfg)
    tensors = {k: v.detach().clone() * 0.1 for k, v in get_peft_model_state_dict(model).items()}
    return AdapterVersion("bench", 0, tensors, peft_config_dict(cfg))


def run_sync_bench(model: str, rank: int, versions: int, transport: str = "local") -> list[dict[str, Any]]:
    from ..generator.vllm_engine import EngineSpec, VllmGenerator
    from ..models import resolve_model
    from ..placement import Placement
    from ..config import vllm_rank
    from .common import blocking_generate

    model_dir = resolve_model(model)
    adapter = _adapter(model_dir, rank)
    spec = EngineSpec(model_dir=model_dir, adapters=("bench", "disk", "shm"), max_staleness=0,
                      max_lora_rank=vllm_rank(rank), kv_cache_gb=1.0, max_model_len=512, seed=0)
    counter = iter(range(10**9))

    def fresh_prompt() -> list[int]:
        n = next(counter)
        return [1, 504, 3056, 314, 100 + n % 20000, 200 + n // 20000, 30]

    results = []
    with VllmGenerator(spec, Placement("cpu", None)) as gen:
        def probe(name: str | None) -> float:
            started = time.perf_counter()
            result = blocking_generate(gen, GenRequest(fresh_prompt(), name, max_tokens=PROBE_TOKENS,
                                                       temperature=0.0))
            assert result.ok, result.error
            return time.perf_counter() - started

        def measure(label: str, publish: Callable[[int], int], adapter_name: str | None) -> dict[str, Any]:
            publish(0)  # warm up this path
            probe(adapter_name)
            latencies = []
            size = 0
            for v in range(1, versions + 1):
                started = time.perf_counter()
                size = publish(v)
                first = probe(adapter_name)
                elapsed = time.perf_counter() - started
                # the same generation once this version is loaded (median: the CPU is noisy)
                loaded = statistics.median(probe(adapter_name) for _ in range(BASELINE_REPS))
                latencies.append((elapsed - loaded) * 1000)
            return {"transport": label, "p50_ms": statistics.median(latencies), "max_ms": max(latencies),
                    "bytes": size, "versions": versions, "rank": rank}

        def version_tensors(v: int) -> dict[str, torch.Tensor]:
            return {k: t * (1 + 0.01 * v) for k, t in adapter.tensors.items()}

        def inproc(v: int) -> int:
            return gen.publish(AdapterVersion("bench", v, version_tensors(v), adapter.peft_config)).bytes

        def directory(root: Path, name: str) -> Callable[[int], int]:
            def publish(v: int) -> int:
                path = save_peft_dir(root / f"{name}-v{v}", version_tensors(v), adapter.peft_config)
                return gen.publish_dir(name, v, path).bytes
            return publish

        results.append(measure("inproc-tensors", inproc, "bench"))
        with tempfile.TemporaryDirectory(dir=Path.cwd()) as disk:
            results.append(measure("peft-dir-disk", directory(Path(disk), "disk"), "disk"))
        with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
            results.append(measure("peft-dir-devshm", directory(Path(shm), "shm"), "shm"))
        results.append(measure("full-reload", _full_reload(gen, model_dir), None))
    full = results[-1]["p50_ms"]
    for row in results:
        row["speedup_vs_full"] = full / row["p50_ms"] if row["p50_ms"] > 0 else None
    return results


def _full_reload(gen: Any, model_dir: Path) -> Callable[[int], int]:
    from safetensors.torch import load_file

    state = {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    size = sum(t.numel() * t.element_size() for t in state.values())

    def publish(v: int) -> int:
        tensors = {k: t.clone() for k, t in state.items()}  # what a learner would hand over
        gen.run_in_engine(lambda eng: eng.collective_rpc("lora_async_load_base_weights", args=(tensors,)))
        return size

    return publish
