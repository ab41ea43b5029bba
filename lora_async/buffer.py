"""The rollout buffer: finished groups waiting for the learner, bounded by tokens.

Every sample carries its adapter and, token by token, the version that sampled it (an episode
may move to newer versions between turns; with partial rollouts a turn or a single-turn
completion stopped by a learner step goes on on the newest version). Staleness is decided when
the learner takes a group (that is when the lag is known), by the staleness window
(`staleness.StalenessWindow`):

- a sample is judged by the version it *finished* on, the newest among its trained tokens (for
  a sample of one version, its only one). A group is admitted when every sample finished inside
  the window; otherwise it is dropped, or admitted stale for importance correction (`is-correct`);
- in an admitted sample, the tokens whose own lag (`TrainSample.token_lags`) is outside the window
  are marked stale one by one (`TrainSample.stale_mask`), and the loss importance-corrects exactly
  those (`loss.policy_loss`'s `stale`).

A step stops exactly the generations its new version would leave outside the window, so a
continued sample always has tokens one version outside it: judged by its oldest token it would
always be dropped, and its continuation wasted. Its `version` and `policy_lag` still name the
oldest token. Every drop, every stale admission and every stale token is counted. One queue per
adapter; the token bound is shared.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .staleness import Window

if TYPE_CHECKING:  # rollout.py builds on the Group defined here; only the annotation looks back
    from .outcomes import EpisodeStats


@dataclass
class TrainSample:
    """One trajectory: an opening prompt (shared by its group) and everything after it.

    In a single-turn task every completion token was sampled by one version. In an episode the
    completion interleaves sampled tokens (trained) with environment, tool and template tokens
    (context only), and the sampled ones may come from several versions; `trained` and
    `versions` say which, token by token.
    """

    adapter: str
    version: int  # the oldest version that sampled a trained token (its staleness)
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # behaviour logprob of each completion token (0.0 for context tokens)
    reward: float
    advantage: float = 0.0
    finish_reason: str = "stop"
    policy_lag: int = 0  # learner version at training time minus `version` (set on take)
    # per completion token: trained, but sampled outside the staleness window, importance-corrected
    # (set on take; None: no such token)
    stale_mask: list[bool] | None = None
    trained: list[bool] | None = None  # per completion token: sampled by the model (None: all were)
    versions: list[int] | None = None  # per completion token: the version that sampled it (None: `version`)

    @property
    def tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def token_trained(self) -> list[bool]:
        return [True] * len(self.completion_ids) if self.trained is None else self.trained

    def token_versions(self) -> list[int]:
        return [self.version] * len(self.completion_ids) if self.versions is None else self.versions

    def token_lags(self) -> list[int]:
        """Each completion token's own lag: the sample's lag, less how much newer its version is."""
        return [self.policy_lag - (v - self.version) for v in self.token_versions()]

    def token_stale(self) -> list[bool]:
        return [False] * len(self.completion_ids) if self.stale_mask is None else self.stale_mask

    @property
    def stale(self) -> bool:
        """Some trained token is outside the staleness window (importance-corrected)."""
        return self.stale_mask is not None

    @property
    def finished_version(self) -> int:
        """The newest version among its trained tokens: the one it finished on (its staleness)."""
        if self.versions is None:
            return self.version
        return max((v for v, t in zip(self.versions, self.token_trained()) if t), default=self.version)

    @property
    def trained_tokens(self) -> int:
        return len(self.completion_ids) if self.trained is None else sum(self.trained)

    @property
    def version_span(self) -> int:
        """Newest minus oldest version among the trained tokens (0 for a single-turn sample)."""
        if self.versions is None:
            return 0
        sampled = [v for v, t in zip(self.versions, self.token_trained()) if t]
        return max(sampled) - min(sampled) if sampled else 0


@dataclass
class Group:
    """All samples for one prompt (one problem: GRPO normalises rewards within it)."""

    adapter: str
    version: int  # the oldest version of any trained token in the group
    problem_index: int
    samples: list[TrainSample]
    # what its episodes came to (environments), or a single-turn group's continued completions
    # (`resumed_turns`, `tokens_reprefilled`; partial rollouts); None: nothing to report
    episodes: EpisodeStats | None = None
    # each reward function's value per sample (None: it did not score that one), for `reward/<name>`
    reward_parts: dict[str, list[float | None]] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.samples)

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    @property
    def informative(self) -> bool:
        """False when every sample has the same reward: the group-normalised advantage is 0."""
        return any(s.advantage != 0.0 for s in self.samples)


def group_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """GRPO advantage: reward minus the group mean, over the group std (0 when all are equal)."""
    n = len(rewards)
    mean = sum(rewards) / n
    var = sum((r - mean) ** 2 for r in rewards) / n
    std = var**0.5
    if std < eps:
        return [0.0] * n
    return [(r - mean) / (std + eps) for r in rewards]


@dataclass
class BufferCounters:
    groups_in: int = 0
    samples_in: int = 0
    groups_out: int = 0
    dropped_stale: int = 0  # samples
    admitted_stale: int = 0  # samples kept under `is-correct`
    stale_tokens_corrected: int = 0  # trained tokens of admitted samples marked stale (importance-corrected)
    per_adapter_dropped: dict[str, int] = field(default_factory=dict)


class RolloutBuffer:
    def __init__(self, max_tokens: int, window: Window, stale_policy: str) -> None:
        if stale_policy not in ("drop", "is-correct"):
            raise ValueError(f"unknown stale policy {stale_policy!r}")
        self.max_tokens = max_tokens
        self.window = window  # a run's: the window in force (`staleness.WindowInForce`)
        self.stale_policy = stale_policy
        self.counters = BufferCounters()
        self._queues: dict[str, deque[Group]] = {}
        self._tokens = 0
        self._changed = asyncio.Condition()

    @property
    def tokens(self) -> int:
        return self._tokens

    def groups(self, adapter: str | None = None) -> int:
        if adapter is not None:
            return len(self._queues.get(adapter, ()))
        return sum(len(q) for q in self._queues.values())

    def fits(self, group: Group) -> bool:
        # An empty buffer takes any group, so one oversized group cannot deadlock the run.
        return self._tokens == 0 or self._tokens + group.tokens <= self.max_tokens

    async def put(self, group: Group) -> None:
        """Add a finished group; waits while the token bound is reached."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.fits(group))
            self._queues.setdefault(group.adapter, deque()).append(group)
            self._tokens += group.tokens
            self.counters.groups_in += 1
            self.counters.samples_in += len(group.samples)
            self._changed.notify_all()

    async def take(self, adapter: str, learner_version: int) -> Group:
        """The oldest admissible group of `adapter`, lag-stamped; stale ones dropped on the way."""
        async with self._changed:
            while True:
                await self._changed.wait_for(lambda: bool(self._queues.get(adapter)))
                group = self._queues[adapter].popleft()
                self._tokens -= group.tokens
                self._changed.notify_all()
                if self.admit(group, learner_version):
                    self.counters.groups_out += 1
                    return group

    def admit(self, group: Group, learner_version: int) -> bool:
        """Stamp each sample's policy_lag and stale tokens; apply the stale policy to a group with
        a sample that finished outside the window. False means the group was dropped."""
        window = self.window
        late = False
        for sample in group.samples:
            sample.policy_lag = learner_version - sample.version
            late |= not window.admits(learner_version - sample.finished_version)
            mask = [t and not window.admits(lag) for t, lag in zip(sample.token_trained(), sample.token_lags())]
            sample.stale_mask = mask if any(mask) else None
        if late:
            n = len(group.samples)
            if self.stale_policy == "drop":
                self.counters.dropped_stale += n
                per = self.counters.per_adapter_dropped
                per[group.adapter] = per.get(group.adapter, 0) + n
                return False
            self.counters.admitted_stale += n
        self.counters.stale_tokens_corrected += sum(sum(s.token_stale()) for s in group.samples)
        return True

    async def notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()
