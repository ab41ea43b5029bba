"""The plain sections of the run's config: model, adapter, lora, sampling, learner, buffer, run.

Each is a flat pydantic model with bounds and a one-line description per field; the shared
base forbids unknown keys. Backends (generator, sync) and tasks live in their own modules.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from ..staleness import StalenessWindow

ADAPTER_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]{0,63}$")
CPU_LIST_RE = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


class Section(BaseModel):
    """Base of every config table: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def check_cpus(value: str | None) -> str | None:
    if value is None or value == "auto":
        return value
    if not CPU_LIST_RE.match(value):
        raise ValueError("must be a core list like '0', '0-3' or '0,2', or 'auto'")
    return value


def check_device(value: str) -> str:
    if value not in ("auto", "cpu") and not re.fullmatch(r"cuda(:\d+)?", value):
        raise ValueError("must be 'auto', 'cpu' or 'cuda:N'")
    return value


Device = Annotated[str, AfterValidator(check_device)]  # 'auto', 'cpu' or 'cuda:N'
Cpus = Annotated[Union[str, None], AfterValidator(check_cpus)]  # 'auto', a core list, or None (all)


class ModelConfig(Section):
    name: str = Field("smollm2-135m", description="Embedded model name, local HF directory, or hub id.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Dtype vLLM serves the base in; 'auto': bfloat16 where the device computes it "
                            "natively (GPUs, CPUs with AVX512-BF16/AMX), else float32."
    )
    quantization: Literal["none", "nf4", "int8"] = Field(
        "none", description="How the learner holds the frozen base: 'none' (at learner.dtype), 'nf4' (4-bit "
                            "QLoRA) or 'int8', both with bitsandbytes. The generator serves these weights dequantised "
                            "(generator.base).",
    )


class AdapterConfig(Section):
    name: str = Field("main", description="Adapter name: a plain identifier.")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not ADAPTER_NAME_RE.match(value):
            raise ValueError("must be a plain identifier (letters, digits, _ and -, max 64)")
        return value


