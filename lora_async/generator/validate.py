"""Checks an adapter version against the base model before anything reaches the engine.

vLLM would reject some of these deep inside a worker (or, worse, accept a wrong shape and
fail mid-batch); here each is one clear error and the engine keeps serving what it has.
"""

from __future__ import annotations

import contextlib
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ..adapter_version import AdapterVersion
from ..config import ADAPTER_NAME_RE
from .registry import VersionRegistry
from .types import GeneratorStats

PEFT_KEY_RE = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?P<ab>lora_A|lora_B)\.weight$")


class AdapterError(ValueError):
    """An adapter version that cannot be served."""


@dataclass(frozen=True)
class BaseShapes:
    """(in_features, out_features) of every linear module of the base model, by dotted path."""

    linear: dict[str, tuple[int, int]]

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "BaseShapes":
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return cls.from_module(model)

    @classmethod
    def from_module(cls, model: torch.nn.Module) -> "BaseShapes":
        linear = {
            name: (module.in_features, module.out_features)
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")
        }
        return cls(linear)

    def suffixes(self) -> set[str]:
        return {name.rsplit(".", 1)[-1] for name in self.linear}


def adapter_signature(version: AdapterVersion) -> tuple:
    """Everything the structural checks look at: the adapter's name and its structure (names,
    shapes, dtypes, peft config: `AdapterVersion.structure`)."""
    return (version.adapter, version.structure)


class StructureCheck:
    """`validate_adapter`'s structural checks, run once per adapter structure (names, shapes,
    dtypes, peft config): successive versions of an adapter share one, so a publish pays only
    for the value check."""

    def __init__(self, shapes: BaseShapes, max_rank: int) -> None:
        self.shapes, self.max_rank = shapes, max_rank
        self._seen: set[tuple] = set()

    def __call__(self, version: AdapterVersion) -> None:
        signature = adapter_signature(version)
        if signature not in self._seen:
            validate_adapter(version, self.shapes, self.max_rank, check_values=False)
            self._seen.add(signature)


class VersionCheck:
    """Everything a version must pass before a transport moves it: a name and a structure the
    base model and the engine accept (checked once per structure), finite values, and a version
    newer than the live ones. Every generator runs this in `validate`; a refusal is counted.

    `values=False` leaves the finite check to the transport, which then runs it on the one
    contiguous copy it makes anyway (`finite_flat`: one reduction instead of one per tensor);
    the in-process hot-swap does, in the worker."""

    def __init__(self, shapes: BaseShapes, max_rank: int, registry: VersionRegistry, stats: GeneratorStats,
                 lock: threading.Lock | threading.RLock | None = None) -> None:
        self.structure = StructureCheck(shapes, max_rank)
        self.registry, self.stats = registry, stats
        self._lock = lock or contextlib.nullcontext()

    def __call__(self, version: AdapterVersion, values: bool = True) -> None:
        try:
            self.structure(version)
            with self._lock:
                self.registry.check_new(version.adapter, version.version)
            if values:
                check_finite_all(version.served_name, list(version.tensors.values()))
        except Exception:
            self.stats.version_rejected()
            raise


def check_finite_all(name: str, tensors: list[torch.Tensor]) -> None:
    """The same over many tensors: a sum propagates NaN, +Inf and -Inf (and +Inf + -Inf is NaN).

    Per-tensor sums cost ~1 ms for the 420 tensors of an r=8 all-linear adapter on the 135M
    model; `_foreach_norm(inf)` cost 7.5 ms (bench/RESULTS.md). A sum that overflows flags an
    adapter of absurd magnitude, which is rejected too."""
    if tensors and not bool(torch.isfinite(torch.stack([t.sum(dtype=torch.float32) for t in tensors])).all()):
        raise AdapterError(f"{name}: tensors contain NaN or Inf")


