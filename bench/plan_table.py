"""The table of memory plans in docs/memory-plan.md: 8B and 14B models on one and two hypothetical 24 GB GPUs.

    .venv/bin/python bench/plan_table.py        # a markdown table on stdout

Each row is `lora-async plan --gpus N --gpu-memory-gb 24` of the default config (rank-8 LoRA on
all linear layers, learner.token_budget 4096, max_staleness 1) with the model's config.json from
tests/fixtures/model_configs/, generator.kv_cache_gb = 4, and the learner's quantisation and
checkpointing as the row says. Nothing is loaded: these are the plan's estimates.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lora_async.config import load_config  # noqa: E402
from lora_async.plan import GIB, Machine, plan_run  # noqa: E402

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "model_configs"
MODELS = (("Qwen3-8B", "qwen3-8b"), ("Qwen3-14B", "qwen3-14b"), ("Llama-3.1-8B", "llama-3.1-8b"))


def need(name: str, quantization: str, checkpointing: bool, gpus: int) -> dict[str, tuple[float, bool]]:
    config = load_config(None, [f"model.name={FIXTURES / name}", "generator.kv_cache_gb=4",
                                f"model.quantization={quantization}",
                                f"learner.gradient_checkpointing={str(checkpointing).lower()}"])
    plan = plan_run(config, Machine.with_gpus(gpus, 24))
    return {d.device: (d.need / GIB, d.fits) for d in plan.devices}


def cell(value: tuple[float, bool]) -> str:
    return f"{value[0]:.1f}" + ("" if value[1] else " (no)")


def main() -> None:
    print("| model | learner weights | checkpointing | 1 x 24 GB: cuda:0 (both) | 2 x 24 GB: cuda:1 (learner) "
          "| 2 x 24 GB: cuda:0 (generator) |")
    print("|---|---|---|---|---|---|")
    for title, name in MODELS:
        for quantization in ("none", "nf4"):
            for checkpointing in (False, True):
                one, two = need(name, quantization, checkpointing, 1), need(name, quantization, checkpointing, 2)
                weights = "bf16" if quantization == "none" else "nf4"
                print(f"| {title} | {weights} | {'on' if checkpointing else 'off'} | {cell(one['cuda:0'])} "
                      f"| {cell(two['cuda:1'])} | {cell(two['cuda:0'])} |")


if __name__ == "__main__":
    main()
