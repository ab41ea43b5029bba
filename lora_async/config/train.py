"""`TrainConfig`, the root of the config tree: its cross-field checks and derived values.

Derived values (`adapter_specs`, `sync_config`, `max_lora_rank`, ...) are properties computed
from the fields as given; nothing here writes back into a field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from .. import lag_cost
from .backends import (DEFAULT_SYNC, ENGINE_HOME_TEXT, EngineSettings, GeneratorConfig, RayConfig, SyncBase, SyncConfig,
                       VllmGeneratorConfig)
from .losses import DEFAULT_LOSS, LossConfig, default_loss
from .sections import (
    AdapterConfig, BufferConfig, LearnerConfig, LoraConfig, ModelConfig, RunConfig, SamplingConfig, Section,
)
from .games import OPPONENTS_TEXT, RESERVED
from .tasks import ArithmeticTask, EnvTask, FleetAdapter, ProblemTask, TaskConfig, default_types

# vLLM accepts only these `max_lora_rank` values.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_rank(rank: int) -> int:
    """Round a LoRA rank up to a value vLLM accepts for `max_lora_rank`."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"rank {rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter as the run sees it, fleet overrides resolved."""

    name: str
    task: ProblemTask | EnvTask
    lora: LoraConfig
    lr: float
    weight: float
    sampling: SamplingConfig
    eval_max_tokens: int  # run.eval_max_tokens, or this adapter's sampling.max_new_tokens
    task_path: str = "task"  # where its task table is, for error messages ("adapters.2.task")


class TrainConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="The frozen base model.")
    adapter: AdapterConfig = Field(
        default_factory=AdapterConfig, description="The adapter of a single-adapter run."
    )
    adapters: list[FleetAdapter] | None = Field(
        None, description="A fleet: several adapters trained at once (instead of [adapter]+[task])."
    )
    lora: LoraConfig = Field(
        default_factory=LoraConfig, description="The LoRA shape (a fleet entry may give its own)."
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="How rollouts are sampled.")
    generator: GeneratorConfig = Field(
        default_factory=VllmGeneratorConfig, description="Who generates: 'vllm' (type left out), 'server' or 'ray'."
    )
    ray: RayConfig = Field(default_factory=RayConfig, description="The Ray cluster of a generator.type = 'ray' run.")
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="The optimizer and its batches.")
    buffer: BufferConfig = Field(default_factory=BufferConfig, description="The rollout buffer and staleness.")
    sync: SyncConfig | None = Field(
        None, description="How new versions reach the engine (None = the default for the generator)."
    )
    loss: LossConfig = Field(default_factory=default_loss,
                             description=f"The policy-gradient loss (type left out = {DEFAULT_LOSS}).")
    run: RunConfig = Field(default_factory=RunConfig, description="Steps, outputs, eval and logging.")
    task: TaskConfig = Field(
        default_factory=ArithmeticTask, description="The task and reward (type left out = arithmetic)."
    )

    @model_validator(mode="before")
    @classmethod
    def _default_types(cls, data: Any) -> Any:
        return default_types(data, task="arithmetic", generator="vllm", loss=DEFAULT_LOSS)

    @model_validator(mode="after")
    def _cross_field(self) -> "TrainConfig":
        self._check_sync()
        self._check_ray()
        self._check_mode()
        self._check_lengths()
        if self.adapters is not None:
            self._check_fleet(self.adapters)
        self._check_games()
        return self

    def _check_sync(self) -> None:
        if self.sync is None or self.sync.needs == self.generator.engine_home:
            return
        raise ValueError(
            f"sync.transport: {self.sync.transport!r} needs {ENGINE_HOME_TEXT[self.sync.needs]}, but this "
            f"config has {ENGINE_HOME_TEXT[self.generator.engine_home]}; change one of the two, or leave out "
            "[sync] to pick the transport from the generator"
        )

    def _check_mode(self) -> None:
        buffer = self.buffer
        if buffer.mode == "async" and buffer.synchronous:
            raise ValueError("buffer.mode: 'async' needs buffer.max_staleness >= 1 (the lag async trains at); "
                             "raise max_staleness, or set mode = 'sync'")
        if buffer.lag_costs is not None:
            try:
                lag_cost.load(buffer.lag_costs, self.loss.type)
            except lag_cost.LagCostError as exc:
                raise ValueError(str(exc)) from None
        lag = buffer.fixed_lag
        if lag is None:
            return
        if buffer.mode != "async" or buffer.max_staleness != lag or buffer.partial_rollouts:
            raise ValueError(f"buffer.fixed_lag: a fixed lag of {lag} needs buffer.mode = 'async', "
                             f"buffer.max_staleness = {lag} and buffer.partial_rollouts = false (this config has "
                             f"{buffer.mode!r}, {buffer.max_staleness} and {str(buffer.partial_rollouts).lower()})")

    def _check_ray(self) -> None:
        if self.ray != RayConfig() and self.generator.engine_home != "ray":
            raise ValueError(f"ray: [ray] is used only with generator.type = \"ray\" (this config has "
                             f"generator.type = {self.generator.type!r}); remove [ray] or change the generator")

    def _check_lengths(self) -> None:
        limit = self.generator.max_model_len
        fields = [("sampling.max_new_tokens", self.sampling.max_new_tokens)] + [
            (f"adapters.{i}.sampling.max_new_tokens", entry.sampling.max_new_tokens)
            for i, entry in enumerate(self.adapters or ()) if "max_new_tokens" in entry.sampling.model_fields_set
        ]
        for field, tokens in fields:
            if tokens >= limit:
                raise ValueError(f"{field} ({tokens}) must be below generator.max_model_len ({limit}): "
                                 f"raise generator.max_model_len or lower {field}")

    def _check_fleet(self, adapters: list[FleetAdapter]) -> None:
        if not adapters:
            raise ValueError("adapters: a fleet needs at least one [[adapters]] entry")
        clash = sorted({"adapter", "task"} & self.model_fields_set)
        if clash:
            raise ValueError(f"{clash[0]}: give either [{clash[0]}] or [[adapters]], not both "
                             "(each fleet entry has its own name and task)")
        seen: dict[str, int] = {}
        for i, entry in enumerate(adapters):
            if entry.name in seen:
                raise ValueError(f"adapters.{i}.name: duplicate adapter name {entry.name!r} "
                                 f"(also adapters.{seen[entry.name]}.name)")
            seen[entry.name] = i

    def _check_games(self) -> None:
        """A game's opponents name adapters of this run, and frozen versions need an engine that keeps them."""
        names = set(self.adapter_names)
        for spec in self.adapter_specs:
            task = spec.task
            if not isinstance(task, EnvTask):
                continue
            for field, value in [("opponents", task.opponents),
                                 *((f"eval_opponents.{i}", o) for i, o in enumerate(task.eval_opponents or []))]:
                adapter = value.partition("@v")[0]
                if value.startswith("scripted:") or adapter in RESERVED:
                    continue
                if adapter not in names:
                    raise ValueError(f"{spec.task_path}.{field}: {value!r} names no adapter of this run "
                                     f"({', '.join(sorted(names))}); use {OPPONENTS_TEXT}")
                if value == spec.name:
                    raise ValueError(f"{spec.task_path}.{field}: {value!r} is this adapter itself: use 'self'")
            if task.kept_versions and self.generator.type != "vllm" and (task.opponents == "league"
                                                                         or "@v" in task.opponents):
                raise ValueError(f"{spec.task_path}.opponents: {task.opponents!r} keeps frozen versions registered, "
                                 f"which only generator.type = 'vllm' does so far (this config has "
                                 f"{self.generator.type!r})")

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A dump must load back to the same run: a fleet's defaulted [adapter]/[task] would clash.
        data = handler(self)
        if self.adapters is not None:
            data.pop("adapter", None)
            data.pop("task", None)
        if self.generator.engine_home != "ray":
            data.pop("ray", None)
        return data

    # ---- derived values (never written back) ----
    @property
    def adapter_specs(self) -> list[AdapterSpec]:
        """Every adapter of the run, overrides resolved (one entry for a single-adapter run)."""
        if self.adapters is None:
            return [AdapterSpec(self.adapter.name, self.task, self.lora, self.learner.lr, 1.0, self.sampling,
                                self.run.eval_max_tokens or self.sampling.max_new_tokens)]
        specs = []
        for i, entry in enumerate(self.adapters):
            # Only the fields the entry sets override [sampling]; the rest are not SamplingConfig's defaults.
            own = entry.sampling.model_dump(include=entry.sampling.model_fields_set)
            sampling = self.sampling.model_copy(update=own)
            lr = self.learner.lr if entry.lr is None else entry.lr
            specs.append(AdapterSpec(entry.name, entry.task, entry.lora or self.lora, lr, entry.weight, sampling,
                                     self.run.eval_max_tokens or sampling.max_new_tokens, f"adapters.{i}.task"))
        return specs

    @property
    def adapter_names(self) -> list[str]:
        return [spec.name for spec in self.adapter_specs]

    @property
    def max_lora_rank(self) -> int:
        return vllm_rank(max(spec.lora.rank for spec in self.adapter_specs))

    @property
    def local_engine(self) -> VllmGeneratorConfig | None:
        """The `[generator]` of an engine this run starts on this machine (in this process or its
        own); None for remote servers and Ray replicas."""
        return self.generator if isinstance(self.generator, VllmGeneratorConfig) else None

    @property
    def engine_settings(self) -> EngineSettings | None:
        """How this run's own vLLM engines are built (one in this process or its own, or each Ray
        replica's); None when it drives running servers instead."""
        return self.generator if isinstance(self.generator, EngineSettings) else None

    @property
    def sync_config(self) -> SyncBase:
        """The [sync] table, or when it is left out the default transport for the generator's engine home."""
        return self.sync if self.sync is not None else DEFAULT_SYNC[self.generator.engine_home]()