class LoraConfig(Section):
    rank: int = Field(8, ge=1, le=512, description="LoRA rank r.")
    alpha: float = Field(16.0, gt=0, le=4096, description="LoRA alpha; the update is scaled by alpha / r.")
    target_modules: Union[Literal["all-linear"], list[str]] = Field(
        "all-linear", description="Modules to adapt: 'all-linear' or a list of module names."
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout probability.")

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("must name at least one module (or be 'all-linear')")
        return value


class SamplingConfig(Section):
    """How rollouts are sampled; a fleet entry's `sampling` overrides only the fields it sets."""

    max_new_tokens: int = Field(32, ge=1, le=32768, description="Completion length limit.")
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold.")
    samples_per_prompt: int = Field(8, ge=2, le=256, description="Completions per prompt (the GRPO group).")


class LearnerConfig(Section):
    lr: float = Field(2e-4, gt=0.0, le=1.0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="AdamW weight decay.")
    groups_per_step: int = Field(8, ge=1, le=4096, description="Prompt groups per optimizer step.")
    token_budget: int = Field(
        4096, ge=16, le=10_000_000, description="Max (padded) tokens per micro-batch."
    )
    micro_batches_per_step: int = Field(
        16, ge=1, le=4096,
        description="Max micro-batches per step; groups that do not fit wait for the next step.",
    )
    grad_clip: float = Field(1.0, gt=0.0, le=1e6, description="Max global gradient norm.")
    skip_flat_groups: bool = Field(
        True, description="Fill a step with informative groups only (rewards not all equal); false: train on "
                          "the next groups_per_step groups as they come, flat ones included.",
    )
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="Compute dtype of the learner's frozen base; 'auto' as model.dtype decides."
    )
    lr_scale: Literal["none", "ess"] = Field(
        "none", description="'ess': each step's learning rate times sqrt(ESS fraction of its sequence ratios), "
                            "so a step on stale samples moves less (VCPO); 'none': the learning rate as it is.",
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward.")
    logprob_chunk: int = Field(
        1024, ge=16, le=1_000_000, description="Positions per chunk of the log-softmax over the vocab."
    )
    device: Device = Field("auto", description="'auto', 'cpu' or 'cuda:N'.")
    cpus: Cpus = Field("auto", description="CPU cores for the learner on CPU ('auto', '1', '2-3'); None = all.")
    devices: list[Device] | None = Field(
        None, description="A data-parallel learner: one rank per entry, e.g. ['cuda:1', 'cuda:2'] (overrides "
                          "learner.device); ['cpu', 'cpu'] splits learner.cpus between CPU ranks (gloo).",
    )

    @field_validator("devices")
    @classmethod
    def _devices(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return value
        if not value:
            raise ValueError("must name at least one device (or be left out)")
        if "auto" in value:
            raise ValueError("entries must be 'cpu' or 'cuda:N', not 'auto'")
        kinds = {"cpu" if d == "cpu" else "cuda" for d in value}
        if len(kinds) > 1:
            raise ValueError("mixes CPU and CUDA ranks; use one kind")
        gpus = [d for d in value if d != "cpu"]
        if len(set(gpus)) != len(gpus):
            raise ValueError("names a GPU twice; give each rank its own device")
        return value


class BufferConfig(Section):
    mode: Literal["auto", "async", "sync"] = Field(
        "auto", description="'auto': it calibrates the engine and the learner, opens async, and keeps it where its "
                            "first 2 steps beat the sync step they imply; otherwise 2 sync steps measure and "
                            "it predicts each staleness's time to target; then it keeps checking (lora_async/mode/); "
                            "'async' or 'sync' pins it.",
    )
    max_tokens: int = Field(
        262_144, ge=64, le=1_000_000_000, description="Token bound of the rollout buffer."
    )
    max_staleness: int = Field(
        4, ge=0, le=64,
        description="Max versions a sample may lag the learner in async training (auto chooses among 0, 1, 2, 4 "
                    "up to this; 0 = synchronous training whatever the mode).",
    )
    lag_costs: str | None = Field(
        None, description="Auto: a `lora-async bench staleness` report whose steps-to-target by lag weigh each "
                          "staleness (None: the built-in table, lora_async/lag_cost.py).",
    )
    stale_policy: Literal["drop", "is-correct"] = Field(
        "drop", description="What happens to a group with a sample that finished on a version older than max_staleness "
                        "allows (its older tokens, from partial rollouts, are importance-corrected either way)."
    )
    partial_rollouts: bool = Field(
        True, description="Async runs: a turn or completion a learner step makes too stale is stopped and continued "
                          "on the newest version, its tokens keeping their version (false: aborted, group dropped).",
    )
    fixed_lag: int | None = Field(
        None, ge=1, le=64,
        description="Benchmarks (`lora-async bench staleness`): the generator is held this many versions behind the "
                    "learner and starts groups only while it waits, so every sample trains at exactly this lag "
                    "(the first ones at less); needs mode = 'async', max_staleness equal to it, no partial rollouts.",
    )

    @property
    def window(self) -> StalenessWindow:
        """The widest staleness window the run may train with (`lora_async.staleness`): what the
        engine's LoRA slots are sized for. A sync run's is 0; an auto run starts at 0 and may
        widen to this once it has measured (`Run.window` is the one in force)."""
        return StalenessWindow.widest(self.mode, self.max_staleness)

    @property
    def synchronous(self) -> bool:
        """The run is synchronous whatever it measures: its widest window is 0."""
        return self.window.synchronous

    @property
    def concurrent_from_start(self) -> bool:
        """Generation and training overlap from the first step (pinned async): `auto` placement
        then splits shared cores at once; an auto run starts sharing them, and so does a run at a
        fixed lag (its halves take turns)."""
        return self.mode == "async" and not self.synchronous and self.fixed_lag is None


Tracker = Literal["tensorboard", "wandb", "trackio", "mlflow", "none"]
_DEFAULT_TRACKERS: list[Tracker] = ["tensorboard"]


class RunConfig(Section):
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed for task sampling, init and vLLM.")
    max_steps: int = Field(100, ge=1, le=10_000_000, description="Optimizer steps to run.")
    time_budget_s: float | None = Field(
        None, gt=0, description="Stop after this many seconds of training (None = no limit)."
    )
    output_dir: str = Field("runs/default", description="Where metrics, adapters and checkpoints go.")
    checkpoint_every: int = Field(0, ge=0, description="Checkpoint every N steps (0 = only at the end).")
    eval_every: int = Field(0, ge=0, description="Held-out greedy eval every N steps (0 = off).")
    save_every: int = Field(
        0, ge=0, description="Save the adapter to OUT/adapters/NAME/vK every N steps and at the start, stamped with "
                             "the step and training clock, without a checkpoint (0 = off); for scoring afterwards.",
    )
    eval_max_tokens: int | None = Field(
        None, ge=1, le=32768, description="Completion limit for held-out eval (None = sampling.max_new_tokens)."
    )
    eval_at_start: bool = Field(False, description="Evaluate the base model before training.")
    eval_at_end: bool = Field(False, description="Evaluate the final adapter after training.")
    canary_every: int = Field(10, ge=0, description="Generator/learner logprob probe every N syncs (0 = off).")
    chart_every: int = Field(5, ge=0, description="Redraw OUT/chart.png every N steps (0 = off).")
    progress: bool = Field(True, description="Show the rich progress display.")
    log_interval_s: float = Field(
        10.0, ge=0, le=86400,
        description="When stderr is not a terminal: print a one-line step summary at most this often "
                    "(0 = every step).",
    )
    engine_log: bool = Field(False, description="Let vLLM log at INFO level.")
    report_to: list[Tracker] = Field(
        default_factory=lambda: _DEFAULT_TRACKERS.copy(), min_length=1,
        description="Experiment trackers every step row, eval, mode event and the summary go to, beside "
                    "OUT/metrics.jsonl: tensorboard (OUT/tb), wandb, trackio, mlflow (each an extra: "
                    "pip install 'lora-async[wandb]'), or [\"none\"].",
    )
    tracker_project: str = Field(
        "lora-async", min_length=1, max_length=128,
        description="The wandb and trackio project, and the MLflow experiment, runs are reported under.",
    )

    @field_validator("report_to")
    @classmethod
    def _one_each(cls, value: list[Tracker]) -> list[Tracker]:
        if len(set(value)) != len(value):
            raise ValueError("names a tracker twice")
        if "none" in value and len(value) > 1:
            raise ValueError('"none" cannot be listed with a tracker')
        return value
