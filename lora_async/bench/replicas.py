"""`lora-async bench ray`: what Ray replicas cost on one machine.

The engines serve in the dtype a run would pick on this CPU (`model.dtype = "auto"`).

- **Publish latency** to 1, 2, ... replicas: a version packed and `ray.put` once, then registered
  on every replica from the object store (`RayTransport.publish`, the training path), with the
  replicas idle. Reported: p50 and max over `versions` versions, and the p50 ratio against one
  replica.
- **Where a publish goes**, piece by piece, outside any engine: packing, the checksum, `ray.put`,
  `ray.get` on the same node (zero-copy), and a replica's copy out plus its checksum check.
  The rest of a publish is the engine registering the tensors and the replies.
- **Generation throughput**, the same load three ways on the same cores, one after another in
  one run: one in-process engine on every core (no Ray); one Ray replica on every core; one Ray
  replica per core. Reported: median tokens/s over `reps` rounds, and ratios against the
  in-process engine.

Each configuration starts its own local Ray (and stops it), so the rows do not share a cluster.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from ..dtypes import resolve_dtype
from ..placement import available_cpus
from ..staleness import StalenessWindow
from .gen import _round


def _publish_row(model_dir: Path, model: str, replicas: int, versions: int, rank: int,
                 log: Callable[[str], None]) -> dict[str, Any]:
    from ..generator.engine import EngineSpec
    from ..generator.ray.generator import RayGenerator
    from ..sync.objectstore import RayTransport
    from .sync import _adapter

    spec = EngineSpec(model_dir=model_dir, adapters=("bench",), window=StalenessWindow(1), max_lora_rank=max(rank, 8),
                      kv_cache_gb=0.5, max_model_len=512, seed=0, dtype=resolve_dtype("auto", "cpu"))
    adapter = _adapter(model_dir, rank)
    began = time.perf_counter()
    with RayGenerator(spec, model, replicas, device="cpu", cpus_per_replica=1) as gen:
        start_s = time.perf_counter() - began
        transport = RayTransport(gen)
        times = []
        for version in range(versions + 1):  # the first one (cold) is not counted
            stats = transport.publish(replace(adapter, version=version))
            if version:
                times.append(stats.ms + stats.wait_ms)  # the whole publish (idle replicas: no wait)
        live = [gen.call_replica(i, "live_versions", "bench") for i in range(replicas)]
        transport.close()
    assert all(v[-1] == versions for v in live), live
    row = {"replicas": replicas, "rank": rank, "bytes": stats.bytes, "publish_p50_ms": statistics.median(times),
           "publish_max_ms": max(times), "versions": versions, "start_s": start_s}
    log(f"publish to {replicas} replica(s): p50 {row['publish_p50_ms']:.1f} ms (start {start_s:.0f} s)")
    return row


def _publish_pieces(model_dir: Path, rank: int, repeats: int = 12) -> dict[str, float]:
    """Median milliseconds of each piece of a publish, in this process (Ray must be running)."""
    import ray
    import torch

    from ..handoff.packed import checksum
    from ..handoff.receive import receive_object
    from ..sync.pack import pack
    from .sync import _adapter

    adapter = _adapter(model_dir, rank)
    dtype = getattr(torch, resolve_dtype("auto", "cpu"))
    out = torch.empty(adapter.nbytes + (1 << 20), dtype=torch.uint8)
    times: dict[str, list[float]] = {"pack": [], "checksum": [], "ray_put": [], "ray_get": [], "receive": []}

    def timed(key: str, fn: Callable[[], Any]) -> Any:
        began = time.perf_counter()
        value = fn()
        times[key].append((time.perf_counter() - began) * 1000)
        return value

    for _ in range(repeats):
        packed = timed("pack", lambda: pack(adapter, dtype, out=out))
        meta = replace(packed.meta, checksum=timed("checksum", lambda: checksum(packed.buffer)))
        ref = timed("ray_put", lambda: ray.put(packed.buffer.numpy()))
        array = timed("ray_get", lambda: ray.get(ref))
        timed("receive", lambda: receive_object(meta, array))
    return {f"{key}_ms": statistics.median(values) for key, values in times.items()}


def _throughput_row(label: str, make: Callable[[], Any], publish: Callable[[Any], None], prompts: int, tokens: int,
                    reps: int, log: Callable[[str], None]) -> dict[str, Any]:
    with make() as gen:
        publish(gen)
        _round(gen, "bench", prompts, 8, 0)  # warm-up
        rates = [_round(gen, "bench", prompts, tokens, rep + 1) for rep in range(reps)]
    row = {"config": label, "tokens_per_s_p50": statistics.median(rates), "rates": rates,
           "prompts": prompts, "tokens": tokens}
    log(f"{label}: {row['tokens_per_s_p50']:.0f} tokens/s")
    return row


def run_ray_bench(model: str, replica_counts: list[int], versions: int = 12, rank: int = 8, prompts: int = 64,
                  tokens: int = 64, reps: int = 3, log: Callable[[str], None] = print) -> dict[str, Any]:
    from ..generator.engine import EngineSpec, VllmGenerator
    from ..generator.ray.generator import RayGenerator
    from ..models import resolve_model
    from ..placement import Placement
    from ..sync.objectstore import RayTransport
    from ..sync.transports import InprocTransport
    from .sync import _adapter

    model_dir = resolve_model(model)
    publish = [_publish_row(model_dir, model, n, versions, rank, log) for n in replica_counts]
    import ray

    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
    try:
        pieces = _publish_pieces(model_dir, rank)
    finally:
        ray.shutdown()
    log("publish pieces: " + ", ".join(f"{k} {v:.1f}" for k, v in pieces.items()))
    one = publish[0]["publish_p50_ms"]
    for row in publish:
        row["vs_one_replica"] = row["publish_p50_ms"] / one

    cores = len(available_cpus())
    adapter = _adapter(model_dir, 8)
    spec = EngineSpec(model_dir=model_dir, adapters=("bench",), window=StalenessWindow(0), max_lora_rank=8,
                      kv_cache_gb=1.0, max_model_len=512, seed=0, max_num_seqs=prompts,
                      dtype=resolve_dtype("auto", "cpu"))

    def via(transport_class: Any) -> Callable[[Any], None]:
        return lambda gen: transport_class(gen).publish(adapter)

    throughput = [
        _throughput_row(f"one in-process engine, {cores} cores (no Ray)",
                        lambda: VllmGenerator(spec, Placement("cpu", None)), via(InprocTransport),
                        prompts, tokens, reps, log),
        _throughput_row(f"1 Ray replica x {cores} cores",
                        lambda: RayGenerator(spec, model, 1, device="cpu", cpus_per_replica=cores),
                        via(RayTransport), prompts, tokens, reps, log),
        _throughput_row(f"{cores} Ray replicas x 1 core",
                        lambda: RayGenerator(spec, model, cores, device="cpu", cpus_per_replica=1),
                        via(RayTransport), prompts, tokens, reps, log),
    ]
    base = throughput[0]["tokens_per_s_p50"]
    for row in throughput:
        row["vs_in_process"] = row["tokens_per_s_p50"] / base
    return {"model": model, "cores": cores, "publish": publish, "publish_pieces": pieces, "throughput": throughput}
