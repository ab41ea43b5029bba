"""Where the learner and the generator run: a `cuda:N` device, or a set of CPU cores.

On CPU both live in one process, each on its own thread. Linux applies `sched_setaffinity(0)`
to the calling thread, and OpenMP worker threads inherit the affinity of the thread that
starts them, so pinning each thread before its first torch op gives each part its own cores.
torch's intra-op thread count is per OpenMP master thread, so each part also sets its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


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


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # torch without CUDA support
        return False


def resolve(
    generator_device: str | None,
    generator_cpus: str | None,
    learner_device: str,
    learner_cpus: str | None,
    concurrent: bool,
) -> tuple[Placement, Placement]:
    """Turn config strings into placements.

    `auto` devices pick CUDA when present (generator on cuda:0, learner on cuda:1 if there
    are two GPUs). `generator_device=None`: no local generator (remote servers); the learner
    then takes cuda:0, and the returned generator placement is only a placeholder. `auto` core sets on CPU split the cores in two when generation and training
    run concurrently (`max_staleness > 0`), since each scales sub-linearly with cores; with
    synchronous training the two take turns, so both get every core.
    """
    have_cuda = cuda_available()
    local_generator = generator_device is not None
    if generator_device is None:
        generator_device = "cpu"
    elif generator_device == "auto":
        generator_device = "cuda:0" if have_cuda else "cpu"
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
            raise ValueError(f"cores {format_cpus(missing)} are not available (have {format_cpus(set(cores))})")
        return Placement("cpu", wanted)

    # The generator gets the first half: vLLM's decode loop also needs a core for its
    # Python-side scheduling, so on odd counts it gets the extra one.
    gen = pick(generator_device, generator_cpus, cores[: len(cores) - half])
    learn = pick(learner_device, learner_cpus, cores[len(cores) - half :])
    return gen, learn


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
