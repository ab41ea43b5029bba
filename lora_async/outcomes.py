"""What episodes come to: how one ended (`Outcome`) and their figures summed (`EpisodeStats`),
per group, per step and per run. Below the buffer (a group carries its episodes' stats) and the
rollout contract (a source reports them)."""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field, fields
from typing import Iterable, Protocol


class Outcome(str, enum.Enum):
    """How an episode ended (a `str`: rows and transcripts print the value)."""

    def __str__(self) -> str:
        return self.value

    RUNNING = "running"
    DONE = "done"  # the environment ended it
    MAX_TURNS = "max_turns"
    TRUNCATED = "truncated"  # the context (generator.max_model_len) was full
    ENV_ERROR = "env_error"  # the environment raised, hung or broke the interface: reward 0, not trained


class PlayedEpisode(Protocol):
    """What `EpisodeStats` reads of a played episode (`envs.episode.Trajectory`)."""

    outcome: Outcome
    turns: int
    tool_calls: int
    tool_errors: int
    resumed_turns: int
    tokens_reprefilled: int
    ids: list[int]

    @property
    def success(self) -> bool: ...

    @property
    def version_span(self) -> int: ...


BY_MAX = {"merge": max}  # a field that keeps the largest value when stats are merged (the others add up)


@dataclass
class EpisodeStats:
    """Episodes summed: a group's, a step's (every group it took) or a run's.

    The field names that are also run totals (`episodes`, `env_errors`, `truncated_episodes`,
    `tool_calls`, `tool_errors`, `resumed_turns`, `tokens_reprefilled`) are the keys checkpoints
    store them under."""

    episodes: int = 0
    successes: int = 0
    turns: int = 0
    turns_max: int = field(default=0, metadata=BY_MAX)
    tool_calls: int = 0
    tool_users: int = 0  # episodes with at least one tool call
    tool_errors: int = 0  # malformed calls, unknown tools, tools that raised or timed out
    tokens: int = 0  # everything after the opening
    tokens_max: int = field(default=0, metadata=BY_MAX)
    version_span: int = 0  # newest minus oldest sampling version, summed over episodes
    version_span_max: int = field(default=0, metadata=BY_MAX)
    # turns stopped as too stale and continued on a newer version (each continuation counts; a
    # single-turn group reports its continued completions here, with `episodes` 0)
    resumed_turns: int = 0
    tokens_reprefilled: int = 0  # context prefilled again because of those switches
    env_errors: int = 0
    truncated_episodes: int = 0

    @classmethod
    def of(cls, episodes: Iterable[PlayedEpisode]) -> "EpisodeStats":
        stats = cls()
        for t in episodes:
            stats.merge(cls(
                episodes=1, successes=int(t.success), turns=t.turns, turns_max=t.turns, tool_calls=t.tool_calls,
                tool_users=int(t.tool_calls > 0), tool_errors=t.tool_errors, tokens=len(t.ids), tokens_max=len(t.ids),
                version_span=t.version_span, version_span_max=t.version_span, resumed_turns=t.resumed_turns,
                tokens_reprefilled=t.tokens_reprefilled, env_errors=int(t.outcome is Outcome.ENV_ERROR),
                truncated_episodes=int(t.outcome is Outcome.TRUNCATED)))
        return stats

    def merge(self, other: "EpisodeStats | None") -> None:
        """Add `other` (None: a group without episodes) to these."""
        if other is None:
            return
        for f in fields(self):
            combine = f.metadata.get("merge", operator.add)
            setattr(self, f.name, combine(getattr(self, f.name), getattr(other, f.name)))

    @classmethod
    def from_dict(cls, saved: dict[str, int]) -> "EpisodeStats":
        """From a checkpoint's flat counters (older ones hold only the run totals)."""
        return cls(**{f.name: int(saved[f.name]) for f in fields(cls) if f.name in saved})

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def _mean(self, total: int) -> float:
        return total / self.episodes if self.episodes else 0.0

    def step_figures(self) -> dict[str, float | int]:
        """A step line's figures of the episodes it took (trained or skipped as flat)."""
        return {"episodes": self.episodes, "success_rate": self._mean(self.successes),
                "turns_mean": self._mean(self.turns), "turns_max": self.turns_max,
                "tool_calls_mean": self._mean(self.tool_calls), "tool_call_rate": self._mean(self.tool_users),
                "episode_tokens_mean": self._mean(self.tokens), "episode_tokens_max": self.tokens_max,
                "version_span_mean": self._mean(self.version_span), "version_span_max": self.version_span_max,
                **self.resumed_figures()}

    def resumed_figures(self) -> dict[str, int]:
        """Turns (single-turn tasks: completions) stopped by a step and continued on a newer version."""
        return {"resumed_turns": self.resumed_turns, "tokens_reprefilled": self.tokens_reprefilled}

    def resumed_total_figures(self) -> dict[str, int]:
        """`resumed_figures` as a step line's run totals (these stats are the run's)."""
        return {f"{key}_total": value for key, value in self.resumed_figures().items()}

    def total_figures(self) -> dict[str, int]:
        """A step line's run totals so far (these stats are the run's)."""
        return {"env_errors": self.env_errors, "tool_errors": self.tool_errors,
                "truncated_episodes": self.truncated_episodes, **self.resumed_total_figures()}

    def summary_figures(self) -> dict[str, int]:
        """`summary.json`'s episode totals (these stats are the run's)."""
        return {"episodes": self.episodes, "env_errors": self.env_errors,
                "truncated_episodes": self.truncated_episodes, "tool_calls": self.tool_calls,
                "tool_errors": self.tool_errors, "resumed_turns": self.resumed_turns,
                "tokens_reprefilled": self.tokens_reprefilled}

    def eval_figures(self) -> dict[str, float | int]:
        """An eval line's extras: turns and tool use of the held-out episodes."""
        return {"turns_mean": self._mean(self.turns), "tool_calls_mean": self._mean(self.tool_calls),
                "tool_call_rate": self._mean(self.tool_users), "env_errors": self.env_errors,
                "truncated_episodes": self.truncated_episodes}
