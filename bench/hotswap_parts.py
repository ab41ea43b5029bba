"""Where an in-process publish's time goes (bench/RESULTS.md section 12).

    python bench/hotswap_parts.py [--versions 30] [--rank 8] [--cpus 0]

Publishes `--versions` successive versions of one adapter (as `lora-async bench sync` does:
the learner's gathered buffer, the engine pinned to `--cpus`, one greedy token on each new
version) and times each part of the publish by wrapping the function that does it: lora-async's
structure check, the worker's registration and its parts (the slot write: clearing, then the
copy with the lora_B scaling and the value check, piece by piece; vLLM's `add_adapter`), retiring the drained version, and
vLLM's punica mapping on the first batch that names the new slot. Prints the median of each
part and of the whole publish; "hand-off" is what the publish spends outside those parts (the
engine thread's command queue, vLLM's `collective_rpc`, the registry). A measuring tool, not a
benchmark row: the wrappers add a few microseconds per call.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import time
from typing import Any, Callable

PARTS: dict[str, list[float]] = collections.defaultdict(list)


def timed(owner: Any, name: str, label: str) -> None:
    """Replace `owner.name` by a wrapper that records each call's milliseconds under `label`."""
    inner: Callable[..., Any] = getattr(owner, name)
    static = isinstance(vars(owner).get(name), staticmethod) if isinstance(owner, type) else False

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            PARTS[label].append((time.perf_counter() - started) * 1000)

    setattr(owner, name, staticmethod(wrapper) if static else wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--versions", type=int, default=30)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--cpus", default="0")
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()

    import vllm.lora.model_manager as manager

    from lora_async.bench import sync as bench
    from lora_async.bench.common import blocking_generate
    from lora_async.config import vllm_rank
    from lora_async.generator import validate
    from lora_async.generator.engine import EngineSpec, VllmGenerator
    from lora_async.generator.types import GenRequest
    from lora_async.generator.vllm import hotswap
    from lora_async.models import resolve_model
    from lora_async.placement import Placement, parse_cpus
    from lora_async.staleness import StalenessWindow
    from lora_async.sync.transports import InprocTransport

    timed(validate.StructureCheck, "__call__", "structure check (lora-async)")
    timed(hotswap.HotSwap, "add", "worker registration, all of it")
    timed(hotswap.HotSwap, "_write_region", "  slot write + lora_B scaling + value check")
    timed(hotswap, "copy_scaled", "    copy, lora_B scaling, value check (piecewise)")
    timed(manager.LRUCacheLoRAModelManager, "add_adapter", "  vLLM add_adapter")
    timed(hotswap.HotSwap, "remove", "retire the drained version")
    timed(manager.LoRAModelManager, "_set_adapter_mapping", "vLLM punica mapping (first batch)")

    model_dir = resolve_model(args.model)
    make = bench._versions_of(bench._adapter(model_dir, args.rank), "a")
    spec = EngineSpec(model_dir=model_dir, adapters=("a",), window=StalenessWindow(0),
                      max_lora_rank=vllm_rank(args.rank), kv_cache_gb=1.0, max_model_len=512, seed=0)
    fresh = bench._fresh_prompts()
    publishes = []
    with VllmGenerator(spec, Placement("cpu", parse_cpus(args.cpus))) as gen:
        transport = InprocTransport(gen)
        for v in range(args.versions + 3):  # the first three learn the plans and make a spare
            version = make(v)
            started = time.perf_counter()
            transport.publish(version)
            publishes.append((time.perf_counter() - started) * 1000)
            result = blocking_generate(gen, GenRequest(fresh(), "a", max_tokens=1, temperature=0.0))
            assert result.ok, result.error
            if v == 2:
                PARTS.clear()
                publishes.clear()
        stats = gen.run_in_engine(lambda client: client.hotswap_stats())
    medians = {label: statistics.median(times) for label, times in PARTS.items()}
    total = statistics.median(publishes)
    print(f"{args.versions} versions, r={args.rank}, engine on cpus {args.cpus}: {stats}")
    print(f"{'publish (median)':48s} {total:7.3f} ms")
    for label, value in medians.items():
        print(f"{label:48s} {value:7.3f} ms  (n={len(PARTS[label])})")
    outside = total - sum(medians.get(k, 0.0) for k in ("structure check (lora-async)", "worker registration, all of it",
                                                        "retire the drained version"))
    print(f"{'hand-off (the rest of the publish)':48s} {outside:7.3f} ms")


if __name__ == "__main__":
    main()
