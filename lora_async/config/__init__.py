"""The run's configuration: one pydantic tree, loaded from TOML.

Every field has bounds and a one-line description. Unknown keys are errors. Derived values are
properties, never silent rewrites. `load_config` turns any problem into a `ConfigError` whose
message is one line naming the dotted field and the file; the CLI prints it and exits 2.

    sections.py  plain tables: model, adapter, lora, sampling, learner, buffer, run
    losses.py    [loss] (union on `type`: ppo-clip, tis, decoupled, none, m2po, cispo, topr)
    backends.py  [generator] (union on `type`) and [sync] (union on `transport`)
    tasks.py     [task] (union on `type`: arithmetic, jsonl, dataset, reasoning-gym, env) and fleet entries
    train.py     TrainConfig: cross-field checks and derived values
    load.py      TOML + overrides -> TrainConfig, migration errors, one-line error messages
    reference.py the configuration reference (docs/configuration.md), generated from the schema
"""

from .backends import (
    DEFAULT_SYNC, ENGINE_HOME_TEXT, CudaIpcSync, EngineHome, GeneratorBase, GeneratorConfig, HttpSync, InprocSync,
    NcclSync, RayConfig, RayGeneratorConfig, RaySync, ServerGeneratorConfig, ShmSync, SyncBase, SyncConfig, VllmGeneratorConfig,
)
from .load import (
    MIGRATIONS, ConfigError, apply_overrides, check_migrations, dump_config, format_validation_error, load_config,
    parse_override,
)
from .losses import (
    DEFAULT_LOSS, LOSS_TYPES, CISPOLoss, DecoupledLoss, LossBase, LossConfig, M2POLoss, NoCorrectionLoss, PPOClipLoss,
    TISLoss, TOPRLoss, default_loss, loss_of,
)
from .sections import (
    ADAPTER_NAME_RE, CPU_LIST_RE, AdapterConfig, BufferConfig, LearnerConfig, LoraConfig, ModelConfig, RunConfig,
    SamplingConfig, Section,
)
from .tasks import (AUTO_WORKERS_CAP, ArithmeticTask, DatasetTask, EnvTask, FleetAdapter, JsonlTask, ProblemTask,
                    ReasoningGymDataset, ReasoningGymTask, TaskConfig, ToolLatency, auto_workers)
from .train import VLLM_LORA_RANKS, AdapterSpec, TrainConfig, vllm_rank

__all__ = [
    "ADAPTER_NAME_RE", "CPU_LIST_RE", "DEFAULT_SYNC", "ENGINE_HOME_TEXT", "MIGRATIONS", "VLLM_LORA_RANKS",
    "AdapterConfig", "AdapterSpec", "ArithmeticTask", "DatasetTask", "ProblemTask",
    "ReasoningGymDataset", "ReasoningGymTask", "BufferConfig", "EnvTask", "ConfigError", "CudaIpcSync", "EngineHome",
    "FleetAdapter", "GeneratorBase", "GeneratorConfig", "HttpSync", "InprocSync", "JsonlTask", "LearnerConfig",
    "LoraConfig", "LossConfig", "ModelConfig", "NcclSync", "RunConfig", "SamplingConfig", "Section",
    "RayConfig", "RayGeneratorConfig", "RaySync", "ServerGeneratorConfig", "ShmSync", "SyncBase", "SyncConfig", "TaskConfig", "TrainConfig",
    "ToolLatency", "VllmGeneratorConfig", "DEFAULT_LOSS", "LOSS_TYPES", "CISPOLoss", "DecoupledLoss", "LossBase",
    "M2POLoss", "NoCorrectionLoss", "PPOClipLoss", "TISLoss", "TOPRLoss", "default_loss", "loss_of",
    "apply_overrides", "check_migrations", "dump_config", "format_validation_error", "load_config",
    "parse_override", "vllm_rank", "AUTO_WORKERS_CAP", "auto_workers",
]
