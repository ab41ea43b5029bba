"""`Recipe`: how a quantised learner holds its base, which the generator's copy of it is built from.

A run with `model.quantization = "nf4"` (or "int8") and `generator.base = "learner"` serves the
learner's own weights, dequantised (`learner.served_base` builds and caches that copy). The
recipe is what names such a copy wherever it is needed: the run's record of the base it served,
`lora-async server --quantization ...` for remote servers, the servers' check that they serve it.

Plain data, below both `learner/` (which builds the copy) and the code that serves or records
it, so none of them imports the learner for it. Kept free of torch imports.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Recipe:
    """How the learner holds its base: what the generator's copy is built from."""

    quantization: str  # "nf4" | "int8"
    dtype: str  # the learner's compute dtype, which the copy is written in
    device: str  # "cpu" | "cuda": where the learner quantises

    def describe(self) -> str:
        return f"the learner's {self.quantization} base, dequantised to {self.dtype}"

    def server_command(self, model: str) -> str:
        """`lora-async server` serving this base, for a run with `generator.type = "server"`."""
        return (f"lora-async server {model} --quantization {self.quantization} --learner-dtype {self.dtype} "
                f"--learner-device {self.device}")
