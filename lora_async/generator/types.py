"""The generator contract: what goes in, what comes out, and the `Generator` protocol every
backend implements (the in-process vLLM engine, remote servers, Ray replicas, test fakes).

A generator is generic in its *receiver*, what a version's `Delivery` is loaded into where the
generator registers versions (`receivers.py`: a vLLM engine's client, the servers' HTTP client,
the Ray router's fan-out), so a transport is typed against the receivers it can deliver to.

Failures are typed: a `GenResult` carries a `GenStatus`, a dead engine raises `GeneratorDead`.
Nothing downstream reads error texts to decide what happened.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Generic, Protocol, TypeVar

from ..errors import RunError

if TYPE_CHECKING:
    from ..adapter_version import AdapterVersion
    from ..base_recipe import Recipe

R_contra = TypeVar("R_contra", contravariant=True)  # a delivery loads into any receiver that offers what it calls
R_co = TypeVar("R_co", covariant=True)  # a generator whose receiver offers more is a generator of less
T = TypeVar("T")


class GeneratorDead(RunError):
    """The generator cannot generate or register anything any more (engine died, or closed)."""


class CannotKeep(RunError):
    """This generator cannot keep frozen versions (`Generator.keep`): the config check refuses a
    run that would need it first (`config.games`)."""


@dataclass(frozen=True)
class GenRequest:
    """One prompt, `n` samples, on one adapter (None = the base model)."""

    prompt_ids: list[int]
    adapter: str | None
    n: int = 1
    max_tokens: int = 32
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    tag: object = None  # opaque caller data, returned with the result (`abort_older` matches it)
    keep_partial: bool = False  # cut short by `abort_older`, return the tokens so far (STOPPED)
    version: int | None = None  # serve exactly this live version (None: the newest); set by a router
    group: object = None  # requests of one group share it: a multi-replica generator keeps them on one replica


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]  # the sampling logprob of each token, as vLLM drew it
    finish_reason: str  # "stop" | "length" | "abort"


class GenStatus(enum.Enum):
    """How a request ended."""

    OK = "ok"
    ABORTED_STALE = "aborted_stale"  # cut short by `abort_older`: it could only have been dropped as stale
    STOPPED = "stopped"  # cut short by `abort_older` with `keep_partial`: samples hold the tokens so far
    EVICTED = "evicted"  # its version was retired from a full engine while it ran
    REFUSED = "refused"  # it never started (no published version of its adapter, bad parameters)
    FAILED = "failed"  # this request failed (e.g. a server replica answered with an error)
    ENGINE_DEAD = "engine_dead"  # the engine died: nothing more will be generated
    CLOSED = "closed"  # the generator was closed while the request waited or ran


@dataclass
class GenResult:
    request: GenRequest
    adapter: str | None
    version: int | None  # the adapter version that produced every token of every sample
    samples: list[Sample]
    status: GenStatus = GenStatus.OK
    error: str | None = None  # what went wrong, for people (never parsed)

    @property
    def ok(self) -> bool:
        return self.status is GenStatus.OK and all(s.finish_reason != "abort" for s in self.samples)

    @classmethod
    def failed(cls, request: GenRequest, status: GenStatus, reason: str, version: int | None = None) -> "GenResult":
        return cls(request, request.adapter, version, [], status, reason)


@dataclass(frozen=True)
class Delivery(Generic[R_contra]):
    """A version on its way into a generator: what a transport hands over.

    `load(receiver, int_id)` runs where the generator registers versions (`Generator.register`),
    with the generator's receiver (`receivers.py`): for vLLM on the engine thread, between steps,
    with the engine client; for servers with the HTTP client; for Ray with the router's fan-out.
    It must leave the receiver holding the version under `int_id`, or raise; then nothing is
    registered and the live versions keep serving. It returns the milliseconds of it spent
    waiting for engines to finish a step (Ray replicas), or None.
    """

    adapter: str
    version: int
    nbytes: int
    transport: str
    load: Callable[[R_contra, int], float | None]
    started: float = field(default_factory=time.perf_counter)  # when the tensors were ready
    path: str | None = None  # a PEFT directory the engine may reload this version from


@dataclass
class PublishStats:
    adapter: str
    version: int
    served_name: str
    int_id: int
    bytes: int
    ms: float  # the work: tensors ready -> registered, less the wait below
    retired: list[str] = field(default_factory=list)
    wait_ms: float = 0.0  # waiting for the engine to finish its current step (never a pause)
    transport: str = "inproc"


class GeneratorStats:
    """What every generator counts; updated from several threads, so under a lock. Each counter
    has its own method (a replica-fleet's extra counters: `ray.health.RayStats`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.aborted = 0
        self.tokens = 0
        self.busy_s = 0.0  # time the engine spent generating
        self.steps = 0.0  # engine steps (an in-process engine, or replicas' averaged)
        self.running = 0.0  # sequences in flight, summed over engine steps (mean batch = running / steps)
        self.rejected_versions = 0

    def request_started(self) -> None:
        with self._lock:
            self.requests += 1

    def tokens_drawn(self, tokens: int) -> None:
        with self._lock:
            self.tokens += tokens

    def requests_aborted(self, count: int) -> None:
        with self._lock:
            self.aborted += count

    def engine_busy(self, seconds: float, steps: float = 0.0, running: float = 0.0) -> None:
        """`seconds` of generating, over `steps` engine steps with `running` requests summed over them."""
        with self._lock:
            self.busy_s += seconds
            self.steps += steps
            self.running += running

    def version_rejected(self) -> None:
        with self._lock:
            self.rejected_versions += 1

    def replica_figures(self) -> dict[str, Any]:
        """A generator with replicas: its per-replica totals for the metrics; empty for one engine."""
        return {}


class Generator(Protocol[R_co]):
    """A multi-LoRA generator that serves several versions of each adapter at once.

    Versions reach it through a transport (`sync.transports`): the transport calls `validate`,
    moves the tensors, and hands a `Delivery` to `register`, which loads it into the generator's
    receiver `R_co` (`receivers.py`).
    """

    @property
    def stats(self) -> GeneratorStats: ...

    @property
    def serving_dtype(self) -> str | None:
        """The dtype the engine serves adapters in (a `dtypes` name), what packing transports
        cast to; None where the engine casts what it loads itself (remote servers)."""

    def submit(self, request: GenRequest, on_done: Callable[[GenResult], None]) -> None:
        """Queue a request; `on_done` runs (on the generator's thread) when it ends, in any way."""

    def validate(self, version: AdapterVersion, values: bool = True) -> None:
        """Refuse a version that cannot be served (AdapterError, RegistryError); counts refusals.
        `values=False`: the transport checks the values itself, on the copy it makes."""

    def register(self, delivery: Delivery[R_co]) -> PublishStats:
        """Register a delivered version beside the live ones; blocks until requests can name it."""

    def with_receiver(self, fn: Callable[[R_co], T]) -> T:
        """Run `fn(receiver)` where versions are registered (the vLLM engine thread between
        steps; the servers' client; the Ray router) and return its result: what a transport
        sets up with the receiver before any delivery (a process group's members)."""

    def abort_older(self, adapter: str, min_version: int, tag: object) -> None:
        """Stop requests tagged `tag` of `adapter` on versions below `min_version`, without waiting;
        they end with `GenStatus.ABORTED_STALE`, or `STOPPED` with the tokens drawn so far when the
        request asked to `keep_partial`. A backend that cannot abort lets them finish."""

    def live_versions(self, adapter: str) -> list[int]:
        """Versions of `adapter` registered right now."""

    def keep(self, adapter: str, version: int) -> None:
        """Keep a live version registered, outside the staleness window's retirement, until
        `let_go`: a frozen opponent (a league's past version, a pinned `main@v0`). Requests name it
        with `GenRequest.version`. A generator that cannot keep versions raises CannotKeep."""

    def let_go(self, adapter: str, version: int) -> None:
        """Stop keeping a version; it is retired once drained if the window has left it."""

    def close(self) -> None: ...


class LearnerBase(Protocol):
    """The learner's dequantised base, for a run that serves it (`learner.served_base.BaseBuilder`):
    its recipe, and what builds it from the checkpoint on whichever node calls it (a Ray replica
    on a node without the learner's copy). A generator is handed it, and imports no learner."""

    @property
    def recipe(self) -> Recipe: ...

    def __call__(self, model_dir: Path) -> Path: ...


def hand_back(on_done: Callable[[GenResult], None], result: GenResult) -> None:
    """Give a result to its callback; a callback that raises is logged, and the generator goes on."""
    try:
        on_done(result)
    except Exception:
        logging.getLogger(__name__).exception("generation callback failed")


def generate_async(generator: Generator[object]) -> Callable[[GenRequest], Awaitable[GenResult]]:
    """Adapt a callback generator (`submit(req, on_done)`) to `await generate(req)`."""

    def generate(request: GenRequest) -> Awaitable[GenResult]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[GenResult] = loop.create_future()

        def settle(result: GenResult) -> None:
            if not future.done():
                future.set_result(result)

        def done(result: GenResult) -> None:
            loop.call_soon_threadsafe(settle, result)

        generator.submit(request, done)
        return future

    return generate
