"""The hand-off of an adapter version across a process boundary, as both sides see it.

`packed` is the wire format every cross-process transport moves: one flat uint8 buffer
(tensors cast to the serving dtype, laid end to end, 64-byte aligned) described by a
`PackMeta` (names, dtypes, shapes, offsets, peft config, checksum), with the checks a receiver
runs on it (`PackError`). `receive` holds the receiving halves: out of shared memory, a Ray
object, a CUDA IPC handle or a broadcast, each ending with tensors the receiver owns.

Why a package of its own, below both `sync/` (the senders) and `generator/` (vLLM's worker and
the Ray replicas receive): the format is the one thing the two sides share, so it imports
neither of them (torch, `dtypes`, `process_groups` and `adapter_version` only) and neither
imports the other through it. What a version is and the name it is served under
(`adapter_version.served_name`) sit one level lower still, shared with the learner.
"""

from .packed import PackedAdapter, PackError, PackMeta, TensorMeta

__all__ = ["PackError", "PackMeta", "PackedAdapter", "TensorMeta"]
