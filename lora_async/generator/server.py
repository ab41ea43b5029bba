"""The `server` backend: generation on remote OpenAI-compatible `vllm serve` replicas.

Same contract as the in-process engine (`types.Generator`): requests name an adapter and come
back with the version that produced them, token ids and per-token sampling logprobs. Versions
are served under `<name>@v<k>` names, loaded on every replica by the `http` transport
(`sync/http.py`) and unloaded once drained and out of the staleness window.

The servers must be started with runtime LoRA updating and processed logprobs, e.g.
`lora-async serve MODEL --allow-updates` (see `serve.py`).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..sync.http import ServerError, ServerSync
from .registry import VersionRegistry
from .types import AdapterVersion, GenRequest, GenResult, GeneratorClock, PublishStats, Sample
from .validate import BaseShapes, StructureCheck, check_finite_all

log = logging.getLogger(__name__)

MAX_CONCURRENT_REQUESTS = 64  # HTTP requests in flight across all replicas
REGISTRY_CAPACITY = 1 << 20  # the servers size their own LoRA caches and reload from the directory


class ServerGenerator(GeneratorClock):
    def __init__(self, sync: ServerSync, model_dir: Path, max_staleness: int, max_lora_rank: int,
                 request_timeout_s: float = 600.0) -> None:
        from transformers import AutoTokenizer

        self.sync = sync
        self.request_timeout_s = request_timeout_s
        self.registry = VersionRegistry(max_staleness, REGISTRY_CAPACITY)
        self.check_structure = StructureCheck(BaseShapes.from_model_dir(model_dir), max_lora_rank)
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self._lock = threading.RLock()
        self._replicas = itertools.cycle(sync.urls)
        self._pool = concurrent.futures.ThreadPoolExecutor(MAX_CONCURRENT_REQUESTS, "lora-async-http")
        self._closed = False
        self._in_flight = 0
        self._busy_since = 0.0
        self._start_clock()
        self.base_model = self._check_servers()

    def _check_servers(self) -> str:
        """Every replica answers /v1/models and serves the same base model; returns its name."""
        names = set()
        for url in self.sync.urls:
            try:
                models = self.sync.get(url, "/v1/models")["data"]
            except (ServerError, KeyError, ValueError) as exc:
                raise ServerError(f"vLLM server {url} is not reachable: {exc}") from exc
            names.add(next(m["id"] for m in models if not m.get("parent")))
        if len(names) != 1:
            raise ServerError(f"the servers serve different base models: {sorted(names)}")
        return names.pop()

    # ---------------------------------------------------------------- generation
    def submit(self, request: GenRequest, on_done: Callable[[GenResult], None]) -> None:
        if self._closed:
            on_done(GenResult(request, request.adapter, None, [], error="generator closed"))
            return
        with self._lock:
            try:
                live = self.registry.acquire(request.adapter) if request.adapter is not None else None
            except Exception as exc:
                on_done(GenResult(request, request.adapter, None, [], error=f"rejected: {exc}"))
                return
            url = next(self._replicas)
            self._enter()
        self.stats["requests"] += 1
        self._pool.submit(self._run_request, url, request, live, on_done)

    def _run_request(self, url: str, request: GenRequest, live: Any, on_done: Callable[[GenResult], None]) -> None:
        payload = {
            "model": live.vllm_name if live is not None else self.base_model,
            "prompt": list(request.prompt_ids),
            "n": request.n,
            "max_tokens": request.max_tokens,
            "min_tokens": request.min_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "logprobs": 0,
            "return_token_ids": True,
        }
        if request.seed is not None:
            payload["seed"] = request.seed
        samples: list[Sample] = []
        error = None
        try:
            body = self.sync.post(url, "/v1/completions", payload, retry=False,
                                  timeout_s=self.request_timeout_s).json()
            for choice in sorted(body["choices"], key=lambda c: c["index"]):
                ids = list(choice["token_ids"])
                logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
                samples.append(Sample(ids, logprobs, choice.get("finish_reason") or "stop"))
                self.stats["tokens"] += len(ids)
        except (ServerError, KeyError, TypeError, ValueError) as exc:
            error = f"server {url}: {exc}"
            samples = []
        with self._lock:
            self._leave()
            if live is not None:
                self.registry.release(live)
                if live.in_flight == 0 and self.registry.outside_window(live) and not self._closed:
                    self._retire(live)
        try:
            on_done(GenResult(request, request.adapter, live.version if live is not None else None, samples, error))
        except Exception:
            log.exception("generation callback failed")

    def _enter(self) -> None:
        if self._in_flight == 0:
            self._busy_since = time.perf_counter()
        self._in_flight += 1

    def _leave(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self.stats["busy_s"] += time.perf_counter() - self._busy_since

    # ---------------------------------------------------------------- versions
    def publish(self, version: AdapterVersion) -> PublishStats:
        """Write the version's PEFT directory, load it on every replica, retire drained ones."""
        started = time.perf_counter()
        name = f"{version.adapter}@v{version.version}"
        try:
            self.check_structure(version)
            check_finite_all(name, list(version.tensors.values()))
            with self._lock:
                self.registry.check_new(version.adapter, version.version)
        except Exception:
            self.stats["rejected_versions"] += 1
            raise
        path, size = self.sync.write(name, version.tensors, version.peft_config)
        try:
            self.sync.load(name, path)
        except Exception:
            self.sync.remove(name)
            raise
        with self._lock:
            live = self.registry.add(version.adapter, version.version, self.registry.reserve_id())
            live.path = str(path)
            retired = [self._retire(old) for old in self.registry.retirable()]
        return PublishStats(version.adapter, version.version, name, live.int_id, size,
                            (time.perf_counter() - started) * 1000, retired, transport="http")

    def _retire(self, live: Any) -> str:
        self.registry.remove(live)
        self.sync.unload(live.vllm_name)
        return live.vllm_name

    def live_versions(self, adapter: str) -> list[int]:
        with self._lock:
            return self.registry.versions(adapter)

    def served_names(self) -> list[str]:
        """What every replica lists as loaded adapters (ground truth, for checks)."""
        return [sorted(m["id"] for m in self.sync.get(url, "/v1/models")["data"] if m.get("parent"))
                for url in self.sync.urls]

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def close(self) -> None:
        """Wait for requests in flight, then unload every version this run loaded."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock:
            for live in self.registry.all_live():
                self._retire(live)
        self.sync.close()

    def __enter__(self) -> "ServerGenerator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
