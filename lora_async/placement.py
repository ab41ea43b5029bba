"""Where the learner and the generator run: a `cuda:N` device, or a set of CPU cores.

On CPU both live in one process, each on its own thread. Linux applies `sched_setaffinity(0)`
to the calling thread, and OpenMP worker threads inherit the affinity of the thread that
starts them, so pinning each thread before its first torch op gives each part its own cores.
torch's intra-op thread count is per OpenMP master thread, so each part also sets its own.

A data-parallel learner (`learner.devices`) has one placement per rank: a GPU each, or an even
share of the learner's cores each (ranks 1.. are processes of their own, pinned the same way).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import UserError

if TYPE_CHECKING:
    from .config import TrainConfig


class PlacementError(UserError, ValueError):
    """A placement this machine cannot give (a missing GPU, too few cores); the message names the field."""


@dataclass(frozen=True)
class Placement:
    device: str  # "cpu" or "cuda:N"
    cpus: frozenset[int] | None  # None: no pinning (all cores the process may use)

    @property
    def threads(self) -> int:
        return len(self.cpus) if self.cpus else len(available_cpus())

    def describe(self) -> str:
        if self.device != "cpu":
            return self.device
        if not self.cpus:
            return f"cpu (all {self.threads} cores)"
        return f"cpu cores {format_cpus(self.cpus)}"


def available_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def parse_cpus(text: str) -> frozenset[int]:
    cores: set[int] = set()
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-")
            cores.update(range(int(lo), int(hi) + 1))
        else:
            cores.add(int(part))
    return frozenset(cores)


def format_cpus(cpus: frozenset[int] | set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def cpu_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX), from /proc/cpuinfo
    without importing torch (the memory plan asks before anything heavy loads)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # torch without CUDA support
        return False


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if cuda_available() else 0


def check_devices(devices: list[str] | None, field: str = "learner.devices") -> None:
    """Every `cuda:N` of `devices` (the config's `field`) exists here: checked before any model
    loads, so a wrong device fails in seconds with one line instead of deep inside a rank's start."""
    wanted = [d for d in devices or () if d.startswith("cuda")]
    if not wanted:
        return
    count = gpu_count()
    if count == 0:
        raise PlacementError(f"{field}: {', '.join(wanted)} named, but this machine has no CUDA "
                             "device; use 'cpu' or 'auto'")
    missing = [d for d in wanted if (int(d.split(":")[1]) if ":" in d else 0) >= count]
    if missing:
        have = "cuda:0 only" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise PlacementError(f"{field}: {', '.join(missing)} does not exist (this machine has {have})")


def free_gpu(taken: list[str]) -> str:
    """The first GPU the learner's ranks do not use: where an `auto` generator goes."""
    count = gpu_count()
    for index in range(count):
        if f"cuda:{index}" not in taken:
            return f"cuda:{index}"
    raise PlacementError(f"learner.devices takes every GPU ({count}); set generator.device to the one "
                         "the generator should share, or list fewer learner.devices")


def rank_placements(devices: list[str] | None, learner: Placement) -> list[Placement]:
    """One placement per data-parallel rank: a GPU each, or an even share of the learner's cores
    (`learner` is what `resolve` gave the learner; rank 0 is always first)."""
    if devices is None or len(devices) < 2:
        return [learner]
    if devices[0] != "cpu":
        return [Placement(device, None) for device in devices]
    cores = sorted(learner.cpus) if learner.cpus else available_cpus()
    n = len(devices)
    if len(cores) < n:
        raise PlacementError(f"learner.devices: {n} CPU ranks need a core each, but the learner has "
                             f"{len(cores)} (cores {format_cpus(set(cores))}); give learner.cpus at least {n} cores")
    return [Placement("cpu", frozenset(cores[i * len(cores) // n:(i + 1) * len(cores) // n])) for i in range(n)]


def resolve(
    generator_device: str | None,
    generator_cpus: str | None,
    learner_device: str,
    learner_cpus: str | None,
    concurrent: bool,
    learner_devices: list[str] | None = None,
) -> tuple[Placement, Placement]:
    """Turn config strings into placements (the learner's: rank 0's device, before `rank_placements`).

    `auto` devices pick CUDA when present (generator on cuda:0, learner on cuda:1 if there
    are two GPUs; with `learner_devices`, the learner takes those and the generator the first
    GPU not among them). `generator_device=None`: no local generator (remote servers); the learner
    then takes cuda:0, and the returned generator placement is only a placeholder. `auto` core sets on CPU split the cores in two when generation and training
    run concurrently (`BufferConfig.concurrent_from_start`), since each scales sub-linearly with cores; with
    synchronous training the two take turns, so both get every core.
    """
    have_cuda = cuda_available()
    local_generator = generator_device is not None
    if learner_devices:
        check_devices(learner_devices)
        learner_device = learner_devices[0]
    if generator_device is None:
        generator_device = "cpu"
    elif generator_device == "auto":
        generator_device = free_gpu(learner_devices or []) if have_cuda else "cpu"
    if learner_device == "auto":
        if have_cuda:
            import torch

            learner_device = "cuda:1" if local_generator and torch.cuda.device_count() > 1 else "cuda:0"
        else:
            learner_device = "cpu"
    cores = available_cpus()
    split = concurrent and len(cores) >= 2 and generator_device == learner_device == "cpu"
    half = len(cores) // 2

    def pick(device: str, text: str | None, share: list[int]) -> Placement:
        if device != "cpu":
            return Placement(device, None)
        if text == "auto":
            return Placement("cpu", frozenset(share) if split else None)
        if text is None:
            return Placement("cpu", None)
        wanted = parse_cpus(text)
        missing = wanted - set(cores)
        if missing:
            raise PlacementError(f"cores {format_cpus(missing)} are not available (have {format_cpus(set(cores))})")
        return Placement("cpu", wanted)

    # The generator gets the first half: vLLM's decode loop also needs a core for its
    # Python-side scheduling, so on odd counts it gets the extra one.
    gen = pick(generator_device, generator_cpus, cores[: len(cores) - half])
    learn = pick(learner_device, learner_cpus, cores[len(cores) - half :])
    return gen, learn


def place_run(config: "TrainConfig") -> tuple[Placement, list[Placement]]:
    """The generator's placement and one per learner rank, from the config alone (no model is
    loaded), so `lora-async train` rejects a placement this machine cannot give in seconds.
    `auto` cores are split only for a run pinned async: an auto run starts on shared cores and
    splits them if it turns async (`split_placements`). Raises `PlacementError`."""
    gen, learner = config.local_engine, config.learner
    check_devices([learner.device], "learner.device")
    if gen is not None and gen.device is not None:
        check_devices([gen.device], "generator.device")
    if gen is None:  # servers or Ray replicas: only the learner is placed
        generator, rank0 = resolve(None, None, learner.device, learner.cpus, concurrent=False,
                                   learner_devices=learner.devices)
    else:  # `auto` splits the cores only when generation and training run concurrently
        generator, rank0 = resolve(gen.device, gen.cpus, learner.device, learner.cpus,
                                   concurrent=config.buffer.concurrent_from_start, learner_devices=learner.devices)
        from .config import NcclSync

        sync = config.sync_config
        if isinstance(sync, NcclSync) and sync.backend == "nccl" and generator.device == rank0.device:
            # NCCL refuses two ranks on one device ("Duplicate GPU detected"), seen on an H200
            raise PlacementError(f"sync.transport 'nccl' needs the generator on another GPU than the learner "
                                 f"(both on {rank0.device}); on one GPU use sync.transport = 'cuda-ipc'")
    return generator, rank_placements(learner.devices, rank0)


def pin_current_thread(placement: Placement) -> None:
    """Pin the calling thread (and the OpenMP threads it will start) to the placement's cores."""
    import torch

    if placement.device != "cpu":
        torch.cuda.set_device(torch.device(placement.device))
        return
    if placement.cpus:
        os.sched_setaffinity(0, placement.cpus)
    # vLLM's CPU worker replaces `torch.set_num_threads` with a no-op once it has bound its
    # threads; the C entry point still sets this thread's OpenMP team size.
    torch._C.set_num_threads(placement.threads)


def shares_compute(config: "TrainConfig") -> bool:
    """The generator and the learner compute on the same device (both on this CPU, or one GPU):
    where `buffer.mode = "auto"` measures before it chooses. Remote generators do not share."""
    gen = config.local_engine
    if gen is None:
        return False
    try:
        generator, ranks = place_run(config)
    except PlacementError:
        return True  # the run fails on this placement anyway, with its own message
    return any(rank.device == generator.device for rank in ranks)


def split_placements(config: "TrainConfig") -> tuple[Placement, Placement] | None:
    """(generator, learner) with the shared cores split between them, for an auto run that turns
    async; None where the run cannot re-pin (an engine in its own process, several learner
    ranks, cores set by hand, a GPU) or there is nothing to split (one core)."""
    gen, learner = config.local_engine, config.learner
    if gen is None or gen.engine_home != "same" or (learner.devices and len(learner.devices) > 1):
        return None
    if gen.cpus != "auto" or learner.cpus != "auto" or len(available_cpus()) < 2:
        return None
    generator, rank0 = resolve(gen.device, gen.cpus, learner.device, learner.cpus, concurrent=True)
    if generator.device != "cpu" or rank0.device != "cpu":
        return None
    return generator, rank0
