#!/usr/bin/env bash
# The QLoRA learning runs of bench/RESULTS.md §19, one after the other: the demo task (1-digit
# addition, SmolLM2-135M), 12 async steps, held-out accuracy after every step, a canary after
# every publish. float32 on both halves, as in §8 (this CPU would pick bfloat16 on its own).
#   bash bench/qlora_runs.sh [RUN_ROOT] [NAME ...]   then   .venv/bin/python bench/qlora_table.py RUN_ROOT
# NAME: none-s0 none-s1 nf4-s0 nf4-s1 nf4tis-s0 nf4tis-s1 int8-s0 int8-s1 nf4orig-s0 (default: all).
set -euo pipefail
cd "$(dirname "$0")/.."
root="${1:-runs/qlora-v2}"
shift || true
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(none-s0 nf4-s0 nf4orig-s0 nf4-s1 nf4tis-s0 nf4tis-s1 int8-s0 none-s1 int8-s1)
for name in "${names[@]}"; do
  variant="${name%-s*}"; seed="${name##*-s}"
  args=(--set run.seed="$seed")
  case "$variant" in
    none) args+=(--set model.quantization=none) ;;
    nf4) args+=(--set model.quantization=nf4) ;;
    nf4tis) args+=(--set model.quantization=nf4 --set loss.type=tis) ;;
    nf4orig) args+=(--set model.quantization=nf4 --set generator.base=original) ;;
    int8) args+=(--set model.quantization=int8) ;;
    *) echo "unknown run $name" >&2; exit 2 ;;
  esac
  rm -rf "$root/$name"
  echo "== $name: ${args[*]}"
  .venv/bin/lora-async train examples/arithmetic.toml "${args[@]}" --set model.dtype=float32 \
    --set learner.dtype=float32 --set buffer.mode=async --set run.output_dir="$root/$name" \
    --set run.max_steps=12 --set run.time_budget_s=100000 --set run.eval_every=1 --set run.canary_every=1 \
    --set run.progress=false > "$root/$name.log" 2>&1 || echo "$name failed: see $root/$name.log"
  tail -1 "$root/$name.log"
done