def finite_flat(flat: torch.Tensor) -> bool:
    """Whether one contiguous buffer of a version's values holds no NaN or Inf: one sum (NaN and
    Inf propagate; a sum that overflows is an adapter of absurd magnitude, refused too). The sum
    stays in bfloat16/float32 (it accumulates in float32 inside: ~0.1 ms for the 1.2M values of
    an r=8 all-linear adapter on the 135M model; a float32 result from bfloat16 costs 4x that);
    float16 sums in float32, as its range would overflow on legitimate adapters."""
    return bool(torch.isfinite(value_sum(flat)))


def value_sum(values: torch.Tensor) -> torch.Tensor:
    """`finite_flat`'s sum, in which NaN and Inf propagate."""
    return values.sum(dtype=torch.float32) if values.dtype == torch.float16 else values.sum()


def validate_adapter(version: AdapterVersion, shapes: BaseShapes, max_rank: int,
                     check_values: bool = True) -> None:
    """Raise AdapterError naming the first problem; return None when the version is servable.

    `check_values=False` skips the NaN/Inf scan (for callers that scan a packed buffer at once).
    """
    name = version.served_name
    if not ADAPTER_NAME_RE.match(version.adapter):
        raise AdapterError(
            f"adapter name {version.adapter!r} is not a plain identifier "
            "(letters, digits, _ and -, starting with a letter or _)"
        )
    if version.version < 0:
        raise AdapterError(f"{name}: version must be >= 0")
    cfg = version.peft_config
    rank = int(cfg.get("r", 0))
    if rank < 1:
        raise AdapterError(f"{name}: peft config has no rank r >= 1")
    ranks = [rank, *(cfg.get("rank_pattern") or {}).values()]
    if max(ranks) > max_rank:
        raise AdapterError(f"{name}: rank {max(ranks)} is above the engine's max_lora_rank {max_rank}")
    if cfg.get("use_dora"):
        raise AdapterError(f"{name}: DoRA adapters are not supported by vLLM")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        raise AdapterError(f"{name}: adapters with bias are not supported by vLLM")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"{name}: modules_to_save ({cfg['modules_to_save']}) is not supported by vLLM")
    targets = cfg.get("target_modules")
    if isinstance(targets, (list, tuple)):
        unknown = sorted(set(targets) - shapes.suffixes() - set(shapes.linear))
        if unknown:
            raise AdapterError(
                f"{name}: target modules {unknown} do not exist in the base model "
                f"(it has {sorted(shapes.suffixes())})"
            )
    if not version.tensors:
        raise AdapterError(f"{name}: no tensors")
    seen: dict[str, set[str]] = {}
    for key, tensor in version.tensors.items():
        match = PEFT_KEY_RE.match(key)
        if match is None:
            raise AdapterError(f"{name}: tensor {key!r} is not a peft LoRA weight name")
        module, ab = match["module"], match["ab"]
        if module not in shapes.linear:
            raise AdapterError(f"{name}: tensor {key!r} targets {module!r}, not a linear module of the base")
        if not tensor.is_floating_point():
            raise AdapterError(f"{name}: tensor {key!r} has dtype {tensor.dtype}, expected floating point")
        in_f, out_f = shapes.linear[module]
        r = tensor.shape[0] if ab == "lora_A" else tensor.shape[-1]
        expected = (r, in_f) if ab == "lora_A" else (out_f, r)
        if tensor.dim() != 2 or tuple(tensor.shape) != expected or r > max_rank:
            raise AdapterError(
                f"{name}: tensor {key!r} has shape {tuple(tensor.shape)}, expected {expected} "
                f"(rank <= {max_rank})"
            )
        if check_values and not bool(torch.isfinite(tensor).all()):
            raise AdapterError(f"{name}: tensor {key!r} contains NaN or Inf")
        seen.setdefault(module, set()).add(ab)
    lonely = sorted(m for m, parts in seen.items() if parts != {"lora_A", "lora_B"})
    if lonely:
        raise AdapterError(f"{name}: modules {lonely[:3]} lack a lora_A/lora_B pair")
