"""bfloat16 against float32 on this CPU: why `dtype = "auto"` picks float32 without native bf16.

    .venv/bin/python bench/dtype_check.py [--steps 2]      # one JSON line; a few minutes per dtype

Three figures per dtype, each on one core: a [1256 x 576] @ [576 x 1536] matmul (a learner
step's MLP shape on the default model), one learner step on the default model (8 groups x 8
samples, 45-token prompts, 14-token completions: one 1256-token micro-batch), and vLLM decoding
with an r=8 adapter (32 prompts x 32 tokens, engine in its own process on core 0). Medians.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lora_async.dtypes import native_bf16, torch_dtype  # noqa: E402

DTYPES = ("float32", "bfloat16")


def matmul_ms(dtype: str, reps: int = 10) -> float:
    a = torch.randn(1256, 576, dtype=torch_dtype(dtype))
    b = torch.randn(576, 1536, dtype=torch_dtype(dtype))
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        a @ b
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def learner_step_s(model_dir: Path, dtype: str, steps: int) -> float:
    from lora_async.buffer import TrainSample
    from lora_async.config import LearnerConfig, LoraConfig, default_loss
    from lora_async.learner import Learner
    from lora_async.placement import Placement

    learner = Learner(model_dir, {"main": (LoraConfig(), 1e-3)}, LearnerConfig(dtype=dtype), default_loss(),
                      Placement("cpu", frozenset({0})), 1.0, 0)
    rng = random.Random(0)
    samples = []
    for _ in range(8):
        prompt = [rng.randrange(1000, 20000) for _ in range(45)]
        for _ in range(8):
            completion = [rng.randrange(1000, 20000) for _ in range(14)]
            samples.append(TrainSample("main", 0, prompt, completion, [-1.0] * 14, 1.0, rng.choice([-1.0, 1.0])))
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        learner.train_step("main", samples)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def decode_tokens_per_s(model_dir: Path, dtype: str) -> float:
    from lora_async.bench.gen import _round
    from lora_async.bench.sync import _adapter
    from lora_async.generator.engine import EngineSpec, VllmGenerator
    from lora_async.placement import Placement
    from lora_async.staleness import StalenessWindow
    from lora_async.sync.transports import ShmTransport

    spec = EngineSpec(model_dir=model_dir, adapters=("bench",), window=StalenessWindow(0), max_lora_rank=8,
                      kv_cache_gb=1.0, max_model_len=512, dtype=dtype, separate_process=True, max_num_seqs=64)
    with VllmGenerator(spec, Placement("cpu", frozenset({0}))) as gen:
        transport = ShmTransport(gen)
        transport.publish(_adapter(model_dir, 8))
        transport.close()
        _round(gen, "bench", 32, 4, 0)  # warm-up
        return statistics.median(_round(gen, "bench", 32, 32, rep + 1) for rep in range(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="learner steps per dtype (median)")
    args = parser.parse_args()
    from lora_async.models import resolve_model
    from lora_async.quiet import quiet_start

    quiet_start(engine_log=False)
    torch.set_num_threads(1)
    model_dir = resolve_model("smollm2-135m")
    report: dict = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": native_bf16("cpu")}
    for dtype in DTYPES:
        report[dtype] = {"matmul_ms": matmul_ms(dtype), "learner_step_s": learner_step_s(model_dir, dtype, args.steps),
                         "decode_tokens_per_s": decode_tokens_per_s(model_dir, dtype)}
    report["bf16_slowdown"] = {key: (report["bfloat16"][key] / report["float32"][key] if "per_s" not in key
                                     else report["float32"][key] / report["bfloat16"][key])
                               for key in report["float32"]}
    print(json.dumps(report))


if __name__ == "__main__":  # vLLM spawns processes: everything runs under this guard
    main()
