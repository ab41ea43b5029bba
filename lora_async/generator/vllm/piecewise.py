"""One copy of a version into its place in vLLM, done piece by piece so it is read once.

vLLM builds a version with `.to(dtype)` and then multiplies each lora_B by its scaling in that
dtype (`LoRALayerWeights.optimize`); the hot-swap does the same, and checks the copy for NaN
and Inf. Done as three passes over the whole buffer, the scaling and the check read back
megabytes the copy has already pushed out of the core's cache. Here each piece of `PIECE`
elements is copied, scaled and summed while it is still in cache: the same elementwise
operations in the same order and dtype, so the same bits as a `copy_` and a `mul_` per range.
"""

from __future__ import annotations

import torch

from ..validate import value_sum

PIECE = 1 << 16  # elements: 256 KiB of float32 source and 128 KiB of bfloat16 target


def copy_scaled(target: torch.Tensor, source: torch.Tensor, scale: list[tuple[int, int, float]],
                check: bool) -> bool:
    """`target[:] = source` (cast as `.to(target.dtype)`), then `target[start:end] *= factor` for
    each range of `scale`. Returns whether the copy holds no NaN or Inf, as `finite_flat` tests
    it (True when not `check`)."""
    sums = []
    total = target.numel()
    with torch.no_grad():
        for lo in range(0, total, PIECE):
            hi = min(lo + PIECE, total)
            target[lo:hi].copy_(source[lo:hi])
            for start, end, factor in scale:
                if start < hi and end > lo:
                    target[max(start, lo):min(end, hi)].mul_(factor)
            if check:
                sums.append(value_sum(target[lo:hi]))
    return not sums or bool(torch.isfinite(torch.stack(sums).sum()))
