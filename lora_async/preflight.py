"""Checks a run must pass before any model loads. Each failure is one line, and the CLI exits with code 2.

`lora-async train` runs them first, so a setting that cannot work fails in seconds. Without
them it would fail after a multi-minute model load with a traceback. None of them import vLLM
or load weights. The quantisation probe touches bitsandbytes with one small tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import TrainConfig


class PreflightError(Exception):
    """A run that cannot start as configured (one line, exit code 2)."""


def learner_device(config: "TrainConfig") -> str:
    """The device the learner's (first) rank will use, as placement would resolve it."""
    from .placement import cuda_available

    devices = config.learner.devices or [config.learner.device]
    device = devices[0]
    if device == "auto":
        return "cuda:0" if cuda_available() else "cpu"
    return "cuda:0" if device == "cuda" else device


def generator_device(config: "TrainConfig") -> str | None:
    """The device of the run's own engine ("auto" resolved), None for remote servers."""
    from .placement import cuda_available

    if config.generator.engine_home == "server":
        return None
    device = config.generator.device
    if device == "auto":
        return "cuda:0" if cuda_available() else "cpu"
    return device


def check_learner_quantization(config: "TrainConfig") -> None:
    from .learner.base import QuantizationError, check_quantization

    try:
        check_quantization(config.model.quantization, learner_device(config))
    except QuantizationError as exc:
        raise PreflightError(str(exc)) from None


def check_vllm(config: "TrainConfig") -> None:
    """The installed vLLM is the release the extension was checked against, and it can serve
    `generator.quantization` on the generator's device."""
    from .generator.vllm.compat import VllmCompatError, check_serving_quantization, check_vllm_version

    device = generator_device(config)
    if device is None:
        return
    try:
        check_vllm_version()
        quantization = getattr(config.generator, "quantization", "none")
        if quantization != "none" and not device.startswith("cuda"):
            raise VllmCompatError(f"generator.quantization = {quantization!r} needs the generator on a CUDA GPU "
                                  f"(it is on {device}); leave it 'none'")
        check_serving_quantization(quantization, device)
    except VllmCompatError as exc:
        raise PreflightError(str(exc)) from None


def preflight(config: "TrainConfig") -> None:
    """Every check that needs no model: raises PreflightError on the first that fails."""
    check_vllm(config)
    check_learner_quantization(config)
