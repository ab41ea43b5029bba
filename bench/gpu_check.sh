#!/usr/bin/env bash
# The GPU checks in one go: transports (cuda-ipc; nccl on 2 GPUs), a learner step in bf16 and nf4
# on cuda:0, the data-parallel learner on 2 GPUs if present, the memory plan against
# torch.cuda.max_memory_allocated (about 70 s on one H200, machine start aside), and the nf4
# generator base exported from an 8B-shaped checkpoint (32 GB of disk; not yet run on a GPU,
# estimated 2-3 minutes). First, on a GPU, the tests marked `gpu` (`pytest -m gpu`: the transports'
# GPU half, bit for bit; none needs vLLM). Needs torch, transformers, peft, bitsandbytes and
# pytest (not vLLM). Writes bench/results/gpu_check.json (or $1); exits non-zero if a test failed.
#
# On the GPU machine lent to sessions, which has no bitsandbytes or pydantic and no network, run
# `bash bench/gpu_wheels.sh` here first and carry [".whl", ".gpu"]: this script installs the
# wheels from .whl/ (pip --no-index --target, then PYTHONPATH) and takes the tokenizer from
# .gpu/tokenizer. `bash bench/gpu_rehearse.sh` runs the same steps here on CPU, in a venv holding
# only that machine's packages.
#
#   bash bench/gpu_check.sh [OUT.json] [--tokenizer DIR] [--device cpu --quick]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench/results/gpu_check.json}"
shift || true
python="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
if ls .whl/*.whl >/dev/null 2>&1 && ! "$python" -c "import bitsandbytes, pydantic, blake3" 2>/dev/null; then
  site="${TMPDIR:-/tmp}/lora-async-gpu-site"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$python" -c "import torch, transformers, peft, bitsandbytes, pydantic, pytest" \
  || { echo "error: gpu_check needs torch, transformers, peft, bitsandbytes, pydantic and pytest (bash bench/gpu_wheels.sh, then carry .whl)" >&2; exit 2; }
args=("$@")
if [ -d .gpu/tokenizer ] && [[ " $* " != *" --tokenizer "* ]]; then args+=(--tokenizer .gpu/tokenizer); fi
tests=0
if [[ " $* " != *" --device cpu "* ]]; then
  nvidia-smi -L || { echo "error: no NVIDIA GPU here (nvidia-smi failed)" >&2; exit 2; }
  # the GPU tests first, in at most 120 s of the device call's 600 (the check takes about 70)
  timeout 120 "$python" -m pytest -q -p no:cacheprovider -m gpu tests || tests=$?
fi
PYTHONUNBUFFERED=1 timeout 450 "$python" bench/gpu_check.py --out "$out" "${args[@]}"
echo "wrote $out"
if [ "$tests" -ne 0 ]; then echo "error: the gpu tests failed (pytest exit $tests)" >&2; exit "$tests"; fi
