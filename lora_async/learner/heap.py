"""Giving the C heap back after a CPU training step.

glibc's malloc keeps the blocks a CPU forward and backward free: after the first frees its mmap
threshold rises to 32 MiB, so the per-layer activations land in the heap and stay there when
freed. One step's own retention is counted in the memory plan (`plan/estimate.py`,
CPU_RETENTION). Across steps it is not bounded: the learner and the engine allocate from
different threads, hence different arenas, and what one step leaves fragmented the next one
grows past. A staleness arm on the programs task (learner steps beside engine decode, rows of
up to 1,024 tokens) was killed by the kernel at 24 GB of RSS at its 4th step, against a plan of
12.5 GiB. `malloc_trim(0)` after each step returns every arena's free pages to the kernel; it
costs a few milliseconds and leaves the step's own peak as the plan has it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, or None where malloc is another (musl, macOS): nothing to trim there."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def release_freed_memory() -> bool:
    """Return the free pages of every malloc arena to the kernel; whether any were returned."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
