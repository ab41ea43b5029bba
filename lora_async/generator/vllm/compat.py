"""Every vLLM internal lora-async touches, checked in one place, for one vLLM version.

`generator/vllm/` is the only package that reaches into vLLM. Its modules use:

| internal | used by | why |
|---|---|---|
| `LoRAModel.from_lora_tensors`, `PEFTHelper`, `WorkerLoRAManager` (`_adapter_manager`, `lora_config`, `vocab_size`, `max_position_embeddings`, `add_adapter`, `remove_adapter`) | worker.py, hotswap.py | vLLM can only load adapters from a path; we build the `LoRAModel` from tensors the way `_load_adapter` does after reading files |
| `LoRAModelManager` slots and activation, the active cache's `deactivate_fn` (every way a slot is freed), `LoRAModel`/`LoRALayerWeights` fields and in-place scaling, the LoRA layers' stacked tensors (read at each call) and `set_lora`/`reset_lora`, `PIN_MEMORY` (`HOTSWAP_SOURCES`, `*_LORA_LAYERS`) | hotswap.py, swap_plans.py | a version is written into a free slot as vLLM's own build and activation would, and its LoRAModel filled from the slot before vLLM frees that slot |
| `LoRARequest(lora_name, lora_int_id, lora_path)` | client.py | requests name a version by name and int id |
| the worker's `model_runner.lora_manager`, `model_runner.reload_weights` | worker.py | the adapter cache; the full-weight row of `bench sync` |
| `SyncMPClient`/`MPClient` (`resources.engine_dead`, `outputs_queue`, `utility_results`), `EngineDeadError` | client.py | vLLM 0.32 notices a dead engine process but leaves its callers blocked |
| `LLMEngine.from_engine_args(enable_multiprocessing=)`, `LLMEngine.engine_core.shutdown()`, `vllm_config.lora_config` | client.py | the engine core in its own process; a clean stop; the slots the engine really has |
| `EngineArgs` fields and the `VLLM_*` environment variables below | client.py | how the engine is built |
| `vllm.lora.punica_wrapper.punica_cpu` ops and their arity (`PUNICA_OPS`) | cpu_lora_ops.py | the grouped CPU LoRA ops replace them |
| `vllm.model_executor.layers.quantization.QUANTIZATION_METHODS` | client.py | `generator.quantization` is refused in one line where vLLM lacks the method |
| `GPUModelRunner._bookkeeping_sync` rewinding a seeded request's generator (`SEEDED_CHUNK_REWIND`) | client.py | on a CPU that call (CUDA's `Generator.set_offset`) raises, and it runs whenever a chunked prefill cuts a seeded request's prompt: the CPU engine is built without chunked prefill |

The release itself is checked first (`release.py`, from package metadata, without importing
vLLM): pyproject's `gpu` and `cpu` extras pin `release.PINNED`, and another release is refused
in one line naming both.

`check_vllm_compat()` verifies all of it and raises `VllmCompatError` naming what changed; the
generator calls it before it starts an engine, and `tests/test_vllm_ext.py` pins it (and the
release check). The other modules of `generator/vllm/` import this one, never the reverse
(`release.py`, below it, imports nothing of vLLM).
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from .release import WRITTEN_FOR, VllmCompatError, check_vllm_version, installed_vllm_version

REQUIRED_LORA_REQUEST_FIELDS = ("lora_name", "lora_int_id", "lora_path")
REQUIRED_FROM_TENSORS_PARAMS = ("lora_model_id", "tensors", "peft_helper", "device", "dtype",
                                "model_vocab_size", "weights_mapper", "skip_prefixes")
REQUIRED_LOAD_ADAPTER_PARAMS = ("self", "lora_request")
REQUIRED_MANAGER_ATTRS = ("_adapter_manager", "lora_config", "vocab_size", "max_position_embeddings")
REQUIRED_CLIENT_ATTRS = ("outputs_queue", "utility_results", "resources")
ENGINE_ARGS = ("model", "dtype", "seed", "max_model_len", "max_num_seqs", "enable_lora", "max_loras",
               "max_cpu_loras", "max_lora_rank", "gpu_memory_utilization", "kv_cache_memory_bytes", "block_size",
               "max_num_batched_tokens", "enable_chunked_prefill",
               "worker_extension_cls", "logprobs_mode", "disable_log_stats", "use_tqdm_on_load")
# LoRA layers whose activation hotswap.py reproduces (exact classes: a subclass may override
# set_lora), with the methods they must resolve to; and the layers it only ever zeroes (lora-async
# adapters target linear modules only, validate.py).
WRITABLE_LORA_LAYERS = ("ColumnParallelLinearWithLoRA", "MergedColumnParallelLinearWithLoRA",
                        "QKVParallelLinearWithLoRA", "MergedQKVParallelLinearWithLoRA",
                        "RowParallelLinearWithLoRA", "ReplicatedLinearWithLoRA")
WRITABLE_SET_LORA = ("BaseLinearLayerWithLoRA.set_lora", "MergedColumnParallelLinearWithLoRA.set_lora")
ZEROED_LORA_LAYERS = ("VocabParallelEmbeddingWithLoRA", "LogitsProcessorWithLoRA")
# Statements hotswap.py reproduces, by the method that holds them.
# A version written straight into its slot has a LoRAModel that vLLM must not read until
# hotswap.py fills it: vLLM reads it only to activate it (`activate_adapter`), and frees an
# active version's slot only through the active cache's `deactivate_fn` (every removal of
# `AdapterLRUCache`, the LRU eviction in `LRUCacheLoRAModelManager.activate_adapter` included),
# which hotswap.py wraps to fill the model first. Layers read the stacked tensors at each call.
HOTSWAP_SOURCES = {
    "LoRAModelManager.__init__": ("self.modules", "self.lora_index_to_id", "self._active_adapters",
                                  "self.is_pooling_model", "self.lora_slots, self._deactivate_adapter"),
    "LoRAModelManager.activate_adapter": ("self._active_adapters[lora_id] = None",
                                          "self.lora_index_to_id[index] = lora_model.id",
                                          "lora_model = self._registered_adapters[lora_id]",
                                          "module.reset_lora(index)", "module.set_lora("),
    "LoRAModelManager.remove_adapter": ("self.deactivate_adapter(adapter_id)",),
    "LRUCacheLoRAModelManager.activate_adapter": ("self._active_adapters.remove_oldest()",
                                                  "super().activate_adapter(lora_id)"),
    "AdapterLRUCache.__init__": ("self.deactivate_fn = deactivate_fn",),
    "AdapterLRUCache._on_remove": ("self.deactivate_fn(key)",),
    "LRUCache.__delitem__": ("self._on_remove(key, value)",),
    "LRUCache.pop": ("self.__delitem__(key)",),
    "LRUCache.popitem": ("self.pop(",),
    "BaseLinearLayerWithLoRA._apply_lora_to_output": ("self.lora_a_stacked, self.lora_b_stacked",),
    "LoRAModel.__init__": ("self.id = lora_model_id", "self.loras", "self.modules_to_save"),
    "LoRAModel.from_lora_tensors": ("tensor.to(device=device, dtype=dtype)",),
    "LoRALayerWeights.__init__": ("self.lora_a = lora_a", "self.lora_b = lora_b", "self.scaling"),
    "LoRALayerWeights.optimize": ("self.lora_b *= self.scaling",),
    "PackedLoRALayerWeights.pack": ("[lora.lora_a if lora is not None else None for lora in loras]",),
    "PackedLoRALayerWeights.optimize": ("self.lora_b[i] *= self.scaling[i]",),
    "BaseLinearLayerWithLoRA.__init__": ("self.tp_size",),
    "BaseLinearLayerWithLoRA.create_lora_weights": ("self.lora_a_stacked = tuple(", "self.lora_b_stacked = tuple("),
    "BaseLinearLayerWithLoRA.reset_lora": ("self.lora_a_stacked[s_index][index] = 0",
                                           "self.lora_b_stacked[s_index][index] = 0"),
    "BaseLinearLayerWithLoRA.set_lora": ("self.reset_lora(index)", "[index, 0, : lora_a.shape[0], : lora_a.shape[1]]"),
    "MergedColumnParallelLinearWithLoRA.set_lora": ("self.reset_lora(index)",
                                                    "index, 0, : lora_a_i.shape[0], : lora_a_i.shape[1]"),
    "VocabParallelEmbeddingWithLoRA.reset_lora": ("self.lora_a_stacked[index] = 0", "self.lora_b_stacked[index] = 0"),
    "LogitsProcessorWithLoRA.reset_lora": ("self.lora_a_stacked[index] = 0", "self.lora_b_stacked[index] = 0"),
}
# vLLM 0.32 rewinds a seeded request's generator after a step that only prefilled part of its
# prompt, with a call only CUDA generators have: with chunked prefill a CPU engine dies on the
# first seeded request whose prompt a step cuts ("CPU Generator does not use offset"), so
# client.py builds CPU engines without it. Once this statement is gone, check whether it still must.
SEEDED_CHUNK_REWIND = ("GPUModelRunner._bookkeeping_sync", "gen.set_offset(gen.get_offset() - 4)")
ENV_VARS = ("VLLM_LOGGING_LEVEL", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND")
# The CPU punica ops cpu_lora_ops.py replaces in `vllm.lora.punica_wrapper.punica_cpu`, with the
# parameters each takes in vLLM's reference (`vllm.lora.ops.torch_ops`); ours take as many.
PUNICA_OPS = {"bgmv_shrink": 5, "bgmv_expand": 5, "bgmv_expand_slice": 7,
              "sgmv_shrink": 10, "sgmv_expand": 10, "sgmv_expand_slice": 12}


def check_serving_quantization(method: str, device: str, field: str = "generator.quantization") -> None:
    """vLLM can quantise the base it serves with `method` on `device`, together with LoRA; else
    one line. vLLM 0.32 has no bitsandbytes method at all (earlier releases had one, on CUDA)."""
    if method == "none":
        return
    if not device.startswith("cuda"):  # checked first: it needs no vLLM import
        raise VllmCompatError(f"{field} = {method!r} needs the generator on a CUDA GPU (it is on {device}); "
                              "leave it 'none'")
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    if method not in QUANTIZATION_METHODS:
        raise VllmCompatError(f"{field} = {method!r}: vLLM {installed_vllm_version()} cannot serve a {method} "
                              "base (it has no such quantization method); leave it 'none' (the learner can "
                              "still use model.quantization)")


def check_vllm_compat() -> str:
    """Check the version, then every internal in the table above; return vLLM's version, or raise
    VllmCompatError."""
    check_vllm_version()
    import vllm
    import vllm.envs
    from vllm import EngineArgs
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.request import LoRARequest
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager
    from vllm.v1.engine.core_client import MPClient, SyncMPClient
    from vllm.v1.engine.llm_engine import LLMEngine

    problems = lora_problems(LoRARequest, LoRAModel, LRUCacheWorkerLoRAManager, PEFTHelper)
    problems += engine_client_problems(SyncMPClient, MPClient)
    problems += engine_problems(LLMEngine, EngineArgs, vllm.envs)
    problems += runner_problems()
    problems += hotswap_problems()
    problems += punica_problems()
    try:
        engine_dead_error()
    except ImportError as exc:
        problems.append(f"vllm.v1.engine.exceptions.EngineDeadError is gone ({exc})")
    if problems:
        raise VllmCompatError(f"vLLM {vllm.__version__} changed internals that lora-async uses "
                              f"(written for {WRITTEN_FOR}): " + "; ".join(problems))
    return vllm.__version__


def lora_problems(request_cls: Any, model_cls: Any, manager_cls: Any, helper_cls: Any) -> list[str]:
    """What no longer matches in vLLM's LoRA loading classes (empty when all is as expected)."""
    problems: list[str] = []
    fields = getattr(request_cls, "__struct_fields__", ())
    problems += [f"LoRARequest has no field {name!r} (fields: {fields})"
                 for name in REQUIRED_LORA_REQUEST_FIELDS if name not in fields]
    from_tensors = getattr(model_cls, "from_lora_tensors", None)
    if from_tensors is None:
        problems.append("LoRAModel.from_lora_tensors is gone")
    else:
        params = inspect.signature(from_tensors).parameters
        problems += [f"LoRAModel.from_lora_tensors lost parameter {name!r}"
                     for name in REQUIRED_FROM_TENSORS_PARAMS if name not in params]
    load_adapter = getattr(manager_cls, "_load_adapter", None)
    if load_adapter is None:
        problems.append("WorkerLoRAManager._load_adapter is gone")
    elif tuple(inspect.signature(load_adapter).parameters) != REQUIRED_LOAD_ADAPTER_PARAMS:
        problems.append(f"WorkerLoRAManager._load_adapter signature is now "
                        f"{tuple(inspect.signature(load_adapter).parameters)}")
    if not hasattr(helper_cls, "from_dict") or not hasattr(helper_cls, "validate_legal"):
        problems.append("PEFTHelper.from_dict / validate_legal are gone")
    if not hasattr(manager_cls, "add_adapter") or not hasattr(manager_cls, "remove_adapter"):
        problems.append(f"{manager_cls.__name__} lost add_adapter/remove_adapter")
    source = _sources(manager_cls, ("__init__", "create_lora_manager"))
    problems += [f"WorkerLoRAManager no longer sets self.{attr}"
                 for attr in REQUIRED_MANAGER_ATTRS if f"self.{attr}" not in source]
    return problems


