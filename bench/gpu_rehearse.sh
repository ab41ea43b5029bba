#!/usr/bin/env bash
# Rehearse bench/gpu_check.sh here, on CPU, so a lent GPU machine's 15 minutes go to the
# measurements: a Python 3.12 venv holding only what that machine has (the versions the device
# library entry lists: torch 2.11, transformers 5.17, peft 0.21, accelerate 1.15, no
# bitsandbytes, pydantic or blake3), then the wheels step and the check itself with --device cpu
# --quick, exactly as the GPU call runs it (wheels from .whl/, tokenizer from .gpu/tokenizer).
#
#   bash bench/gpu_rehearse.sh          # a few minutes the first time (the venv), then ~20 s
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${REHEARSE_VENV:-${TMPDIR:-/tmp}/lora-async-gpu-rehearse}"
py312=""
for candidate in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
  if "$candidate" -c "" 2>/dev/null; then py312="$candidate"; break; fi  # a pyenv shim may exist and fail
done
[ -n "$py312" ] || { echo "error: the rehearsal needs python3.12 (the GPU machine's Python)" >&2; exit 2; }
if [ ! -x "$venv/bin/python" ]; then
  "$py312" -m venv "$venv"
  "$venv/bin/pip" install -q torch==2.11.0 transformers==5.17.0 peft==0.21.0 accelerate==1.15.0 \
    safetensors==0.8.0 tokenizers==0.23.2 numpy rich typer packaging
  # typer pulls pydantic in here; the GPU machine has none of these
  "$venv/bin/pip" uninstall -q -y pydantic pydantic-core annotated-types typing-inspection bitsandbytes blake3 || true
fi
[ -d .whl ] && [ -d .gpu/tokenizer ] || bash bench/gpu_wheels.sh
export TMPDIR="$(mktemp -d)"  # a fresh --target, as on a bare machine
PYTHON="$venv/bin/python" bash bench/gpu_check.sh "$TMPDIR/gpu_check.json" --device cpu --quick --work "$TMPDIR/work"
echo "rehearsal passed: bash bench/gpu_check.sh will find what it needs on the GPU machine"
