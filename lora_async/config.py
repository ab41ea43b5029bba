"""The run's configuration: one pydantic tree, loaded from TOML.

Every field has bounds and a one-line description. Unknown keys are errors. Derived values are
properties, never silent rewrites. `load_config` turns any problem into a `ConfigError` whose
message is one line naming the dotted field and the file; the CLI prints it and exits 2.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# vLLM accepts only these `max_lora_rank` values.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ADAPTER_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]{0,63}$")
CPU_LIST_RE = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


class ConfigError(Exception):
    """A configuration problem, phrased as one line for the user."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    name: str = Field("smollm2-135m", description="Embedded model name, local HF directory, or hub id.")
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="Dtype of the frozen base weights (learner and generator)."
    )


class LoraConfig(_Section):
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


def _check_cpus(value: str | None) -> str | None:
    if value is None or value == "auto":
        return value
    if not CPU_LIST_RE.match(value):
        raise ValueError("must be a core list like '0', '0-3' or '0,2', or 'auto'")
    return value


def _check_device(value: str) -> str:
    if value not in ("auto", "cpu") and not re.fullmatch(r"cuda(:\d+)?", value):
        raise ValueError("must be 'auto', 'cpu' or 'cuda:N'")
    return value


class GeneratorConfig(_Section):
    backend: Literal["vllm", "server"] = Field(
        "vllm", description="'vllm': an engine owned by this run; 'server': running `vllm serve` replicas (urls)."
    )
    engine_process: Literal["same", "separate"] = Field(
        "same", description="Run the vLLM engine core in this process or in its own (backend 'vllm')."
    )
    urls: list[str] = Field(
        default_factory=list, description="Base URLs of OpenAI-compatible vLLM servers (backend 'server')."
    )
    api_key: str | None = Field(None, description="Bearer token for the servers (or env LORA_ASYNC_API_KEY).")
    request_timeout_s: float = Field(600.0, gt=0, le=86400, description="HTTP timeout of one generation request.")
    memory_fraction: float = Field(
        0.2, gt=0.0, le=0.95,
        description="vLLM gpu_memory_utilization; on CPU the share of RAM for the KV cache.",
    )
    kv_cache_gb: float | None = Field(
        None, gt=0, le=1024, description="Explicit KV-cache size in GB (overrides memory_fraction)."
    )
    max_new_tokens: int = Field(32, ge=1, le=32768, description="Completion length limit.")
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold.")
    samples_per_prompt: int = Field(8, ge=2, le=256, description="Completions per prompt (the GRPO group).")
    groups_in_flight: int = Field(16, ge=1, le=4096, description="Prompt groups kept generating at once.")
    fast_cpu_lora: bool = Field(
        True, description="Use lora-async's grouped CPU LoRA kernels instead of vLLM's per-token gather."
    )
    max_model_len: int = Field(1024, ge=64, le=1_048_576, description="Prompt + completion token limit.")
    device: str = Field("auto", description="'auto', 'cpu' or 'cuda:N'.")
    cpus: str | None = Field(
        "auto", description="CPU cores for the generator on CPU ('auto', '0', '0-3'); None = all."
    )

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, value: str | None) -> str | None:
        return _check_cpus(value)

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        return _check_device(value)

    @field_validator("urls")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        for url in value:
            if not re.fullmatch(r"https?://[^\s/]+(:\d+)?/?", url):
                raise ValueError(f"{url!r} is not a server base URL like 'http://127.0.0.1:8000'")
        return [url.rstrip("/") for url in value]


class SyncConfig(_Section):
    transport: Literal["auto", "inproc", "shm", "nccl", "cuda-ipc", "http"] = Field(
        "auto", description="How a new adapter version reaches vLLM ('auto' picks from generator.backend)."
    )
    backend: Literal["nccl", "gloo"] = Field("nccl", description="Process-group backend of transport 'nccl'.")
    checksum: bool = Field(True, description="Checksum every transfer that crosses a process boundary.")
    timeout_s: float = Field(60.0, gt=0, le=3600, description="Give up on a receiver that does not answer.")
    retry_budget_s: float = Field(30.0, ge=0, le=3600, description="Total time for retries against a server.")
    dir: str | None = Field(
        None, description="Where transport 'http' writes PEFT directories the servers can read (default OUT/sync)."
    )

    def resolved(self, generator: GeneratorConfig) -> str:
        """The transport that runs: 'auto' resolved against the generator backend."""
        if self.transport != "auto":
            return self.transport
        if generator.backend == "server":
            return "http"
        return "shm" if generator.engine_process == "separate" else "inproc"


