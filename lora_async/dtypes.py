"""Dtype names as the config and the packed-adapter metadata spell them, and the torch dtypes
they mean: the one table every part uses."""

from __future__ import annotations

import torch

from .placement import cpu_native_bf16

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
ITEMSIZE: dict[torch.dtype, int] = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in DTYPES.values()}


def torch_dtype(name: str) -> torch.dtype:
    """`"bfloat16"` -> `torch.bfloat16`; a clear error for names outside the table."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r} (use one of {', '.join(DTYPES)})") from None


def native_bf16(device: str) -> bool:
    """Whether `device` computes in bfloat16 at full speed.

    CPUs without AVX512-BF16 or AMX emulate it: on a 2-core AVX2 machine a bf16 matmul ran 69x
    slower than fp32, a learner step 15x, vLLM decoding 4.4x (`bench/dtype_check.py`,
    bench/RESULTS.md section 6)."""
    if device.startswith("cuda"):
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return cpu_native_bf16()


def resolve_dtype(name: str, device: str) -> str:
    """A config dtype made concrete: "auto" is bfloat16 where `device` computes it natively,
    float32 elsewhere; any other name is kept."""
    if name != "auto":
        return name
    return "bfloat16" if native_bf16(device) else "float32"