def engine_client_problems(sync_client_cls: Any, mp_client_cls: Any) -> list[str]:
    """What the dead-engine watch (`client.watch_engine_core`) relies on in the engine client."""
    source = "".join(inspect.getsource(vars(k)["__init__"]) for k in (sync_client_cls, mp_client_cls)
                     if inspect.isfunction(vars(k).get("__init__")))
    problems = [f"SyncMPClient/MPClient no longer set self.{attr}"
                for attr in REQUIRED_CLIENT_ATTRS if f"self.{attr}" not in source]
    if "engine_dead" not in inspect.getsource(mp_client_cls):
        problems.append("MPClient no longer tracks resources.engine_dead")
    if not callable(getattr(sync_client_cls, "shutdown", None)):
        problems.append("SyncMPClient.shutdown is gone")
    return problems


def engine_problems(engine_cls: Any, args_cls: Any, envs: Any) -> list[str]:
    """How `client.start_engine` builds and stops the engine."""
    problems = []
    params = inspect.signature(engine_cls.from_engine_args).parameters
    if "enable_multiprocessing" not in params:
        problems.append("LLMEngine.from_engine_args lost enable_multiprocessing")
    if "self.engine_core" not in inspect.getsource(engine_cls.__init__):
        problems.append("LLMEngine no longer sets self.engine_core")
    fields = getattr(args_cls, "__dataclass_fields__", {})
    problems += [f"EngineArgs lost {name!r}" for name in ENGINE_ARGS if name not in fields]
    known = getattr(envs, "environment_variables", {})
    problems += [f"vLLM no longer reads {name}" for name in ENV_VARS if name not in known]
    return problems