class LearnerConfig(_Section):
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
    dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16", description="Compute dtype of the learner's frozen base."
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward.")
    logprob_chunk: int = Field(
        1024, ge=16, le=1_000_000, description="Positions per chunk of the log-softmax over the vocab."
    )
    device: str = Field("auto", description="'auto', 'cpu' or 'cuda:N'.")
    cpus: str | None = Field(
        "auto", description="CPU cores for the learner on CPU ('auto', '1', '2-3'); None = all."
    )

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, value: str | None) -> str | None:
        return _check_cpus(value)

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        return _check_device(value)


class BufferConfig(_Section):
    max_tokens: int = Field(
        262_144, ge=64, le=1_000_000_000, description="Token bound of the rollout buffer."
    )
    max_staleness: int = Field(
        1, ge=0, le=64,
        description="Max versions a sample may lag the learner (0 = synchronous training).",
    )
    stale_policy: Literal["drop", "is-correct"] = Field(
        "drop", description="What happens to samples older than max_staleness."
    )


class LossConfig(_Section):
    type: Literal["ppo-clip", "tis", "none"] = Field(
        "ppo-clip", description="Importance correction against vLLM's sampling logprobs."
    )
    clip_eps: float = Field(0.2, gt=0.0, le=10.0, description="PPO clip range (1-eps, 1+eps).")
    ratio_cap: float = Field(2.0, ge=1.0, le=1e4, description="Truncation of the IS weight (tis, is-correct).")
    kl_coef: float = Field(0.0, ge=0.0, le=100.0, description="KL penalty to the base model (adapter off).")


class RunConfig(_Section):
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed for task sampling, init and vLLM.")
    max_steps: int = Field(100, ge=1, le=10_000_000, description="Optimizer steps to run.")
    time_budget_s: float | None = Field(
        None, gt=0, description="Stop after this many seconds of training (None = no limit)."
    )
    output_dir: str = Field("runs/default", description="Where metrics, adapters and checkpoints go.")
    checkpoint_every: int = Field(0, ge=0, description="Checkpoint every N steps (0 = only at the end).")
    eval_every: int = Field(0, ge=0, description="Held-out greedy eval every N steps (0 = off).")
    eval_max_tokens: int | None = Field(
        None, ge=1, le=32768, description="Completion limit for held-out eval (None = generator.max_new_tokens)."
    )
    eval_at_start: bool = Field(False, description="Evaluate the base model before training.")
    eval_at_end: bool = Field(False, description="Evaluate the final adapter after training.")
    canary_every: int = Field(10, ge=0, description="Generator/learner logprob probe every N syncs (0 = off).")
    chart_every: int = Field(5, ge=0, description="Redraw OUT/chart.png every N steps (0 = off).")
    progress: bool = Field(True, description="Show the rich progress display.")
    engine_log: bool = Field(False, description="Let vLLM log at INFO level.")


class ArithmeticTask(_Section):
    type: Literal["arithmetic"] = "arithmetic"
    digits: int = Field(1, ge=1, le=9, description="Digits per operand.")
    ops: list[Literal["+", "-", "*"]] = Field(["+"], min_length=1, description="Operations to draw from.")
    heldout: int = Field(200, ge=0, le=100_000, description="Held-out problems (never trained on).")
    template: str = Field("What is {a} {op} {b}?", description="Prompt template with {a}, {op}, {b}.")
    system_prompt: str | None = Field(None, description="System message (None = the model's default).")


class JsonlTask(_Section):
    type: Literal["jsonl"] = "jsonl"
    path: str = Field(..., description="JSONL file with one record per line.")
    prompt_field: str = Field("prompt", description="Record field holding the prompt text.")
    answer_field: str = Field("answer", description="Record field holding the reference answer.")
    reward: str = Field(
        "exact", description="'exact', 'numeric', 'regex:<pattern>' or a user 'module:function'."
    )
    reward_timeout_s: float = Field(5.0, gt=0, le=3600, description="Per-call limit for user rewards.")
    heldout: int = Field(0, ge=0, description="Records at the end of the file held out for eval.")
    system_prompt: str | None = Field(None, description="System message (None = the model's default).")

    @field_validator("reward")
    @classmethod
    def _reward(cls, value: str) -> str:
        if value in ("exact", "numeric") or value.startswith("regex:"):
            if value.startswith("regex:"):
                try:
                    re.compile(value[len("regex:"):])
                except re.error as exc:
                    raise ValueError(f"bad regex: {exc}") from exc
            return value
        if re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", value):
            return value
        raise ValueError("must be 'exact', 'numeric', 'regex:<pattern>' or 'module:function'")


