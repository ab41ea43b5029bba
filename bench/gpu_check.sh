#!/usr/bin/env bash
# The GPU checks of issue 13 in one go (under 10 minutes on one GPU): transports (cuda-ipc, nccl),
# a learner step in bf16 and nf4 on cuda:0, the data-parallel learner on 2 GPUs if present, and
# the memory plan against torch.cuda.max_memory_allocated. Needs torch, transformers, peft and
# bitsandbytes (not vLLM). Writes bench/results/gpu_check.json (or $1).
#
#   bash bench/gpu_check.sh [OUT.json] [--tokenizer DIR]   # DIR: a tokenizer, on machines without PyPI
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench/results/gpu_check.json}"
shift || true
python="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
"$python" -c "import torch, transformers, peft, bitsandbytes" \
  || { echo "error: gpu_check needs torch, transformers, peft and bitsandbytes" >&2; exit 2; }
nvidia-smi -L || { echo "error: no NVIDIA GPU here (nvidia-smi failed)" >&2; exit 2; }
timeout 570 "$python" bench/gpu_check.py --device cuda:0 --out "$out" "$@"
echo "wrote $out"
