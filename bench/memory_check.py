"""The memory plan against measured peak memory: one learner step on the default model, on CPU.

    .venv/bin/python bench/memory_check.py                       # the default cases, one JSON line each
    .venv/bin/python bench/memory_check.py --case float32:2048:off --case nf4-float32:2048:on

A case is DTYPE:TOKEN_BUDGET:CHECKPOINTING, DTYPE one of float32, bfloat16, nf4-float32,
nf4-bfloat16 (nf4 = `model.quantization = "nf4"` with that compute dtype). Each case runs in a
fresh child process: it imports torch, transformers, peft, bitsandbytes and lora_async first,
takes that RSS as the baseline, then builds a `Learner` (rank-8 LoRA on all linear layers) and
runs one `train_step` on samples that fill the token budget (rows of 256 tokens: a 32-token
prompt and a 224-token completion, every completion token trained, advantages +-1). The peak is
the kernel's high-water mark (VmHWM), reset after the imports, so it covers the model load and
the step. `lora-async plan`'s learner total for the same settings is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_CASES = ("float32:2048:off", "float32:2048:on", "float32:512:off", "bfloat16:512:off",
                 "nf4-float32:2048:off", "nf4-bfloat16:512:off")
ROW_PROMPT, ROW_COMPLETION = 32, 224  # one 256-token row per sample


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1])


def reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def parse_case(case: str) -> tuple[str, str, int, bool]:
    """'nf4-bfloat16:512:off' -> (dtype, quantization, token_budget, checkpointing)."""
    kind, budget, ckpt = case.split(":")
    quantization, _, dtype = kind.rpartition("-")
    return dtype, quantization or "none", int(budget), ckpt == "on"


def samples_filling(budget: int) -> list:
    import random

    from lora_async.buffer import TrainSample

    rng = random.Random(0)
    rows = max(1, budget // (ROW_PROMPT + ROW_COMPLETION))
    return [TrainSample("main", 0, [rng.randrange(1000, 20000) for _ in range(ROW_PROMPT)],
                        [rng.randrange(1000, 20000) for _ in range(ROW_COMPLETION)], [-1.0] * ROW_COMPLETION,
                        1.0, rng.choice([-1.0, 1.0])) for _ in range(rows)]


def child(case: str) -> dict:
    """Measure one case in this (fresh) process."""
    import bitsandbytes  # noqa: F401  (part of the baseline, like torch)
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from lora_async.config import LearnerConfig, LoraConfig, default_loss
    from lora_async.learner import Learner
    from lora_async.models import resolve_model
    from lora_async.placement import Placement

    dtype, quantization, budget, ckpt = parse_case(case)
    model_dir = resolve_model("smollm2-135m")
    samples = samples_filling(budget)
    baseline = status_kb("VmRSS")
    reset_peak()
    learner = Learner(model_dir, {"main": (LoraConfig(), 2e-4)},
                      LearnerConfig(dtype=dtype, token_budget=budget, gradient_checkpointing=ckpt),
                      default_loss(), Placement("cpu", None), 1.0, 0, quantization)
    loaded, load_peak = status_kb("VmRSS"), status_kb("VmHWM")
    reset_peak()
    began = time.perf_counter()
    stats = learner.train_step("main", samples)
    seconds = time.perf_counter() - began
    step_peak = status_kb("VmHWM")
    assert stats.updated and stats.micro_batches == 1, stats
    mib = 1024
    return {"case": case, "baseline_mib": baseline / mib, "after_load_mib": (loaded - baseline) / mib,
            "load_peak_mib": (load_peak - baseline) / mib, "step_peak_mib": (step_peak - baseline) / mib,
            "peak_mib": (max(load_peak, step_peak) - baseline) / mib, "padded_tokens": stats.padded_tokens,
            "step_s": round(seconds, 1)}


def planned_mib(case: str, tensors_only: bool = False) -> float:
    """`lora-async plan`'s learner total (weights, LoRA, activations) for the case;
    `tensors_only` leaves out what glibc keeps of freed memory (compare it with a child run
    under MALLOC_MMAP_THRESHOLD_, where glibc keeps none)."""
    from lora_async.config import load_config
    from lora_async.plan import learner_items, load_shape

    dtype, quantization, budget, ckpt = parse_case(case)
    config = load_config(None, [f"learner.dtype={dtype}", f"model.quantization={quantization}",
                                f"learner.token_budget={budget}",
                                f"learner.gradient_checkpointing={str(ckpt).lower()}"])
    items = learner_items(config, load_shape(config.model.name), "cpu", dtype, row_tokens=ROW_PROMPT + ROW_COMPLETION)
    kept = "freed, kept by malloc"
    return sum(i.bytes for i in items if not (tensors_only and i.name == kept)) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", help="DTYPE:TOKEN_BUDGET:on|off (repeatable)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    for case in args.case or DEFAULT_CASES:
        done = subprocess.run([sys.executable, __file__, "--child", case], capture_output=True, text=True)
        if done.returncode != 0:
            print(json.dumps({"case": case, "error": done.stderr.strip()[-400:]}), flush=True)
            continue
        row = json.loads(done.stdout.strip().splitlines()[-1])
        row["planned_mib"] = round(planned_mib(case), 1)
        row["planned_over_measured"] = round(row["planned_mib"] / row["peak_mib"], 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
