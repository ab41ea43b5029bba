"""The machine a plan is made for (this one, or a hypothetical one with N GPUs of G GiB), where
the run's parts would go on it, and the dtypes they would use there.

Nothing here imports torch unless this machine has an NVIDIA/AMD driver: asking CUDA for its
devices is the only reason to. `layout` mirrors `placement.resolve` for `auto` devices, with the
GPU count as an argument, so a plan for two GPUs can be made on a machine with none.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..placement import cpu_native_bf16
from .shapes import PlanUnavailable

if TYPE_CHECKING:
    from ..config import TrainConfig

GIB = 1 << 30
# A GPU driver's marks: without them torch would find no GPU, so it is not imported to ask.
GPU_DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/kfd")


@dataclass(frozen=True)
class Machine:
    """Device memory in bytes: one entry per GPU, and the system RAM (the `cpu` device)."""

    gpus: tuple[int, ...]
    ram: int
    hypothetical: bool = False

    @classmethod
    def this(cls) -> "Machine":
        import psutil

        return cls(tuple(_gpu_memory()), psutil.virtual_memory().total)

    @classmethod
    def with_gpus(cls, count: int, gib: float) -> "Machine":
        """This machine's RAM with `count` GPUs of `gib` GiB each (they need not exist)."""
        import psutil

        return cls((int(gib * GIB),) * count, psutil.virtual_memory().total, hypothetical=True)

    def capacity(self, device: str) -> int | None:
        """Bytes on `device` ('cpu' or 'cuda:N'); None when this machine has no such device."""
        if device == "cpu":
            return self.ram
        index = int(device.split(":")[1]) if ":" in device else 0
        return self.gpus[index] if index < len(self.gpus) else None

    def describe(self) -> str:
        gpus = f"{len(self.gpus)} GPU{'s' if len(self.gpus) != 1 else ''}" + (
            f" x {self.gpus[0] / GIB:.0f} GiB" if self.gpus else "")
        kind = "hypothetical: " if self.hypothetical else ""
        return f"{kind}{gpus}, {self.ram / GIB:.1f} GiB RAM"


def _gpu_memory() -> list[int]:
    if not any(os.path.exists(path) for path in GPU_DRIVER_FILES):
        return []
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        return [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
    except Exception:  # a torch build without CUDA, a broken driver: plan for the CPU
        return []


@dataclass(frozen=True)
class Layout:
    """Where each part runs: the generator (None: remote servers or Ray replicas) and each learner rank."""

    generator: str | None
    learners: tuple[str, ...]
    engine_separate: bool  # the engine core in a process of its own


def _cuda(device: str) -> str:
    return "cuda:0" if device == "cuda" else device


def layout(config: "TrainConfig", gpus: int) -> Layout:
    """`placement.resolve`'s choice of devices on a machine with `gpus` GPUs: an `auto` learner
    takes cuda:1 when there are two GPUs and a local generator, else cuda:0; an `auto` generator
    takes the first GPU no learner rank lists; without GPUs both are on the CPU."""
    gen = config.local_engine
    ranks = [_cuda(d) for d in config.learner.devices] if config.learner.devices else None
    learner = _cuda(config.learner.device)
    if learner == "auto" and not ranks:
        learner = ("cuda:1" if gen is not None and gpus > 1 else "cuda:0") if gpus else "cpu"
    learners = tuple(ranks or [learner])
    generator = None
    if gen is not None:
        generator = _cuda(gen.device)
        if generator == "auto":
            free = [f"cuda:{i}" for i in range(gpus) if f"cuda:{i}" not in (ranks or [])]
            if gpus and not free:
                raise PlanUnavailable(f"learner.devices takes every GPU ({gpus}); set generator.device to the one "
                                      "the generator should share, or list fewer learner.devices")
            generator = free[0] if gpus else "cpu"
    return Layout(generator, learners, gen is not None and gen.engine_home == "separate")


def planned_dtype(name: str, device: str, machine: Machine) -> str:
    """A config dtype made concrete as the run would: 'auto' is bfloat16 where the device computes
    it natively. Hypothetical GPUs are taken to be bf16-capable (Ampere or newer)."""
    if name != "auto":
        return name
    if device == "cpu":
        return "bfloat16" if cpu_native_bf16() else "float32"
    if machine.hypothetical:
        return "bfloat16"
    from ..dtypes import resolve_dtype  # torch is loaded already for this GPU

    return resolve_dtype(name, device)


BYTES_BY_DTYPE_NAME = {"float32": 4, "bfloat16": 2, "float16": 2}  # by name: the plan loads no torch (dtypes.ITEMSIZE)