def runner_problems() -> list[str]:
    """The worker-side attributes `worker.LoraAsyncWorkerExtension` reaches through."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    problems = []
    if "self.lora_manager" not in inspect.getsource(LoRAModelRunnerMixin):
        problems.append("the model runner no longer keeps self.lora_manager")
    qualname, statement = SEEDED_CHUNK_REWIND
    if statement not in inspect.getsource(getattr(GPUModelRunner, qualname.split(".")[1])):
        problems.append(f"{qualname} no longer does `{statement}` (CPU engines may keep chunked prefill)")
    if not callable(getattr(GPUModelRunner, "reload_weights", None)):
        problems.append("the model runner lost reload_weights")
    return problems


def hotswap_problems(sources: dict[str, tuple[str, ...]] | None = None) -> list[str]:
    """What hotswap.py relies on in vLLM's LoRA manager, weights and layers (and torch)."""
    import vllm.lora.layers as layers
    import vllm.utils.torch_utils as torch_utils
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import LoRALayerWeights, PackedLoRALayerWeights
    from vllm.lora.model_manager import AdapterLRUCache, LoRAModelManager, LRUCacheLoRAModelManager
    from vllm.utils.cache import LRUCache

    owners = {cls.__name__: cls for cls in (LoRAModelManager, LRUCacheLoRAModelManager, AdapterLRUCache, LRUCache,
                                            LoRAModel, LoRALayerWeights, PackedLoRALayerWeights,
                                            BaseLinearLayerWithLoRA)}
    problems = [f"vllm.lora.layers has no {name}" for name in WRITABLE_LORA_LAYERS + ZEROED_LORA_LAYERS
                if not hasattr(layers, name)]
    if problems:
        return problems
    owners.update({name: getattr(layers, name) for name in WRITABLE_LORA_LAYERS + ZEROED_LORA_LAYERS})
    for qualname, statements in (HOTSWAP_SOURCES if sources is None else sources).items():
        owner, method = qualname.split(".")
        function = vars(owners[owner]).get(method) if owner in owners else None
        function = getattr(function, "__func__", function)  # classmethods
        if not inspect.isfunction(function):
            problems.append(f"{qualname} is gone")
            continue
        text = inspect.getsource(function)
        problems += [f"{qualname} no longer does `{s}`" for s in statements if s not in text]
    for name in WRITABLE_LORA_LAYERS:
        resolved = getattr(layers, name).set_lora.__qualname__
        if resolved not in WRITABLE_SET_LORA:
            problems.append(f"{name}.set_lora is now {resolved}")
        for method in ("reset_lora", "_apply_lora_to_output"):
            if getattr(getattr(layers, name), method).__qualname__ != f"BaseLinearLayerWithLoRA.{method}":
                problems.append(f"{name}.{method} is overridden")
    for name in ("add_adapter", "get_adapter", "remove_adapter", "list_adapters", "activate_adapter"):
        if not callable(getattr(LoRAModelManager, name, None)):
            problems.append(f"LoRAModelManager.{name} is gone")
    if not hasattr(torch_utils, "PIN_MEMORY"):
        problems.append("vllm.utils.torch_utils.PIN_MEMORY is gone")
    import torch

    problems += [f"torch.{name} is gone" for name in ("_foreach_copy_", "_foreach_zero_") if not hasattr(torch, name)]
    return problems


