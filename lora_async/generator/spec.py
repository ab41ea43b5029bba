"""`EngineSpec`: what an in-process vLLM engine needs to start, derived from a run's config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..staleness import StalenessWindow

if TYPE_CHECKING:
    from ..config import TrainConfig

DEFAULT_MAX_NUM_SEQS = 256  # vLLM's own default: sequences decoded in one batch


@dataclass(frozen=True)
class EngineSpec:
    """What the engine needs to start. `from_config` is the one way a run builds it."""

    model_dir: Path
    adapters: tuple[str, ...]
    window: StalenessWindow  # the versions of each adapter the engine keeps live
    max_lora_rank: int
    dtype: str = "bfloat16"
    memory_fraction: float = 0.2
    kv_cache_gb: float | None = None
    max_model_len: int = 1024
    seed: int = 0
    fast_cpu_lora: bool = True
    engine_log: bool = False
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    separate_process: bool = False  # the engine core (and its worker) in a child process
    block_size: int | None = None  # KV-cache block (tokens); None = vLLM's default for the device
    max_batched_tokens: int | None = None  # tokens per engine step; None = vLLM's default
    quantization: str = "none"  # "bitsandbytes": vLLM quantises the base as it loads it
    kept: int = 0  # frozen versions kept registered beyond the window (a game's league, pinned opponents)

    @classmethod
    def from_config(cls, config: "TrainConfig", model_dir: Path, device: str, *,
                    adapters: tuple[str, ...] | None = None, window: StalenessWindow | None = None,
                    max_lora_rank: int | None = None, separate_process: bool | None = None,
                    kept: int = 0) -> "EngineSpec":
        """The engine a run's `[generator]` (type "vllm", or each "ray" replica's) describes on
        `device`; evaluation engines override the adapters, the staleness window, the rank and
        the process. `kept`: the frozen versions the run's games keep (`envs.games.kept_versions`)."""
        from ..dtypes import resolve_dtype

        gen = config.engine_settings
        if gen is None:
            raise ValueError(f"generator.type = {config.generator.type!r} runs no vLLM engine of this run's own")
        return cls(
            model_dir=Path(model_dir),
            adapters=tuple(config.adapter_names) if adapters is None else adapters,
            window=config.buffer.window if window is None else window,
            max_lora_rank=config.max_lora_rank if max_lora_rank is None else max_lora_rank,
            dtype=resolve_dtype(config.model.dtype, device), memory_fraction=gen.memory_fraction,
            kv_cache_gb=gen.kv_cache_gb,
            max_model_len=gen.max_model_len, seed=config.run.seed, fast_cpu_lora=gen.fast_cpu_lora,
            engine_log=config.run.engine_log,
            separate_process=gen.engine_home == "separate" if separate_process is None else separate_process,
            block_size=gen.block_size, max_batched_tokens=gen.max_batched_tokens, quantization=gen.quantization,
            kept=kept,
        )

    @property
    def max_loras(self) -> int:
        """Adapters in one batch (`StalenessWindow.engine_slots`), and every kept frozen version:
        a league's games put all of them in one batch."""
        return self.window.engine_slots(len(self.adapters))[0] + self.kept

    @property
    def max_cpu_loras(self) -> int:
        """Registered versions (`StalenessWindow.engine_slots`), and every kept frozen version."""
        return self.window.engine_slots(len(self.adapters))[1] + self.kept