TaskConfig = Annotated[Union[ArithmeticTask, JsonlTask], Field(discriminator="type")]


class AdapterConfig(_Section):
    name: str = Field("main", description="Adapter name: a plain identifier.")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not ADAPTER_NAME_RE.match(value):
            raise ValueError("must be a plain identifier (letters, digits, _ and -, max 64)")
        return value


class GenerationOverrides(_Section):
    """Per-adapter generation settings in a fleet (unset fields use [generator])."""

    max_new_tokens: int | None = Field(None, ge=1, le=32768, description="Completion length limit.")
    temperature: float | None = Field(None, gt=0.0, le=10.0, description="Sampling temperature.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus sampling threshold.")
    samples_per_prompt: int | None = Field(None, ge=2, le=256, description="Completions per prompt.")


def _arithmetic_by_default(cls: type, data: Any) -> Any:
    """`type` may be left out of a [task] table: it then means the builtin arithmetic task."""
    if isinstance(data, dict) and isinstance(data.get("task"), dict):
        data["task"].setdefault("type", "arithmetic")
    return data


class FleetAdapter(AdapterConfig):
    """One adapter of a fleet: its own task, reward, LoRA shape, learning rate and share."""

    task: TaskConfig = Field(..., description="This adapter's task and reward.")
    lora: LoraConfig | None = Field(None, description="LoRA shape (unset: the top-level [lora]).")
    lr: float | None = Field(None, gt=0.0, le=1.0, description="Learning rate (unset: learner.lr).")
    weight: float = Field(1.0, gt=0.0, le=1000.0, description="Share of generation capacity.")
    generation: GenerationOverrides = Field(default_factory=GenerationOverrides)

    _default_task_type = model_validator(mode="before")(classmethod(_arithmetic_by_default))


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter as the run sees it, with fleet overrides resolved."""

    name: str
    task: Any  # ArithmeticTask | JsonlTask
    lora: LoraConfig
    lr: float
    weight: float
    max_new_tokens: int
    temperature: float
    top_p: float
    samples_per_prompt: int


class TrainConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    adapter: AdapterConfig = Field(default_factory=AdapterConfig)
    adapters: list[FleetAdapter] | None = Field(
        None, description="A fleet: several adapters trained at once (instead of [adapter]+[task])."
    )
    lora: LoraConfig = Field(default_factory=LoraConfig)
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    task: TaskConfig = Field(default_factory=ArithmeticTask)

    _default_task_type = model_validator(mode="before")(classmethod(_arithmetic_by_default))

    @model_validator(mode="after")
    def _cross_field(self) -> "TrainConfig":
        self._check_sync()
        if self.generator.max_new_tokens >= self.generator.max_model_len:
            raise ValueError(
                "generator.max_new_tokens must be below generator.max_model_len "
                "(raise max_model_len or lower max_new_tokens)"
            )
        if self.adapters is not None:
            if not self.adapters:
                raise ValueError("adapters: a fleet needs at least one [[adapters]] entry")
            clash = {"adapter", "task"} & self.model_fields_set
            if clash:
                raise ValueError(f"{sorted(clash)[0]}: give either [{sorted(clash)[0]}] or [[adapters]], "
                                 "not both (each fleet entry has its own name and task)")
            seen: dict[str, int] = {}
            for i, entry in enumerate(self.adapters):
                if entry.name in seen:
                    raise ValueError(f"adapters.{i}.name: duplicate adapter name {entry.name!r} "
                                     f"(also adapters.{seen[entry.name]}.name)")
                seen[entry.name] = i
                limit = entry.generation.max_new_tokens or self.generator.max_new_tokens
                if limit >= self.generator.max_model_len:
                    raise ValueError(f"adapters.{i}.generation.max_new_tokens must be below "
                                     "generator.max_model_len")
        return self

    def _check_sync(self) -> None:
        gen, transport = self.generator, self.sync.resolved(self.generator)
        if gen.backend == "server":
            if not gen.urls:
                raise ValueError("generator.urls: backend 'server' needs at least one server URL")
            if transport != "http":
                raise ValueError(f"sync.transport: a remote server takes new versions over 'http', not {transport!r}")
            return
        if transport == "http":
            raise ValueError("sync.transport: 'http' is for generator.backend = 'server'")
        if transport == "inproc" and gen.engine_process == "separate":
            raise ValueError("sync.transport: 'inproc' needs generator.engine_process = 'same' "
                             "(use 'shm', 'nccl' or 'cuda-ipc' for an engine in its own process)")
        if transport != "inproc" and gen.engine_process == "same":
            raise ValueError(f"sync.transport: {transport!r} crosses a process boundary; set "
                             "generator.engine_process = 'separate' (or use 'inproc')")

    # ---- derived values (never written back) ----
    @property
    def adapter_specs(self) -> list[AdapterSpec]:
        """Every adapter of the run, overrides resolved (one entry for a single-adapter run)."""
        gen = self.generator
        if self.adapters is None:
            return [AdapterSpec(self.adapter.name, self.task, self.lora, self.learner.lr, 1.0,
                                gen.max_new_tokens, gen.temperature, gen.top_p, gen.samples_per_prompt)]
        specs = []
        for entry in self.adapters:
            o = entry.generation
            specs.append(AdapterSpec(
                entry.name, entry.task, entry.lora or self.lora, entry.lr or self.learner.lr, entry.weight,
                o.max_new_tokens or gen.max_new_tokens, o.temperature or gen.temperature,
                o.top_p or gen.top_p, o.samples_per_prompt or gen.samples_per_prompt,
            ))
        return specs

    @property
    def adapter_names(self) -> list[str]:
        return [spec.name for spec in self.adapter_specs]

    @property
    def versions_per_adapter(self) -> int:
        """Live versions of one adapter: the staleness window plus the current one."""
        return self.buffer.max_staleness + 1

    @property
    def max_loras(self) -> int:
        """Engine slots: every live version of every adapter, plus one being published."""
        return len(self.adapter_names) * self.versions_per_adapter + 1

    @property
    def eval_max_tokens(self) -> int:
        return self.run.eval_max_tokens or self.generator.max_new_tokens

    @property
    def max_lora_rank(self) -> int:
        return vllm_rank(max(spec.lora.rank for spec in self.adapter_specs))


def vllm_rank(rank: int) -> int:
    """Round a LoRA rank up to a value vLLM accepts for `max_lora_rank`."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"rank {rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


# ---------------------------------------------------------------- loading


def _dotted(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if not (isinstance(p, str) and p in ("arithmetic", "jsonl"))]
    return ".".join(parts) if parts else "(root)"


def format_validation_error(exc: ValidationError, source: str) -> str:
    """The first error as one line: `file: dotted.field: problem`."""
    err = exc.errors()[0]
    field = _dotted(err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        msg = "unknown key (check the spelling; see `lora-async train --help`)"
    elif kind == "missing":
        msg = "required field is missing"
    elif kind == "union_tag_invalid" or kind == "union_tag_not_found":
        msg = "unknown task type: use 'arithmetic' or 'jsonl'"
    else:
        msg = err["msg"].removeprefix("Value error, ")
        if "input" in err and kind not in ("value_error",) and not isinstance(err["input"], dict):
            msg += f" (got {err['input']!r})"
    more = len(exc.errors()) - 1
    suffix = f" [+{more} more]" if more else ""
    if field == "(root)" and re.match(r"^[a-z_][\w.]*[: ]", msg):
        return f"{source}: {msg}{suffix}"  # a cross-field check names its own dotted fields
    return f"{source}: {field}: {msg}{suffix}"


def parse_override(text: str) -> tuple[list[str], Any]:
    """`dotted.key=value` -> (path, value); the value is parsed as TOML, else kept a string."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected dotted.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key):
        raise ConfigError(f"--set {text!r}: {key!r} is not a dotted key")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {text!r}: {'.'.join(path[:-1])} is not a section")
            node = child
        node[path[-1]] = value
    return data


def load_config(path: str | os.PathLike[str] | None, overrides: list[str] = ()) -> TrainConfig:
    """Read TOML (or defaults when path is None), apply `--set` overrides, validate."""
    source = str(path) if path is not None else "<defaults>"
    data: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"{source}: config file not found")
        try:
            data = tomllib.loads(file.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    data = apply_overrides(data, list(overrides))
    if overrides:
        source += " (with --set)"
    try:
        config = TrainConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None
    tasks = [("task", config.task)] if config.adapters is None else [
        (f"adapters.{i}.task", entry.task) for i, entry in enumerate(config.adapters)]
    for field_name, task in tasks:
        if isinstance(task, JsonlTask):
            task_path = Path(task.path)
            if not task_path.is_absolute() and path is not None:
                task_path = Path(path).parent / task_path
            if not task_path.is_file():
                raise ConfigError(f"{source}: {field_name}.path: file not found: {task.path}")
            task.path = str(task_path.resolve())
    return config


def dump_config(config: TrainConfig) -> str:
    """The resolved config as TOML-ish text, written next to the run's outputs."""
    import json

    return json.dumps(config.model_dump(mode="json"), indent=2)