def punica_problems() -> list[str]:
    """What no longer matches in vLLM's CPU punica ops (`PUNICA_OPS`; empty when all is well)."""
    import vllm.lora.ops.torch_ops as reference
    import vllm.lora.punica_wrapper.punica_cpu as punica_cpu

    problems = []
    for name, count in PUNICA_OPS.items():
        if not hasattr(punica_cpu, name) or not hasattr(reference, name):
            problems.append(f"vllm.lora.punica_wrapper.punica_cpu no longer uses {name}")
            continue
        theirs = inspect.signature(getattr(reference, name)).parameters
        if len(theirs) != count:
            problems.append(f"vLLM's {name} now takes {list(theirs)}")
    return problems


def _sources(cls: Any, methods: tuple[str, ...]) -> str:
    text = ""
    for klass in cls.__mro__:
        for name in methods:
            if inspect.isfunction(vars(klass).get(name)):
                text += inspect.getsource(vars(klass)[name])
    return text


# ---------------------------------------------------------------- small adapters to internals


def engine_dead_error() -> type[BaseException]:
    """The exception vLLM raises once its engine process is gone."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return EngineDeadError


def lora_layer_classes() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """(layers whose activation hotswap.py writes itself, layers it only zeroes)."""
    import vllm.lora.layers as layers

    return (tuple(getattr(layers, n) for n in WRITABLE_LORA_LAYERS),
            tuple(getattr(layers, n) for n in ZEROED_LORA_LAYERS))


def pin_memory() -> bool:
    """Whether vLLM pins the CPU copies of adapters (it does where a GPU reads them)."""
    from vllm.utils.torch_utils import PIN_MEMORY

    return bool(PIN_MEMORY)


def configure_environment(engine_log: bool, cpu_bind: str | None) -> None:
    """The process environment vLLM reads when an engine starts.

    The engine core runs on the calling thread (lora-async drives it), or in a child process that
    `from_engine_args(enable_multiprocessing=True)` starts; `cpu_bind` pins that child's OpenMP
    threads. vLLM logs at ERROR unless asked (`run.engine_log`), or as the user's own
    VLLM_LOGGING_LEVEL says."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if engine_log else "ERROR")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if cpu_bind:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind


def shutdown_engine(engine: Any) -> None:
    """Stop the engine core (and its process, if it has one)."""
    engine.engine_core.shutdown()


def lora_slots(engine: Any) -> tuple[int, int]:
    """(max_loras, max_cpu_loras) the engine was really built with."""
    config = engine.vllm_config.lora_config
    return int(config.max_loras), int(config.max_cpu_loras)
