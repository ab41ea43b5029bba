"""Fakes at the orchestrator's protocol boundaries: a generator, a transport, a learner, a
byte tokenizer. They run in-process in milliseconds and record what the orchestrator did to
them, so tests can assert on the loop's behaviour (admission, lag, aborts, stop order)."""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from lora_async.adapter_version import AdapterVersion, served_name
from lora_async.buffer import TrainSample
from lora_async.generator.types import (Delivery, GenRequest, GenResult, GeneratorDead, GeneratorStats, GenStatus,
                                        PublishStats, Sample)
from lora_async.handoff import PackError
from lora_async.learner import StepStats
from lora_async.loss import LossStats
from lora_async.placement import Placement

LORA_KEY = "base_model.model.layer.lora_A.weight"


class ByteTokenizer:
    """Token ids are the UTF-8 bytes; no chat template (render_prompt uses plain text)."""

    chat_template = None

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode())}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode(errors="ignore")

    def batch_decode(self, batch: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids) for ids in batch]


@dataclass
class _Pending:
    request: GenRequest
    version: int | None
    on_done: Callable[[GenResult], None]


class FakeGenerator:
    """Completions start with "x" half of the time (a regex reward "^x" then varies within a
    group), or are what `reply(request, rng)` says. Each request takes `delay()` seconds on a
    timer thread, like an engine would. A `keep_partial` request stopped by `abort_older` comes
    back STOPPED with the first half of its reply. `served` records (prompt, version, reply ids).
    Deliveries load into the fake itself (its receiver)."""

    serving_dtype = None

    def __init__(self, delay: Callable[[], float], events: list[str], seed: int = 0,
                 reply: Callable[[GenRequest, random.Random], str] | None = None) -> None:
        self.stats = GeneratorStats()
        self.delay = delay
        self.events = events
        self.rng = random.Random(seed)
        self.reply = reply
        self.served: list[tuple[list[int], int | None, list[int], str]] = []
        self.live: dict[str, list[int]] = {}
        self.kept: set[tuple[str, int]] = set()  # frozen opponents kept registered (`keep`)
        self.requests: list[GenRequest] = []  # every request submitted, in order
        self.aborted: list[tuple[str, int]] = []  # (adapter, version) of each aborted request
        self.dead = False
        self._pending: dict[int, _Pending] = {}
        self._ids = 0
        self._lock = threading.Lock()

    def in_flight(self, adapter: str) -> int:
        """Training rollouts of `adapter` still generating (canary and eval probes not counted)."""
        with self._lock:
            return sum(1 for p in self._pending.values() if p.request.adapter == adapter and p.request.tag == "rollout")

    def submit(self, request: GenRequest, on_done: Callable[[GenResult], None]) -> None:
        if self.dead:
            on_done(GenResult.failed(request, GenStatus.ENGINE_DEAD, "engine died"))
            return
        with self._lock:
            self.requests.append(request)
            self._ids += 1
            rid = self._ids
            version = None
            if request.adapter is not None:  # a pinned version (a frozen opponent), else the newest
                version = request.version if request.version is not None else self.live[request.adapter][-1]
            self._pending[rid] = _Pending(request, version, on_done)
        timer = threading.Timer(self.delay(), self._finish, (rid,))
        timer.daemon = True
        timer.start()

    def _text(self, request: GenRequest) -> str:
        if self.reply is not None:
            return self.reply(request, self.rng)
        return ("x" if self.rng.random() < 0.5 else "y") + "abc"

    def _finish(self, rid: int) -> None:
        with self._lock:
            pending = self._pending.pop(rid, None)
            texts = [self._text(pending.request)[: pending.request.max_tokens]
                     for _ in range(pending.request.n)] if pending is not None else []
        if pending is None:
            return
        finish = ["length" if len(t) == pending.request.max_tokens else "stop" for t in texts]
        samples = [Sample(list(t.encode()), [-1.0] * len(t), f) for t, f in zip(texts, finish)]
        self.served.extend((list(pending.request.prompt_ids), pending.version, s.token_ids, "ok") for s in samples)
        self.stats.request_started()
        self.stats.tokens_drawn(sum(len(s.token_ids) for s in samples))
        self.stats.engine_busy(0.001)
        pending.on_done(GenResult(pending.request, pending.request.adapter, pending.version, samples))

    def validate(self, version: AdapterVersion, values: bool = True) -> None:
        pass

    def with_receiver(self, fn: Callable[["FakeGenerator"], Any]) -> Any:
        return fn(self)

    def register(self, delivery: Delivery["FakeGenerator"]) -> PublishStats:
        if self.dead:
            raise GeneratorDead("engine died")
        delivery.load(self, delivery.version)
        self.live.setdefault(delivery.adapter, []).append(delivery.version)
        return PublishStats(delivery.adapter, delivery.version, served_name(delivery.adapter, delivery.version),
                            delivery.version, delivery.nbytes, 1.0, transport=delivery.transport)

    def abort_older(self, adapter: str, min_version: int, tag: object) -> None:
        with self._lock:
            doomed = {rid: p for rid, p in self._pending.items() if p.request.adapter == adapter
                      and p.request.tag == tag and p.version is not None and p.version < min_version}
            for rid in doomed:
                del self._pending[rid]
        for p in doomed.values():
            self.aborted.append((adapter, p.version))  # type: ignore[arg-type]
            if p.request.keep_partial:
                half = self._text(p.request)[: max(1, p.request.max_tokens // 2)]
                ids = list(half.encode())
                self.served.append((list(p.request.prompt_ids), p.version, ids, "stopped"))
                p.on_done(GenResult(p.request, adapter, p.version, [Sample(ids, [-2.0] * len(ids), "abort")],
                                    GenStatus.STOPPED, "too stale"))
            else:
                p.on_done(GenResult.failed(p.request, GenStatus.ABORTED_STALE, "too stale", p.version))

    def live_versions(self, adapter: str) -> list[int]:
        return list(self.live.get(adapter, []))

    def keep(self, adapter: str, version: int) -> None:
        if version not in self.live.get(adapter, []):
            raise KeyError(f"{served_name(adapter, version)} is not live")
        self.kept.add((adapter, version))

    def let_go(self, adapter: str, version: int) -> None:
        self.kept.discard((adapter, version))

    def kill(self) -> None:
        """The engine dies: what runs ends with ENGINE_DEAD, nothing more registers."""
        self.dead = True
        with self._lock:
            pending, self._pending = self._pending, {}
        for p in pending.values():
            p.on_done(GenResult.failed(p.request, GenStatus.ENGINE_DEAD, "engine died"))

    def close(self) -> None:
        self.events.append("generator.close")
        with self._lock:
            pending, self._pending = self._pending, {}
        for p in pending.values():
            p.on_done(GenResult.failed(p.request, GenStatus.CLOSED, "closed"))


class FakeTransport:
    """Refuses the first transfer of each version in `damage` (a transient fault), and every
    transfer of the versions in `refuse` (a systematic one)."""

    name = "fake"

    def __init__(self, generator: FakeGenerator, events: list[str], damage: set[int] = frozenset(),
                 refuse: set[int] = frozenset(), publish_s: float = 0.0) -> None:
        self.generator, self.events, self.publish_s = generator, events, publish_s
        self.damage, self.refuse = set(damage), set(refuse)
        self.closed = False

    def publish(self, version: AdapterVersion) -> PublishStats:
        assert not self.closed, "published after the transport was closed"
        self.generator.validate(version)
        if version.version in self.damage | self.refuse:
            self.damage.discard(version.version)
            raise PackError(f"{version.served_name}: checksum mismatch (corrupted transfer)")
        time.sleep(self.publish_s)  # a hand-off that takes a while (an engine step to wait for)
        self.events.append(f"publish {version.served_name}")
        return self.generator.register(Delivery(version.adapter, version.version, version.nbytes, self.name,
                                                lambda receiver, int_id: None))

    def close(self) -> None:
        self.closed = True
        self.events.append("transport.close")


@dataclass
class _State:
    version: int = 0
    weight: torch.Tensor = field(default_factory=lambda: torch.zeros(1, 4))


@dataclass
class Trained:
    """What one fake learner step saw."""

    adapter: str
    learner_version: int
    lags: list[int]
    versions: list[int]
    in_flight: int  # requests of this adapter still generating when the step began
    samples: list[TrainSample] = field(default_factory=list)


class FakeLearner:
    """Every step is an update (a new version); takes `step_s` seconds (`pinned_step_s` while its
    thread is pinned to fewer cores than the process has, as on split cores); records what it saw."""

    def __init__(self, names: list[str], generator: FakeGenerator, events: list[str], step_s: float,
                 pinned_step_s: float | None = None) -> None:
        self.adapters = {name: _State() for name in names}
        self.generator, self.events, self.step_s = generator, events, step_s
        self.pinned_step_s = pinned_step_s
        self.trained: list[Trained] = []
        self.dropped_frac = 0.0  # the share of each step's tokens its loss reports clipped or masked

    def version(self, adapter: str) -> int:
        return self.adapters[adapter].version

    def adapter_tensors(self, adapter: str) -> dict[str, torch.Tensor]:
        return {LORA_KEY: self.adapters[adapter].weight.clone()}

    def peft_config(self, adapter: str) -> dict:
        return {"r": 1, "lora_alpha": 1}

    def adapter_version(self, adapter: str) -> AdapterVersion:
        return AdapterVersion(adapter, self.version(adapter), self.adapter_tensors(adapter), self.peft_config(adapter))

    def fits(self, samples: list[TrainSample]) -> bool:
        return True

    def train_step(self, adapter: str, samples: list[TrainSample]) -> StepStats:
        state = self.adapters[adapter]
        self.trained.append(Trained(adapter, state.version, [s.policy_lag for s in samples],
                                    [s.version for s in samples], self.generator.in_flight(adapter), samples))
        split = len(os.sched_getaffinity(0)) < os.cpu_count()  # type: ignore[operator]
        seconds = self.pinned_step_s if split and self.pinned_step_s is not None else self.step_s
        time.sleep(seconds)
        state.version += 1
        state.weight += 1
        tokens = sum(s.trained_tokens for s in samples)
        loss_stats = LossStats(tokens=tokens, clipped=round(self.dropped_frac * tokens))
        return StepStats(adapter, state.version, True, False, 0.0, 0.0, len(samples), tokens, 0, 1, loss_stats,
                         seconds)

    def snapshot_logprobs(self, version: AdapterVersion, samples: list[TrainSample]) -> list[list[float]]:
        return [list(s.logprobs) for s in samples]

    def close(self) -> None:
        self.events.append("learner closed")

    def state_dict(self, adapter: str) -> dict[str, Any]:
        self.events.append(f"checkpoint {adapter}@v{self.version(adapter)}")
        return {"version": self.version(adapter)}

    def load_state_dict(self, adapter: str, state: dict[str, Any]) -> None:
        self.adapters[adapter].version = int(state["version"])

    def load_adapter_tensors(self, adapter: str, tensors: dict[str, torch.Tensor]) -> None:
        self.adapters[adapter].weight = tensors[LORA_KEY].clone()


class FakeParts:
    """`orchestrator.Parts` made of the fakes above."""

    learner_placement = Placement("cpu", None)

    def __init__(self, names: list[str], gen_delay: Callable[[], float], step_s: float,
                 damage: set[int] = frozenset(), refuse: set[int] = frozenset(),
                 reply: Callable[[GenRequest, random.Random], str] | None = None, publish_s: float = 0.0,
                 pinned_step_s: float | None = None) -> None:
        self.events: list[str] = []
        self.fake_generator = FakeGenerator(gen_delay, self.events, reply=reply)
        self.fake_transport = FakeTransport(self.fake_generator, self.events, damage, refuse, publish_s)
        self.fake_learner = FakeLearner(names, self.fake_generator, self.events, step_s, pinned_step_s)

    def describe(self) -> str:
        return "fake parts"

    def tokenizer(self) -> ByteTokenizer:
        return ByteTokenizer()

    def generator(self) -> FakeGenerator:
        return self.fake_generator

    def transport(self, generator: Any) -> FakeTransport:
        return self.fake_transport

    def learner(self) -> FakeLearner:
        return self.fake_learner
