"""`ServerGenerator`: generation on remote OpenAI-compatible `vllm serve` replicas.

Same contract as the in-process engine (`types.Generator`): requests name an adapter and come
back with the version that produced them, token ids and per-token sampling logprobs. Versions
are served under `<name>@v<k>`: the `http` transport writes each one as a PEFT directory and its
delivery loads it on every replica through this generator's `ServerClient` (its receiver); a
version is unloaded everywhere once it is drained and out of the staleness window. Requests go
to the replicas in turn. A remote request cannot be aborted: `abort_older` lets it finish (the buffer
then drops its group as stale).

Start the servers with `lora-async server MODEL` (runtime LoRA loading, processed logprobs).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar

from ...adapter_version import AdapterVersion, served_name
from ...staleness import StalenessWindow
from ...tokenizer import Tokenizer
from ..registry import LiveVersion, VersionRegistry, register_version
from ..types import (CannotKeep, Delivery, GenRequest, GenResult, GeneratorStats, GenStatus, PublishStats, Sample,
                     hand_back)
from ..validate import BaseShapes, VersionCheck
from .client import ServerClient, ServerError

if TYPE_CHECKING:
    from ...config import ServerGeneratorConfig, TrainConfig

T = TypeVar("T")


MAX_CONCURRENT_REQUESTS = 64  # HTTP requests in flight across all replicas
REGISTRY_CAPACITY = 1 << 20  # the servers size their own LoRA caches and reload from the directory


class ServerGenerator:
    """Remote replicas behind one `types.Generator[ServerClient]`."""

    serving_dtype = None  # each server casts the PEFT directories it loads itself

    def __init__(self, client: ServerClient, model_dir: Path, window: StalenessWindow, max_lora_rank: int,
                 request_timeout_s: float = 600.0) -> None:
        from transformers import AutoTokenizer

        self.client = client
        self.request_timeout_s = request_timeout_s
        self.stats = GeneratorStats()
        self.registry = VersionRegistry(window, REGISTRY_CAPACITY)
        self._lock = threading.RLock()  # the registry and the busy clock, shared by request threads
        self.check = VersionCheck(BaseShapes.from_model_dir(model_dir), max_lora_rank, self.registry, self.stats,
                                  self._lock)
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self._replicas = itertools.cycle(client.urls)
        self._pool = concurrent.futures.ThreadPoolExecutor(MAX_CONCURRENT_REQUESTS, "lora-async-http")
        self._closed = False
        self._in_flight = 0
        self._busy_since = 0.0
        self.base_model = self._check_servers()

    @classmethod
    def from_config(cls, config: TrainConfig, gen: ServerGeneratorConfig, model_dir: Path,
                    base_command: str | None = None) -> "ServerGenerator":
        """The generator a run's `[generator]` (type "server", `gen`) describes. `base_command`:
        the run serves a base it builds (`model_dir`), which servers cannot build; each must serve
        it already (`check_base`), else this says how to start one on it."""
        generator = cls(ServerClient(gen.urls, gen.api_key), model_dir, config.buffer.window,
                        config.max_lora_rank, gen.request_timeout_s)
        if base_command is not None:
            try:
                generator.check_base(model_dir, base_command)
            except Exception:
                generator.close()
                raise
        return generator

    def _check_servers(self) -> str:
        """Every replica answers /v1/models and serves the same base model; returns its name."""
        names = set()
        for url in self.client.urls:
            try:
                models = self.client.served(url)
            except (ServerError, KeyError, ValueError) as exc:
                raise ServerError(f"vLLM server {url} is not reachable: {exc}") from exc
            names.add(next(m["id"] for m in models if not m.get("parent")))
        if len(names) != 1:
            raise ServerError(f"the servers serve different base models: {sorted(names)}")
        return names.pop()

    def check_base(self, expected: Path, command: str) -> None:
        """Every server serves `expected` (the learner's dequantised base, `learner.served_base`),
        judged by the directory name vLLM reports as the base model's root: entries are named by
        their content hash, so the name matches on any machine that built the same base."""
        for url in self.client.urls:
            models = self.client.served(url)
            root = str(next(m for m in models if not m.get("parent")).get("root") or "")
            if Path(root).name != expected.name:
                raise ServerError(
                    f"generator.base = 'learner': the server at {url} serves {root or 'an unnamed base'}, not the "
                    f"learner's quantised base ({expected.name}); start it with `{command}`, or set "
                    "generator.base = 'original'")

    # ---------------------------------------------------------------- the Generator protocol
    def submit(self, request: GenRequest, on_done: Callable[[GenResult], None]) -> None:
        if self._closed:
            on_done(GenResult.failed(request, GenStatus.CLOSED, "generator closed"))
            return
        with self._lock:
            try:
                live = self.registry.acquire(request.adapter) if request.adapter is not None else None
            except Exception as exc:
                on_done(GenResult.failed(request, GenStatus.REFUSED, f"refused: {exc}"))
                return
            url = next(self._replicas)
            if self._in_flight == 0:
                self._busy_since = time.perf_counter()
            self._in_flight += 1
        self.stats.request_started()
        self._pool.submit(self._run_request, url, request, live, on_done)

    def validate(self, version: AdapterVersion, values: bool = True) -> None:
        self.check(version, values)

    def register(self, delivery: Delivery[ServerClient]) -> PublishStats:
        """Load a delivered version on every replica (`delivery.load(client, int_id)`)."""
        return register_version(self.registry, delivery, self.client, self.stats, retire=self._retire, lock=self._lock)

    def with_receiver(self, fn: Callable[[ServerClient], T]) -> T:
        return fn(self.client)

    def abort_older(self, adapter: str, min_version: int, tag: object) -> None:
        """HTTP requests in flight cannot be cut short; they finish and their groups are dropped."""

    def live_versions(self, adapter: str) -> list[int]:
        with self._lock:
            return self.registry.versions(adapter)

    def keep(self, adapter: str, version: int) -> None:
        raise CannotKeep(f"remote servers cannot keep frozen versions yet (needed for {served_name(adapter, version)})")

    def let_go(self, adapter: str, version: int) -> None:
        """Nothing is kept here."""

    def close(self) -> None:
        """Wait for requests in flight, then unload every version this run loaded."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock:
            for live in self.registry.all_live():
                self._retire(live)
        self.client.close()

    # ---------------------------------------------------------------- more
    def served_names(self) -> list[list[str]]:
        """What every replica lists as loaded adapters (ground truth, for checks)."""
        return [sorted(m["id"] for m in self.client.served(url) if m.get("parent")) for url in self.client.urls]

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def __enter__(self) -> "ServerGenerator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- internals
    def _run_request(self, url: str, request: GenRequest, live: LiveVersion | None,
                     on_done: Callable[[GenResult], None]) -> None:
        payload = {"model": live.served_name if live is not None else self.base_model,
                   "prompt": list(request.prompt_ids), "n": request.n, "max_tokens": request.max_tokens,
                   "min_tokens": request.min_tokens, "temperature": request.temperature, "top_p": request.top_p,
                   "logprobs": 0, "return_token_ids": True}
        if request.seed is not None:
            payload["seed"] = request.seed
        samples: list[Sample] = []
        status, error = GenStatus.OK, None
        try:
            body = self.client.post(url, "/v1/completions", payload, retry=False,
                                    timeout_s=self.request_timeout_s).json()
            for choice in sorted(body["choices"], key=lambda c: c["index"]):
                ids = list(choice["token_ids"])
                logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
                samples.append(Sample(ids, logprobs, choice.get("finish_reason") or "stop"))
        except (ServerError, KeyError, TypeError, ValueError) as exc:
            status, error, samples = GenStatus.FAILED, f"server {url}: {exc}", []
        self.stats.tokens_drawn(sum(len(s.token_ids) for s in samples))
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self.stats.engine_busy(time.perf_counter() - self._busy_since)
            if live is not None and self.registry.release(live) and not self._closed:
                self._retire(live)
        hand_back(on_done, GenResult(request, request.adapter, live.version if live is not None else None, samples,
                                     status, error))

    def _retire(self, live: LiveVersion) -> str:
        self.registry.remove(live)
        self.client.unload(live.served_name)
        return live.served_name
