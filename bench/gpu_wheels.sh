#!/usr/bin/env bash
# Run here, where PyPI answers, before a session with a GPU machine: that machine (see the device
# library entry) has torch 2.11 (CUDA 13), transformers, peft and accelerate for Python 3.12, but
# no bitsandbytes, pydantic or blake3, and no network. This downloads the cp312 manylinux wheels
# bench/gpu_check.sh lacks there, at the versions this checkout's venv runs, into .whl/ (about
# 46 MB), and copies the embedded tokenizer into .gpu/tokenizer (3.4 MB). Both are git-ignored:
# name them in the device call's carry. gpu_check.sh installs the wheels by itself.
#
#   bash bench/gpu_wheels.sh            # then: carry [".whl", ".gpu"], command: bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
wanted=(bitsandbytes pydantic pydantic-core annotated-types typing-inspection blake3)
pins=$("$python" - "${wanted[@]}" <<'PY'
import importlib.metadata as m, sys
print(" ".join(f"{name}=={m.version(name)}" for name in sys.argv[1:]))
PY
)
rm -rf .whl && mkdir -p .whl
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $pins
tokenizer=$("$python" -c "from lora_async.models import embedded_tokenizer; print(embedded_tokenizer())")
rm -rf .gpu/tokenizer && mkdir -p .gpu/tokenizer
cp "$tokenizer"/tokenizer.json "$tokenizer"/tokenizer_config.json .gpu/tokenizer/
cp "$tokenizer"/chat_template.jinja .gpu/tokenizer/ 2>/dev/null || true
echo "wheels ($pins) in .whl/, tokenizer in .gpu/tokenizer: $(du -shc .whl .gpu | tail -1 | cut -f1) to carry"
