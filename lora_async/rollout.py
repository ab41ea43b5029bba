"""The rollout-source contract: what the orchestrator and `evaluate` ask of a task.

A task of any kind is a `RolloutSource`: a single-turn problem set (`tasks.source`) sends one
request of `samples_per_prompt` completions per group and scores them; an environment
(`envs.source`) plays as many episodes. Callers never ask which kind they hold: they get a
`GroupRollout` per training group, an `EvalResult` per held-out evaluation, and the counters in
`stats`. `tasks.make_source` builds the source of an adapter.

How episodes end and what they come to (`Outcome`, `EpisodeStats`) are `outcomes.py`'s.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Protocol

from .buffer import Group
from .generator.types import GenRequest, GenResult, GenStatus
from .outcomes import EpisodeStats
from .timing import NO_WAITS, Waits
from .league import League
from .tokenizer import Tokenizer

Generate = Callable[[GenRequest], Awaitable[GenResult]]
EVAL_EXAMPLES = 3  # examples an evaluation keeps for display


@dataclass
class FunctionCounts:
    """One reward function's completions scored, how many of them failed, and its first error."""

    scored: int = 0
    failed: int = 0
    first_error: str | None = None


@dataclass
class RewardStats:
    """Counters a reward function (or an environment) accumulates; they end up in the metrics."""

    calls: int = 0
    errors: int = 0  # raised, timed out, or returned a non-number
    timeouts: int = 0
    first_error: str | None = None
    last_error: str | None = None

    functions: dict[str, "FunctionCounts"] = field(default_factory=dict)  # per reward function

    def record_error(self, message: str) -> None:
        self.errors += 1
        self.last_error = message
        if self.first_error is None:
            self.first_error = message

    def count_function(self, name: str, scored: int, errors: list[str]) -> None:
        counts = self.functions.setdefault(name, FunctionCounts())
        counts.scored += scored
        counts.failed += len(errors)
        if errors and counts.first_error is None:
            counts.first_error = errors[0]

    def never_worked(self) -> str | None:
        """Why no call has worked yet (every one failed, overall or of one function), or None."""
        if self.calls and self.errors >= self.calls:
            return str(self.first_error)
        return next((str(c.first_error) for c in self.functions.values() if c.scored and c.failed >= c.scored), None)


@dataclass(frozen=True)
class RolloutContext:
    """What a source is given per training group: the run's generator and tokenizer, the tag
    its requests carry (what a learner step's `abort_older` stops), where its reward, tool
    and environment waits are recorded (`timing.Waits`; the default records nothing), and
    whether a generation that a learner step stops is continued on the newest version
    (`partial`: the run's `buffer.partial_rollouts` while it trains asynchronously), and the
    group's sampling seed (`seed`: from the run's seed and the group's index, so two runs of one
    seed draw alike where their versions agree; `sub_seed` derives one per request)."""

    generate: Generate
    tokenizer: Tokenizer
    tag: object = None
    waits: Waits = NO_WAITS
    partial: bool = False
    seed: int | None = None


SEED_BITS = 31  # vLLM adds the completion's index to a request's seed: stay far from int64's end


def sub_seed(seed: int | None, *parts: int) -> int | None:
    """An independent sampling seed for one part of a group (a run seed and a group index; an
    episode and a request within it), or None for unseeded sampling."""
    if seed is None:
        return None
    digest = hashlib.blake2b(repr((seed, *parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (1 << SEED_BITS)


@dataclass
class GroupRollout:
    """What one training group came to: the group to train on, or None and why not."""

    group: Group | None
    status: GenStatus = GenStatus.OK  # no group: ABORTED_STALE, ENGINE_DEAD, or FAILED (anything else)
    error: str | None = None
    tokens: int = 0  # tokens generated (not counted for a group aborted mid-generation)
    episodes: EpisodeStats = field(default_factory=EpisodeStats)  # every episode that ended
    fault: str | None = None  # a reward or environment fault this group hit, to show (the first once)

    @classmethod
    def failed(cls, result: GenResult | None = None, tokens: int = 0, episodes: EpisodeStats | None = None,
               fault: str | None = None) -> "GroupRollout":
        """No group: generation ended as `result` says (None, or a result that looks OK: FAILED)."""
        status = GenStatus.FAILED if result is None or result.status is GenStatus.OK else result.status
        return cls(None, status, result.error if result is not None else None, tokens,
                   episodes if episodes is not None else EpisodeStats(), fault)


@dataclass
class EvalResult:
    adapter: str | None
    version: int | None
    accuracy: float  # share of problems with reward >= 1 (environments: success rate)
    mean_reward: float
    n: int
    examples: list[tuple[str, str, str]]  # (prompt, completion, answer), a few for display
    extra: dict[str, float | int] = field(default_factory=dict)  # environments: turns, tool calls


class RolloutSource(Protocol):
    """One adapter's task, as the orchestrator and `evaluate` use it.

    Built with everything the adapter's spec says (sampling, `eval_max_tokens`, episode
    settings); each call gets only what changes per call."""

    @property
    def stats(self) -> RewardStats:
        """Reward (or environment) calls and faults: the run's `reward_errors`."""

    def describe(self) -> str:
        """One startup line: what the task is and which fields its reward gets."""

    @property
    def heldout_size(self) -> int:
        """Problems (or episodes) in the held-out split."""

    async def rollout(self, index: int, ctx: RolloutContext) -> GroupRollout:
        """Generate and score training group `index` (deterministic for a seed and index)."""

    async def evaluate(self, generate: Generate, tokenizer: Tokenizer, adapter: str | None, limit: int = 0,
                       done: Callable[[], None] | None = None) -> EvalResult:
        """Greedy held-out evaluation of `adapter` (None: the base); `limit` > 0 takes the first
        few. `done` is called as each problem (or episode) is scored (a progress display)."""

    async def probe_prompt(self, tokenizer: Tokenizer) -> list[int] | None:
        """The canary's prompt (None: none to give)."""

    @property
    def league(self) -> League | None:
        """A game against the adapter's past versions: its league, whose versions the run keeps
        registered, checkpoints and restores (`orchestrator.league`); None for every other task."""

    def pinned(self) -> list[tuple[str, int]]:
        """Frozen versions (adapter, version) the task's games name (`self@v0`): the run keeps
        each registered from when it is published. Empty for every task but a game."""

    def close(self) -> None: ...
