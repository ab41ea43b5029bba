"""The sender's half of the packed-adapter format (`handoff.packed`): pack a version.

Every cross-process transport moves what `pack` makes: the version's tensors cast to the
serving dtype and copied, end to end, into one flat buffer (a fresh one, or the transport's
reused one: shared memory, a GPU buffer), with its `PackMeta`.
"""

from __future__ import annotations

import torch

from ..adapter_version import AdapterVersion
from ..handoff.packed import (PackedAdapter, PackError, PackMeta, TensorMeta, checksum, layout, packed_nbytes,
                              tensor_views)


def pack(version: AdapterVersion, dtype: torch.dtype | None = None, with_checksum: bool = False,
         out: torch.Tensor | None = None, metas: list[TensorMeta] | None = None) -> PackedAdapter:
    """Cast and copy every tensor into one fresh buffer (or into `out`, e.g. shared memory).

    `dtype` None keeps each tensor's own. `metas` is a layout from an earlier `layout()` call
    for the same names and shapes.
    """
    if metas is None:
        metas = layout(version.tensors, dtype)
    nbytes = packed_nbytes(metas)
    buffer = out[:nbytes] if out is not None else torch.empty(nbytes, dtype=torch.uint8)
    if buffer.numel() < nbytes:
        raise PackError(f"output buffer holds {buffer.numel()} bytes, need {nbytes}")
    views = tensor_views(buffer, metas)
    torch._foreach_copy_(views, [t.detach() for t in version.tensors.values()])
    meta = PackMeta(version.adapter, version.version, tuple(metas), dict(version.peft_config),
                    checksum(buffer) if with_checksum else None, nbytes)
    return PackedAdapter(meta, buffer, dict(zip(version.tensors, views)))
