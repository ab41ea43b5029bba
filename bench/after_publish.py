"""What a publish costs the generation that follows it (bench/RESULTS.md section 12).

    python bench/after_publish.py [--rounds 25] [--rank 8] [--cpus 0]

`lora-async bench sync`'s hot-swap column is the publish plus the first generation after it,
less the same generation on a loaded version. This splits the part after the publish. Each
round times one greedy token on a fresh prompt (as `bench sync` probes), less the median of
loaded probes taken right after, in four cases, interleaved so the machine's drift cancels:

- `old version after a publish`: a new version is published, then the probe names the version
  before it (still live: the staleness window keeps it), so the new slot plays no part;
- `new version, second`: the new version right after that probe;
- `switch between loaded versions`: no publish; the probe names the other of two loaded
  versions (what vLLM's change of punica mapping costs);
- `after a copy of N MB`: no publish; the engine thread first copies N MB of unrelated float32
  into bfloat16 (N = the learner's buffer of one version, and 8 times that), as the publish's
  one copy does. What it moves through the core's caches is what the next forward pass reads
  back from memory.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--cpus", default="0")
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()

    from lora_async.bench import sync as bench
    from lora_async.bench.common import blocking_generate
    from lora_async.config import vllm_rank
    from lora_async.generator.engine import EngineSpec, VllmGenerator
    from lora_async.generator.types import GenRequest
    from lora_async.models import resolve_model
    from lora_async.placement import Placement, parse_cpus
    from lora_async.staleness import StalenessWindow
    from lora_async.sync.transports import InprocTransport

    model_dir = resolve_model(args.model)
    make = bench._versions_of(bench._adapter(model_dir, args.rank), "a")
    spec = EngineSpec(model_dir=model_dir, adapters=("a",), window=StalenessWindow(2),
                      max_lora_rank=vllm_rank(args.rank), kv_cache_gb=1.0, max_model_len=512, seed=0)
    fresh = bench._fresh_prompts()
    nbytes = make(0).flat.numel() * 4
    sources = {mb: torch.randn(int(mb * 2**20) // 4) for mb in (nbytes / 2**20, 8 * nbytes / 2**20)}
    targets = {mb: torch.empty(src.numel(), dtype=torch.bfloat16) for mb, src in sources.items()}
    rows: dict[str, list[float]] = {}

    def probe(version: int) -> float:
        started = time.perf_counter()
        result = blocking_generate(gen, GenRequest(fresh(), "a", max_tokens=1, temperature=0.0, version=version))
        assert result.ok, result.error
        return (time.perf_counter() - started) * 1000

    def less_loaded(label: str, first: float, version: int) -> None:
        rows.setdefault(label, []).append(first - statistics.median(probe(version) for _ in range(3)))

    def copy_of(mb: float) -> Any:
        def on_engine(client: Any) -> None:
            targets[mb].copy_(sources[mb])
        return on_engine

    with VllmGenerator(spec, Placement("cpu", parse_cpus(args.cpus))) as gen:
        transport = InprocTransport(gen)
        for v in range(3):
            transport.publish(make(v))
            probe(v)
        latest = 2
        for _ in range(args.rounds):
            latest += 1
            transport.publish(make(latest))
            less_loaded("old version after a publish", probe(latest - 1), latest - 1)
            less_loaded("new version, second", probe(latest), latest)
            probe(latest - 1)
            less_loaded("switch between loaded versions", probe(latest), latest)
            for mb in sources:
                probe(latest)
                gen.run_in_engine(copy_of(mb))
                less_loaded(f"after a copy of {mb:.1f} MB", probe(latest), latest)
    print(f"{args.rounds} rounds, r={args.rank}, engine on cpus {args.cpus}; ms over a loaded probe, median [min, max]")
    for label, values in rows.items():
        print(f"{label:36s} {statistics.median(values):6.2f}  [{min(values):6.2f}, {max(values):6.2f}]")


if __name__ == "__main__":
    main()
