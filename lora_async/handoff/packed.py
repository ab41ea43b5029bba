"""The packed-adapter wire format: one contiguous buffer plus the metadata that describes it.

A packed adapter is a flat uint8 buffer (tensors cast to the serving dtype and laid end to end,
64-byte aligned) and a `PackMeta`: the names/dtypes/shapes/offsets, the peft config, the
buffer's size and an optional blake3 checksum. Unpacking gives zero-copy views after bounds,
size and checksum checks; the receiver makes one owned copy (vLLM scales `lora_B` in place when
it loads an adapter).

`PackMeta` crosses process boundaries as it is where the carrier pickles (Ray), and as plain
data (`to_dict`/`from_dict`) where it does not (vLLM's `collective_rpc` decodes arguments
without custom types). A malformed or inconsistent one is refused with `PackError`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..adapter_version import served_name
from ..dtypes import DTYPES, ITEMSIZE, NAMES

ALIGN = 64  # bytes; keeps every tensor view aligned for vectorised kernels


class PackError(ValueError):
    """A packed adapter that does not unpack: truncated, corrupted or inconsistent. The version
    is refused; the live ones keep serving."""


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class PackMeta:
    """Everything about a packed version but its buffer."""

    adapter: str
    version: int
    tensors: tuple[TensorMeta, ...]
    peft_config: dict[str, Any] = field(default_factory=dict)
    checksum: str | None = None  # blake3 of the buffer (None: not checked)
    nbytes: int = 0  # the buffer's length

    @property
    def served_name(self) -> str:
        """The name the version is served under (`adapter_version.served_name`)."""
        return served_name(self.adapter, self.version)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data, for a carrier that decodes without custom types."""
        return {
            "adapter": self.adapter,
            "version": self.version,
            "tensors": [[t.name, t.dtype, list(t.shape), t.offset, t.nbytes] for t in self.tensors],
            "peft_config": self.peft_config,
            "checksum": self.checksum,
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PackMeta":
        """The inverse of `to_dict`; anything malformed raises PackError."""
        try:
            tensors = tuple(TensorMeta(_text(n), _text(d), tuple(_count(x) for x in s), _count(o), _count(b))
                            for n, d, s, o, b in data["tensors"])
            peft_config, checksum = data.get("peft_config") or {}, data.get("checksum")
            if not isinstance(peft_config, dict) or not (checksum is None or isinstance(checksum, str)):
                raise TypeError("peft_config must be a mapping and checksum a string or None")
            return cls(_text(data["adapter"]), _count(data["version"]), tensors, dict(peft_config), checksum,
                       _count(data["nbytes"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise PackError(f"malformed adapter metadata: {type(exc).__name__}: {exc}") from None


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value


@dataclass
class PackedAdapter:
    meta: PackMeta
    buffer: torch.Tensor  # 1-D uint8
    # Views made while packing (sender side only): a receiver in the same process may use
    # them directly when the buffer is already its own.
    views: dict[str, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())

    @classmethod
    def received(cls, meta: PackMeta, buffer: torch.Tensor) -> "PackedAdapter":
        """What a receiver got for `meta`; a buffer of another length is refused."""
        if int(buffer.numel()) != meta.nbytes:
            raise PackError(f"truncated buffer: {int(buffer.numel())} bytes, expected {meta.nbytes}")
        return cls(meta, buffer)


def checksum(buffer: torch.Tensor) -> str:
    from blake3 import blake3

    return blake3(buffer.numpy().data).hexdigest()


def layout(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> list[TensorMeta]:
    """Where each tensor goes in the packed buffer. Reusable while names and shapes stay."""
    metas: list[TensorMeta] = []
    offset = 0
    for name, tensor in tensors.items():
        target = dtype or tensor.dtype
        nbytes = tensor.numel() * ITEMSIZE[target]
        metas.append(TensorMeta(name, NAMES[target], tuple(tensor.shape), offset, nbytes))
        offset += aligned(nbytes)
    return metas


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def packed_nbytes(metas: list[TensorMeta]) -> int:
    """The length of the buffer a layout packs into (its last tensor's end, aligned)."""
    return aligned(metas[-1].offset + metas[-1].nbytes) if metas else 0


def tensor_views(buffer: torch.Tensor, metas: list[TensorMeta] | tuple[TensorMeta, ...]) -> list[torch.Tensor]:
    """Typed, shaped views of every tensor in the buffer, with few Python-level tensor ops.

    One `split` cuts the buffer into tensors and alignment gaps; a run of tensors that share a
    dtype is split from one typed view of the buffer. (Views one by one cost ~10 us each, which
    is milliseconds for the ~400 tensors of an all-linear adapter.)
    """
    views: list[torch.Tensor] = []
    i = 0
    while i < len(metas):
        j = i
        while j < len(metas) and metas[j].dtype == metas[i].dtype:
            j += 1
        dtype = DTYPES[metas[i].dtype]
        item = ITEMSIZE[dtype]
        start, stop = metas[i].offset, metas[j - 1].offset + metas[j - 1].nbytes
        typed = buffer[start:stop].view(dtype)
        sizes: list[int] = []
        for k in range(i, j):
            sizes.append(metas[k].nbytes // item)
            gap = (metas[k + 1].offset - metas[k].offset - metas[k].nbytes) // item if k + 1 < j else 0
            sizes.append(gap)
        pieces = torch.split(typed, sizes)
        views.extend(piece.view(metas[k].shape) for piece, k in zip(pieces[::2], range(i, j)))
        i = j
    return views


def unpack_views(packed: PackedAdapter) -> dict[str, torch.Tensor]:
    """Zero-copy views into the packed buffer; checks bounds, sizes and (if present) checksum."""
    buffer, meta = packed.buffer, packed.meta
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise PackError("packed buffer must be 1-D uint8")
    if meta.checksum is not None and checksum(buffer) != meta.checksum:
        raise PackError(f"{meta.served_name}: checksum mismatch (corrupted transfer)")
    end = 0
    for tensor in meta.tensors:
        dtype = DTYPES.get(tensor.dtype)
        if dtype is None:
            raise PackError(f"tensor {tensor.name!r}: unsupported dtype {tensor.dtype}")
        if math.prod(tensor.shape) * ITEMSIZE[dtype] != tensor.nbytes:
            raise PackError(f"tensor {tensor.name!r}: shape {tensor.shape} does not match {tensor.nbytes} bytes")
        if tensor.offset < end or tensor.offset + tensor.nbytes > buffer.numel():
            raise PackError(
                f"truncated buffer: tensor {tensor.name!r} needs bytes up to "
                f"{tensor.offset + tensor.nbytes}, buffer has {buffer.numel()}"
                if tensor.offset >= end else f"tensor {tensor.name!r} overlaps the one before it"
            )
        end = tensor.offset + tensor.nbytes
    return dict(zip((t.name for t in meta.tensors), tensor_views(buffer, meta.tensors)))


def unpack_owned(packed: PackedAdapter, copy: bool = True) -> dict[str, torch.Tensor]:
    """Views into one owned copy of the buffer (`copy=False` when the buffer is already ours)."""
    if copy:
        packed = PackedAdapter(packed.meta, packed.buffer.clone())
    return unpack_views(packed)
