"""Dtype names as the config and the packed-adapter metadata spell them, and the torch dtypes
they mean: the one table every part uses."""

from __future__ import annotations

import torch

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
