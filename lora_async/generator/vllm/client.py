"""`EngineClient`: lora-async's one handle on a vLLM engine, and the generator's receiver.

It starts the engine (in this process, or its core in a child process), submits and steps
requests, and calls lora-async's worker extension (`worker.py`) through typed methods: the RPC
names come from the extension's own methods, so a rename fails at import, not at run time.
Used only from the generator's engine thread (`engine.VllmGenerator`), which owns it; it is what
a delivery loads into there (`receivers.EngineReceiver`).

A packed version's `PackMeta` crosses `collective_rpc` as plain data (`to_dict`): vLLM decodes
RPC arguments without custom types, and the worker rebuilds it (`from_dict`). Errors are typed
on the way out: a dead engine process becomes `GeneratorDead`, a transfer the worker refused
becomes `PackError` (the worker replies with data, see worker.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ...handoff import PackError
from ...placement import format_cpus
from ..types import GenRequest, GeneratorDead, Sample
from ..validate import AdapterError
from . import compat
from .worker import LoraAsyncWorkerExtension as Worker

if TYPE_CHECKING:
    import torch

    from ...handoff import PackMeta
    from ...placement import Placement
    from ..spec import EngineSpec

EXTENSION = f"{Worker.__module__}.{Worker.__qualname__}"
WATCH_POLL_S = 0.5  # how often the dead-engine watch looks at vLLM's flag


@dataclass(frozen=True)
class LoraRef:
    """A live version as a request names it."""

    name: str
    int_id: int
    path: str


class EngineClient:
    def __init__(self, engine: Any, watch_stop: threading.Event | None = None, in_process: bool = True) -> None:
        self.engine = engine  # vLLM's LLMEngine (tests and benchmarks may reach it directly)
        self.in_process = in_process  # False: the engine core and its worker run in a child process
        self._watch_stop = watch_stop
        self._dead_error = compat.engine_dead_error()

    @classmethod
    def start(cls, spec: "EngineSpec", placement: "Placement") -> "EngineClient":
        """Build the engine `spec` describes on `placement`; checks vLLM's internals first."""
        on_cpu = placement.device == "cpu"
        bind = format_cpus(placement.cpus) if spec.separate_process and on_cpu and placement.cpus else None
        compat.configure_environment(spec.engine_log, bind)
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        from .cpu_lora_ops import install_fast_cpu_lora_ops

        compat.check_vllm_compat()
        compat.check_serving_quantization(spec.quantization, placement.device)
        if on_cpu and spec.fast_cpu_lora and not spec.separate_process:
            install_fast_cpu_lora_ops()
        args = EngineArgs(
            model=str(spec.model_dir), dtype=spec.dtype, seed=spec.seed, max_model_len=spec.max_model_len,
            max_num_seqs=spec.max_num_seqs, enable_lora=True, max_loras=spec.max_loras,
            max_cpu_loras=spec.max_cpu_loras, max_lora_rank=spec.max_lora_rank,
            gpu_memory_utilization=spec.memory_fraction,
            kv_cache_memory_bytes=int(spec.kv_cache_gb * (1 << 30)) if spec.kv_cache_gb else None,
            worker_extension_cls=EXTENSION, logprobs_mode="processed_logprobs", disable_log_stats=True,
            use_tqdm_on_load=spec.engine_log,  # "Loading safetensors checkpoint shards" only when asked
            **({"block_size": spec.block_size} if spec.block_size else {}),
            **batching(spec, on_cpu),
            **({"quantization": spec.quantization} if spec.quantization != "none" else {}),
        )
        engine = LLMEngine.from_engine_args(args, enable_multiprocessing=spec.separate_process)
        watch_stop = None
        if spec.separate_process:
            watch_stop = threading.Event()
            watch_engine_core(engine, watch_stop)
        client = cls(engine, watch_stop, in_process=not spec.separate_process)
        if spec.separate_process and on_cpu and spec.fast_cpu_lora:
            client._rpc(Worker.lora_async_install_fast_ops)
        return client

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, request: GenRequest, lora: LoraRef | None) -> None:
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import RequestOutputKind

        # A request that may be stopped and continued streams its tokens (DELTA), so what it
        # drew before an abort is known; the others report once, when finished.
        kind = RequestOutputKind.DELTA if request.keep_partial else RequestOutputKind.FINAL_ONLY
        params = SamplingParams(n=request.n, max_tokens=request.max_tokens, min_tokens=request.min_tokens,
                                temperature=request.temperature, top_p=request.top_p, seed=request.seed,
                                logprobs=0, output_kind=kind)
        lora_request = LoRARequest(lora.name, lora.int_id, lora.path) if lora is not None else None
        self.engine.add_request(request_id, {"prompt_token_ids": list(request.prompt_ids)}, params,
                                lora_request=lora_request)

    def step(self) -> list[tuple[str, dict[int, Sample], bool]]:
        """One engine step: (request id, samples by completion index, finished) for every output.
        Streaming (`keep_partial`) requests report the tokens drawn in this step; the others
        report once, finished, with all of them."""
        reports = []
        for output in self.engine.step():
            samples = {}
            for completion in output.outputs:
                ids = list(completion.token_ids)
                logprobs = [step[token].logprob for step, token in zip(completion.logprobs or [], ids)]
                samples[completion.index] = Sample(ids, logprobs, completion.finish_reason or "")
            reports.append((output.request_id, samples, bool(output.finished)))
        return reports

    def busy(self) -> bool:
        return bool(self.engine.has_unfinished_requests())

    def abort(self, request_ids: list[str]) -> None:
        self.engine.abort_request(request_ids)

    def tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    # ---------------------------------------------------------------- adapters (worker extension)
    def add_tensors(self, int_id: int, tensors: dict[str, torch.Tensor], peft_config: dict[str, Any],
                    borrowed: bool = False, flat: torch.Tensor | None = None, structure: tuple | None = None) -> None:
        """`borrowed`: the tensors stay the caller's (an in-process engine); the worker copies
        them and checks their values on that copy (a refusal raises AdapterError). `flat`: the
        buffer they are views of, in order (`AdapterVersion.flat`), copied with one op.
        `structure`: their `AdapterVersion.structure` (the worker's key for its hot-swap plans)."""
        self._registered(self._rpc(Worker.lora_async_add_tensors, int_id, tensors, peft_config, borrowed, flat,
                                   structure))

    def add_shm(self, int_id: int, segment: str, meta: PackMeta) -> None:
        self._registered(self._rpc(Worker.lora_async_add_shm, int_id, segment, meta.to_dict()))

    def add_ipc(self, int_id: int, handle: bytes, meta: PackMeta) -> None:
        self._registered(self._rpc(Worker.lora_async_add_ipc, int_id, handle, meta.to_dict()))

    def join_group(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> list[int]:
        return self._rpc(Worker.lora_async_join_group, host, port, world_size, backend, timeout_s)

    def add_broadcast(self, int_id: int, meta: PackMeta) -> None:
        self._registered(self._rpc(Worker.lora_async_add_broadcast, int_id, meta.to_dict()))

    def add_dir(self, name: str, int_id: int, path: str) -> None:
        """Let vLLM load a PEFT directory itself (its own loader, as `vllm serve` would)."""
        from vllm.lora.request import LoRARequest

        self.engine.add_lora(LoRARequest(name, int_id, path))

    def remove(self, int_id: int) -> None:
        self._rpc(Worker.lora_async_remove, int_id)

    def hotswap_stats(self) -> dict[str, int]:
        """The (first) worker's registration counters (hotswap.py): built, recycled, activations."""
        return self._rpc(Worker.lora_async_hotswap_stats)[0]

    def lora_ids(self) -> list[int]:
        """The int ids the (first) worker holds registered: ground truth, not our registry."""
        return self._rpc(Worker.lora_async_list)[0]

    def workers(self) -> int:
        return len(self._rpc(Worker.lora_async_list))

    def worker_pids(self) -> list[int]:
        return self._rpc(Worker.lora_async_pid)

    def load_base_weights(self, state_dict: dict) -> int:
        return self._rpc(Worker.lora_async_load_base_weights, state_dict)[0]

    def lora_slots(self) -> tuple[int, int]:
        """(max_loras, max_cpu_loras) the engine was built with."""
        return compat.lora_slots(self.engine)

    def shutdown(self) -> None:
        if self._watch_stop is not None:
            self._watch_stop.set()
        compat.shutdown_engine(self.engine)

    # ---------------------------------------------------------------- plumbing
    def _rpc(self, method: Callable[..., Any], *args: Any) -> list:
        try:
            return self.engine.collective_rpc(method.__name__, args=args)
        except self._dead_error as exc:
            raise GeneratorDead(f"the vLLM engine died: {exc}") from exc

    @staticmethod
    def _registered(replies: list[dict]) -> None:
        invalid = [reply["invalid"] for reply in replies if "invalid" in reply]
        if invalid:
            raise AdapterError(invalid[0])
        refused = [reply["rejected"] for reply in replies if "rejected" in reply]
        if refused:
            raise PackError(refused[0])


def batching(spec: EngineSpec, on_cpu: bool) -> dict[str, Any]:
    """How the engine batches prefills. On a CPU, without chunked prefill: vLLM 0.32 rewinds a
    seeded request's generator after a step that cut its prompt, with a call only CUDA
    generators have (`compat.SEEDED_CHUNK_REWIND`), and every rollout is seeded. A whole prompt
    must then fit one step, so the step's token budget is at least `max_model_len`."""
    args: dict[str, Any] = {}
    if spec.max_batched_tokens:
        args["max_num_batched_tokens"] = spec.max_batched_tokens
    if on_cpu:
        args["enable_chunked_prefill"] = False
        if spec.max_batched_tokens:
            args["max_num_batched_tokens"] = max(spec.max_batched_tokens, spec.max_model_len)
    return args


def watch_engine_core(engine: Any, stopped: threading.Event) -> threading.Thread:
    """Unblock the engine's callers when vLLM's engine-core process dies (multiprocess mode).

    Why: vLLM 0.32's `SyncMPClient` notices a dead engine core (its monitor thread sets
    `resources.engine_dead`) but leaves `get_output()` blocked on its queue and utility calls
    (`collective_rpc`) waiting on their futures forever. This thread waits for that flag, then
    puts an `EngineDeadError` on the output queue and fails the pending utility futures, so
    `step()` and the RPCs raise. It ends when `stopped` is set.
    """
    dead_error = compat.engine_dead_error()
    core = engine.engine_core
    missing = [a for a in compat.REQUIRED_CLIENT_ATTRS if not hasattr(core, a)]
    if missing or not hasattr(core.resources, "engine_dead"):
        raise compat.VllmCompatError(f"vLLM's {type(core).__name__} no longer has "
                                     f"{missing or ['resources.engine_dead']}: a dead engine would go unnoticed")

    def watch() -> None:
        while not stopped.wait(WATCH_POLL_S):
            if core.resources.engine_dead:
                core.outputs_queue.put_nowait(dead_error())
                for future in list(core.utility_results.values()):
                    if not future.done():
                        future.set_exception(dead_error())
                return

    thread = threading.Thread(target=watch, name="lora-async-engine-watch", daemon=True)
    thread.start()
    return thread
