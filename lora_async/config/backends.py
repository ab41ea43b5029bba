"""Backend tables: [generator] (union on `type`) and [sync] (union on `transport`).

A generator says where its engine lives (`engine_home`); a sync transport says where the engine
must live for it to work (`needs`). `TrainConfig` compares the two generically and, when [sync]
is left out, picks the transport from `DEFAULT_SYNC`.
"""

from __future__ import annotations

import re
from types import MappingProxyType
from typing import Annotated, ClassVar, Literal, Union

from pydantic import Field, field_validator

from .sections import Cpus, Device, Section

EngineHome = Literal["same", "separate", "server", "ray"]

# How an error names each engine home, with the setting that selects it.
ENGINE_HOME_TEXT = MappingProxyType({
    "same": 'the engine in this process (generator.engine_process = "same")',
    "separate": 'the engine in its own process (generator.engine_process = "separate")',
    "server": 'remote servers (generator.type = "server")',
    "ray": 'engine replicas on Ray (generator.type = "ray")',
})


# ---------------------------------------------------------------- [generator]


class GeneratorBase(Section):
    """Settings every generator has."""

    groups_in_flight: int = Field(16, ge=1, le=4096, description="Prompt groups kept generating at once.")
    max_model_len: int = Field(1024, ge=64, le=1_048_576, description="Prompt + completion token limit.")
    base: Literal["learner", "original"] = Field(
        "learner", description="The base served when model.quantization is nf4/int8: 'learner' (the learner's own "
                               "quantised weights, dequantised; built once and cached), so both halves compute from "
                               "the same numbers; 'original': the checkpoint as it is (the 4-bit rounding then shows "
                               "as a logprob gap). No effect without model.quantization.",
    )

    @property
    def engine_home(self) -> EngineHome:
        """Where the engine lives (each generator type says)."""
        raise NotImplementedError

    @property
    def engine_here(self) -> bool:
        """The engine runs on this machine, placed by this run (not servers, not Ray replicas)."""
        return self.engine_home in ("same", "separate")

    def describe_where(self, placement: str, ray_address: str | None) -> str:
        """Where the generator runs, for the run's opening lines (`placement`: what an engine of
        this run was placed on; `ray_address`: `ray.address`). Each generator type says."""
        raise NotImplementedError


class EngineSettings(GeneratorBase):
    """How a vLLM engine of this run is built: one in this process, or each Ray replica's."""

    memory_fraction: float = Field(
        0.2, gt=0.0, le=0.95,
        description="vLLM gpu_memory_utilization; on CPU the share of RAM for the KV cache.",
    )
    kv_cache_gb: float | None = Field(
        None, gt=0, le=1_000_000, description="Explicit KV-cache size in GB (overrides memory_fraction)."
    )
    fast_cpu_lora: bool = Field(
        True, description="Use lora-async's grouped CPU LoRA kernels instead of vLLM's per-token gather."
    )
    max_batched_tokens: int | None = Field(
        None, ge=256, le=1_048_576,
        description="Tokens one engine step may schedule (vLLM's max_num_batched_tokens; None = vLLM's "
                    "default, 2048 here). Smaller steps let a new version register sooner (it waits for the "
                    "step in flight) at a little throughput; at least 256 (vLLM's max_num_seqs), and on a CPU "
                    "at least max_model_len (prompts are not split there).",
    )
    block_size: int | None = Field(
        None, ge=16, le=1024, multiple_of=16,
        description="KV-cache block in tokens (None = vLLM's default: 128 on CPU). Multi-turn episodes "
                    "reuse more of their context from the prefix cache with small blocks (32 on CPU).",
    )
    quantization: Literal["none", "bitsandbytes"] = Field(
        "none", description="'bitsandbytes': vLLM quantises the base to 4 bits as it loads it (CUDA only; untested "
                            "by lora-async's CI, which has no GPU).",
    )


class VllmGeneratorConfig(EngineSettings):
    """A vLLM engine owned by this run (in this process or its own)."""

    type: Literal["vllm"] = Field("vllm", description="'vllm': an engine owned by this run.")
    engine_process: Literal["same", "separate"] = Field(
        "same", description="Run the vLLM engine core in this process or in its own."
    )
    device: Device = Field("auto", description="'auto', 'cpu' or 'cuda:N'.")
    cpus: Cpus = Field("auto", description="CPU cores for the generator on CPU ('auto', '0', '0-3'); None = all.")

    @property
    def engine_home(self) -> EngineHome:
        return self.engine_process

    def describe_where(self, placement: str, ray_address: str | None) -> str:
        return placement + (" (engine in its own process)" if self.engine_process == "separate" else "")


class RayGeneratorConfig(EngineSettings):
    """Engine replicas as Ray actors, each the same engine wrapper as one node's (generator/ray/)."""

    type: Literal["ray"] = Field("ray", description="'ray': vLLM replicas as actors on a Ray cluster.")
    replicas: int = Field(2, ge=1, le=1024, description="Engine replicas, each a Ray actor with its own vLLM engine.")
    device: Literal["auto", "cpu", "gpu"] = Field(
        "auto", description="'gpu': one GPU per replica; 'cpu': a bundle of cpus_per_replica cores; 'auto': 'gpu' "
                            "when the cluster has a GPU per replica.",
    )
    cpus_per_replica: int = Field(1, ge=1, le=1024, description="CPU cores in each replica's bundle.")
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement-group strategy for the replicas' bundles.",
    )
    max_restarts: int = Field(3, ge=-1, le=1000, description="Times Ray restarts a dead replica (-1: forever).")
    down_timeout_s: float = Field(
        180.0, gt=0, le=86400,
        description="Every replica down for longer than this stops the run (with a checkpoint).",
    )
    start_timeout_s: float = Field(900.0, gt=0, le=86400, description="Give up on a replica engine that does not start.")

    @property
    def engine_home(self) -> EngineHome:
        return "ray"

    def describe_where(self, placement: str, ray_address: str | None) -> str:
        cluster = ("a local Ray" if ray_address is None else "the running Ray cluster" if ray_address == "auto"
                   else f"the Ray cluster at {ray_address}")
        return f"{self.replicas} replicas on {cluster}"


