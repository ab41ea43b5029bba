"""The learner's base at full precision vs bitsandbytes nf4 and int8, side by side in one run.

For each variant a fresh subprocess builds the learner on the embedded SmolLM2-135M. It runs
`--steps` training steps on one fixed batch and reports several figures:
- median step time;
- peak RSS above the process's baseline after imports;
- the base's weight footprint;
- the mean and max |logprob| gap to the float32 base on fixed probe texts (teacher-forced,
  base model, adapter off). That gap is what a generator serving the original base
  (`generator.base = "original"`) adds to `logprob_mismatch`;
- for nf4 and int8, the time to export the generator's base (the learner's weights,
  dequantised: `learner/served_base.py`) and the same probe gap between an unquantised learner
  on that base and the quantised learner: what the default `generator.base = "learner"` leaves.

    .venv/bin/python bench/quant_check.py [--steps 3] [--variants float32,bfloat16,nf4,int8] > bench/results/quant.json
    .venv/bin/python bench/quant_check.py --variants nf4,nf4-unpinned,nf4,nf4-unpinned   # the kernel-path A/B
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROBES = [
    "What is 37 + 45? Answer: 82",
    "The capital of France is Paris, which is known for the Eiffel tower.",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time there was a little fox who lived in the forest.",
    "Answer with only the final number. What is 7 + 8?\n15",
]
VARIANTS = {  # name -> (learner.dtype, model.quantization)
    "float32": ("float32", "none"),
    "bfloat16": ("bfloat16", "none"),
    "nf4": ("float32", "nf4"),
    "int8": ("float32", "int8"),
    # nf4 with bitsandbytes choosing its own kernels (`frozen_base.one_kernel_path` off): an A/B
    "nf4-unpinned": ("float32", "nf4"),
}


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def measure(variant: str, steps: int, samples: int, completion: int) -> dict:
    """One variant, in this process (the parent runs each in its own)."""
    import torch
    from transformers import AutoTokenizer

    from lora_async.buffer import TrainSample
    from lora_async.config import LearnerConfig, LoraConfig, default_loss
    from lora_async.learner import Learner
    from lora_async.models import resolve_model
    from lora_async.placement import Placement

    dtype, quantization = VARIANTS[variant]
    if variant.endswith("-unpinned"):
        from lora_async.learner import frozen_base, learner as learner_module

        frozen_base.one_kernel_path = learner_module.one_kernel_path = lambda base: None  # type: ignore[assignment]
    model_dir = resolve_model("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    baseline = rss_mb()
    started = time.perf_counter()
    learner = Learner(model_dir, {"main": (LoraConfig(rank=8), 1e-4)}, LearnerConfig(dtype=dtype), default_loss(),
                      Placement("cpu", None), 1.0, 0, quantization)
    load_s = time.perf_counter() - started
    footprint = learner.model.get_memory_footprint() / 2**20
    gen = torch.Generator().manual_seed(0)
    prompt = tokenizer(PROBES[0])["input_ids"]
    batch = [TrainSample("main", 0, prompt, torch.randint(100, 40000, (completion,), generator=gen).tolist(),
                         [-2.0] * completion, float(i % 2), 1.0 if i % 2 else -1.0) for i in range(samples)]
    times = []
    for _ in range(steps):
        times.append(learner.train_step("main", batch).seconds)
    probes = []
    for text in PROBES:
        ids = tokenizer(text)["input_ids"]
        probes.append(TrainSample("main", 0, ids[:3], ids[3:], [0.0] * (len(ids) - 3), 0.0, 0.0))
    logprobs = [lp for row in learner.logprobs(None, probes) for lp in row]
    row = {"variant": variant, "dtype": dtype, "quantization": quantization, "load_s": round(load_s, 2),
           "step_s": [round(t, 3) for t in times], "step_s_median": round(statistics.median(times), 3),
           "tokens_per_step": samples * completion, "weights_mb": round(footprint, 1),
           "peak_rss_above_baseline_mb": round(peak_rss_mb() - baseline, 1), "probe_logprobs": logprobs}
    if quantization != "none":
        row.update(served_base_gap(model_dir, dtype, quantization, probes, logprobs))
    return row


def served_base_gap(model_dir, dtype: str, quantization: str, probes: list, quantised: list[float]) -> dict:
    """The generator's base for this learner (`learner/served_base.py`): the time to export it,
    and the probe gap between an unquantised learner on it and the quantised learner."""
    import tempfile

    from lora_async.config import LearnerConfig, LoraConfig, default_loss
    from lora_async.learner import Learner
    from lora_async.base_recipe import Recipe
    from lora_async.learner.served_base import export_base
    from lora_async.placement import Placement

    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        entry = Path(tmp) / "base"
        export_base(model_dir, Recipe(quantization, dtype, "cpu"), entry)
        export_s = time.perf_counter() - started
        plain = Learner(entry, {"main": (LoraConfig(rank=8), 1e-4)}, LearnerConfig(dtype=dtype), default_loss(),
                        Placement("cpu", None), 1.0, 0, "none")
        served = [lp for row in plain.logprobs(None, probes) for lp in row]
    gaps = [abs(a - b) for a, b in zip(served, quantised)]
    return {"export_s": round(export_s, 2), "logprob_gap_vs_served_base_mean": statistics.fmean(gaps),
            "logprob_gap_vs_served_base_max": max(gaps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--completion", type=int, default=96)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one variant here
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.steps, args.samples, args.completion)))
        return
    rows = []
    for variant in args.variants.split(","):
        proc = subprocess.run([sys.executable, __file__, "--one", variant, "--steps", str(args.steps),
                               "--samples", str(args.samples), "--completion", str(args.completion)],
                              capture_output=True, text=True, check=True)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"{variant}: {rows[-1]['step_s_median']} s/step", file=sys.stderr)
    reference = next((r["probe_logprobs"] for r in rows if r["variant"] == "float32"), None)
    for row in rows:
        probe = row.pop("probe_logprobs")
        if reference is not None:
            gaps = [abs(a - b) for a, b in zip(probe, reference)]
            row["logprob_gap_vs_float32_mean"] = round(statistics.fmean(gaps), 4)
            row["logprob_gap_vs_float32_max"] = round(max(gaps), 4)
    base = next((r for r in rows if r["variant"] == "float32"), rows[0])
    for row in rows:
        row[f"step_time_vs_{base['variant']}"] = round(row["step_s_median"] / base["step_s_median"], 2)
    print(json.dumps({"steps": args.steps, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
