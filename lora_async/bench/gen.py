"""`lora-async bench gen`: generation throughput of the vLLM CPU engine, with and without a
LoRA adapter, with vLLM's CPU LoRA ops and with lora-async's grouped ones.

Each configuration is its own engine in its own process (so the grouped ops, which patch
vLLM's CPU punica module, are installed only where asked), started one after another on the
same cores; each measures `reps` rounds of `prompts` x `tokens` sampled tokens and reports the
median tokens/s. Ratios are against the vLLM-ops LoRA row of the same run.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any

from ..generator.types import GenRequest, GenResult

CONFIGS = (("base model (no LoRA)", False, True), ("LoRA r=8, vLLM CPU ops", True, False),
           ("LoRA r=8, grouped ops", True, True))


def _round(gen: Any, adapter: str | None, prompts: int, tokens: int, seed: int) -> float:
    done = threading.Semaphore(0)
    results: list[GenResult] = []

    def on_done(result: GenResult) -> None:
        results.append(result)
        done.release()

    started = time.perf_counter()
    for i in range(prompts):
        prompt = [1, 504, 3056, 314, 100 + (seed * prompts + i) % 20000, 30]
        gen.submit(GenRequest(prompt, adapter, max_tokens=tokens, min_tokens=tokens, temperature=1.0,
                              seed=seed * 1000 + i), on_done)
    for _ in range(prompts):
        done.acquire()
    elapsed = time.perf_counter() - started
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:1]
    return sum(len(s.token_ids) for r in results for s in r.samples) / elapsed


def run_gen_bench(model: str, prompts: int = 64, tokens: int = 64, reps: int = 3,
                  cpus: str | None = None) -> list[dict[str, Any]]:
    from ..generator.engine import EngineSpec, VllmGenerator
    from ..models import resolve_model
    from ..placement import Placement, parse_cpus
    from ..staleness import StalenessWindow
    from ..sync.transports import ShmTransport
    from .sync import _adapter

    model_dir: Path = resolve_model(model)
    adapter = _adapter(model_dir, 8)
    rows: list[dict[str, Any]] = []
    for label, with_lora, fast in CONFIGS:
        spec = EngineSpec(model_dir=model_dir, adapters=("bench",), window=StalenessWindow(0), max_lora_rank=8,
                          kv_cache_gb=1.0, max_model_len=512, seed=0, fast_cpu_lora=fast,
                          separate_process=True, max_num_seqs=prompts)
        with VllmGenerator(spec, Placement("cpu", parse_cpus(cpus) if cpus else None)) as gen:
            if with_lora:
                transport = ShmTransport(gen)
                transport.publish(adapter)
                transport.close()
            name = "bench" if with_lora else None
            _round(gen, name, prompts, 8, 0)  # warm-up
            rates = [_round(gen, name, prompts, tokens, rep + 1) for rep in range(reps)]
        rows.append({"config": label, "lora": with_lora, "grouped_ops": fast and with_lora,
                     "tokens_per_s_p50": statistics.median(rates), "rates": rates,
                     "prompts": prompts, "tokens": tokens})
    reference = rows[1]["tokens_per_s_p50"]
    for row in rows:
        row["ratio_vs_vllm_lora_ops"] = row["tokens_per_s_p50"] / reference
    return rows