class ServerGeneratorConfig(GeneratorBase):
    """Running `lora-async server` / `vllm serve` replicas, driven over HTTP."""

    type: Literal["server"] = Field("server", description="'server': running vLLM servers at `urls`.")
    urls: list[str] = Field(
        min_length=1, description="Base URLs of OpenAI-compatible vLLM servers (at least one)."
    )
    api_key: str | None = Field(None, description="Bearer token for the servers (or env LORA_ASYNC_API_KEY).")
    request_timeout_s: float = Field(600.0, gt=0, le=86400, description="HTTP timeout of one generation request.")

    @property
    def engine_home(self) -> EngineHome:
        return "server"

    def describe_where(self, placement: str, ray_address: str | None) -> str:
        return f"vllm serve at {', '.join(self.urls)}"

    @field_validator("urls")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        for url in value:
            if not re.fullmatch(r"https?://[^\s/]+(:\d+)?/?", url):
                raise ValueError(f"{url!r} is not a server base URL like 'http://127.0.0.1:8000'")
        return [url.rstrip("/") for url in value]


GeneratorConfig = Annotated[Union[VllmGeneratorConfig, ServerGeneratorConfig, RayGeneratorConfig],
                            Field(discriminator="type")]


class RayConfig(Section):
    """The Ray cluster a `generator.type = "ray"` run uses."""

    address: str | None = Field(
        None, description="None: a local Ray started and stopped by the run; 'auto': join the running cluster "
                          "(`ray start --head` on this machine or RAY_ADDRESS); or 'host:port' / 'ray://host:port'.",
    )
    namespace: str = Field("lora-async", min_length=1, description="Ray namespace of the run's actors.")
    object_store_gb: float | None = Field(
        None, gt=0, le=100_000, description="Object-store size of a local Ray in GB (None: Ray's default).",
    )


# ---------------------------------------------------------------- [sync]


class SyncBase(Section):
    """A way for new adapter versions to reach the engine; `needs` is the engine home it works with."""

    needs: ClassVar[EngineHome]


class InprocSync(SyncBase):
    """Hand the learner's tensors to an engine in this process by reference."""

    needs: ClassVar[EngineHome] = "same"
    transport: Literal["inproc"] = Field("inproc", description="'inproc': owned tensors by reference.")


class ShmSync(SyncBase):
    """One packed buffer in POSIX shared memory."""

    needs: ClassVar[EngineHome] = "separate"
    transport: Literal["shm"] = Field("shm", description="'shm': a packed buffer in POSIX shared memory.")
    checksum: bool = Field(True, description="Checksum every transfer.")
    timeout_s: float = Field(60.0, gt=0, le=3600, description="Give up on a receiver that does not answer.")


class NcclSync(SyncBase):
    """One broadcast over a process group dedicated to weight sync."""

    needs: ClassVar[EngineHome] = "separate"
    transport: Literal["nccl"] = Field("nccl", description="'nccl': one broadcast over a dedicated process group.")
    backend: Literal["nccl", "gloo"] = Field("nccl", description="Process-group backend ('gloo' on CPU).")
    checksum: bool = Field(True, description="Checksum every transfer.")
    timeout_s: float = Field(60.0, gt=0, le=3600, description="Give up on a receiver that does not answer.")


class CudaIpcSync(SyncBase):
    """A CUDA IPC handle to the learner's GPU buffer."""

    needs: ClassVar[EngineHome] = "separate"
    transport: Literal["cuda-ipc"] = Field(
        "cuda-ipc", description="'cuda-ipc': a CUDA IPC handle to the learner's GPU buffer."
    )
    timeout_s: float = Field(60.0, gt=0, le=3600, description="Give up on a receiver that does not answer.")


class RaySync(SyncBase):
    """One packed buffer put into Ray's object store once; every replica registers it from there."""

    needs: ClassVar[EngineHome] = "ray"
    transport: Literal["ray"] = Field("ray", description="'ray': one packed buffer through Ray's object store.")
    checksum: bool = Field(True, description="Checksum every transfer (each replica checks it).")
    timeout_s: float = Field(120.0, gt=0, le=3600, description="Give up on a replica that does not register in time.")


class HttpSync(SyncBase):
    """PEFT directories the servers load over their LoRA HTTP API."""

    needs: ClassVar[EngineHome] = "server"
    transport: Literal["http"] = Field("http", description="'http': PEFT directories loaded by the servers.")
    dir: str | None = Field(
        None, description="Where PEFT directories are written; the servers must read it (None = OUT/sync)."
    )
    timeout_s: float = Field(60.0, gt=0, le=3600, description="Give up on a server that does not answer.")
    retry_budget_s: float = Field(30.0, ge=0, le=3600, description="Total time for retries against a server.")


SyncConfig = Annotated[
    Union[InprocSync, ShmSync, NcclSync, CudaIpcSync, HttpSync, RaySync], Field(discriminator="transport")
]

# The transport a run uses when [sync] is left out, per engine home.
DEFAULT_SYNC: MappingProxyType[str, type[SyncBase]] = MappingProxyType({
    "same": InprocSync, "separate": ShmSync, "server": HttpSync, "ray": RaySync,
})
