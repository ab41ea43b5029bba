"""An environment task: the user's factory loaded by module path, its tools, and the held-out
split; what the orchestrator and `evaluate` play episodes from.

Loading checks everything that can be checked before an engine starts: the module imports, the
object is callable, what it builds has `reset` and `step`, and its tools have JSON schemas. Any
failure is one `EnvLoadError` line naming the config field (`task.env`), exit code 2 in the CLI.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import os
import sys
from typing import Any, Awaitable, Callable

from ..config import EnvTask
from ..generator.types import GenRequest, GenResult
from ..tasks.problems import RewardStats
from ..tasks.rewards import RewardFailed
from .api import Split, check_env
from .episode import Episode, EpisodeError, EpisodeSettings, Trajectory, guarded
from .render import ChatRenderer
from .tools import ToolBox, ToolError, tool_schemas


REWARD_FIELDS = ("prompt", "completion", "answer", "messages", "turns", "tool_calls", "env_reward")  # + info


class EnvLoadError(ValueError):
    """`task.env` names something that cannot be used (one line, naming the field)."""


def load_object(spec: str, where: str) -> Any:
    """`module.path:name` (name may be dotted) imported from the current directory or sys.path."""
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a user's my_env.py next to the config, as for rewards
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise EnvLoadError(f"{where} = {spec!r}: cannot import {module_name!r} "
                           f"({type(exc).__name__}: {exc})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise EnvLoadError(f"{where} = {spec!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise EnvLoadError(f"{where} = {spec!r}: {attr} is a {type(obj).__name__}, not a factory "
                           "(a class or a function (index, split) -> environment)")
    return obj


class EnvSource:
    """One adapter's environment task."""

    name = "env"

    def __init__(self, config: EnvTask, seed: int, where: str = "task.env") -> None:
        self.config, self.seed, self.where = config, seed, where
        self.system_prompt = config.system_prompt
        self.stats = RewardStats()  # calls: episodes ended; errors: environment faults
        self.factory = load_object(config.env, where)
        try:
            probe = self.factory(0, "train")
        except Exception as exc:
            raise EnvLoadError(f"{where} = {config.env!r}: calling it as (0, 'train') raised "
                               f"{type(exc).__name__}: {exc}") from None
        try:
            check_env(probe, f"{where} = {config.env!r}")
            self.tools = list(getattr(probe, "tools", []) or [])
            self.schemas = tool_schemas(self.tools)
        except (TypeError, ToolError) as exc:
            raise EnvLoadError(str(exc) if str(exc).startswith(where) else f"{where} = {config.env!r}: {exc}") from None
        self.toolbox = ToolBox(self.tools, config.tool_timeout_s, config.tool_workers) if self.tools else None
        self.reward = self._user_reward()
        self._renderers: dict[int, ChatRenderer] = {}

    def _user_reward(self) -> Callable[..., float] | None:
        if self.config.reward is None:
            return None
        from ..tasks.rewards import make_reward

        return make_reward(self.config.reward, self.config.reward_timeout_s, self.stats)

    def heldout(self) -> list[int]:
        """Indices of the held-out episodes (split "eval")."""
        return list(range(self.config.heldout))

    def renderer(self, tokenizer: Any) -> ChatRenderer:
        key = id(tokenizer)
        if key not in self._renderers:
            self._renderers[key] = ChatRenderer(tokenizer, self.schemas, self.system_prompt)
        return self._renderers[key]

    def describe(self) -> str:
        tools = ", ".join(t.__name__ for t in self.tools) or "none"
        line = (f"environment {self.config.env} (tools: {tools}; up to {self.config.max_turns} turns, "
                f"{len(self.heldout())} held out)")
        if self.reward is not None:
            line += "; " + self.reward.describe(list(REWARD_FIELDS))
        return line

    async def build(self, index: int, split: Split) -> Any:
        """The environment of problem `index` (EpisodeError or TypeError if the factory fails)."""
        env = await guarded(self.factory, index, split, timeout_s=self.config.env_timeout_s, what="the factory")
        check_env(env, self.where)
        return env

    async def opening_ids(self, index: int, split: Split, tokenizer: Any) -> list[int] | None:
        """The rendered opening of an episode (None if the environment fails to open it)."""
        try:
            env = await self.build(index, split)
            messages = await guarded(env.reset, timeout_s=self.config.env_timeout_s, what="reset")
            return self.renderer(tokenizer).opening(messages)
        except (EpisodeError, TypeError, KeyError):
            return None

    async def play(self, index: int, split: Split, tokenizer: Any, settings: EpisodeSettings,
                   generate: Callable[[GenRequest], Awaitable[GenResult]], adapter: str | None,
                   tag: object, group: object = None) -> Trajectory:
        """One episode of problem `index`. Environment faults end it as `env_error` (counted);
        generation faults raise `EpisodeAborted`."""
        try:
            env = await self.build(index, split)
            trajectory = await Episode(env, self.renderer(tokenizer), self.toolbox, settings, generate, adapter,
                                       tag, group).play()
        except (EpisodeError, TypeError) as exc:
            trajectory = Trajectory([], outcome="env_error", error=str(exc))
        if trajectory.outcome == "done" and self.reward is not None:
            trajectory.reward = await self._score(trajectory)
        if trajectory.outcome == "env_error":
            self.stats.record_error(f"{self.config.env}: {trajectory.error}")
        self.stats.calls += 1
        return trajectory

    async def _score(self, trajectory: Trajectory) -> float:
        assert self.reward is not None
        users = [m["content"] for m in trajectory.messages[: trajectory.opened] if m["role"] == "user"]
        replies = [m["content"] for m in trajectory.messages[trajectory.opened:] if m["role"] == "assistant"]
        fields = {"prompt": users[-1] if users else "", "completion": replies[-1] if replies else "",
                  "answer": str(trajectory.info.get("answer", "")), "messages": trajectory.messages,
                  "turns": trajectory.turns, "tool_calls": trajectory.tool_calls, "env_reward": trajectory.reward,
                  **trajectory.info}
        try:
            value = float(await asyncio.to_thread(lambda: self.reward(**fields)))
            if not math.isfinite(value):
                raise ValueError(f"reward is {value}")
        except RewardFailed as exc:
            self.stats.record_error(str(exc))
            return 0.0
        except Exception as exc:
            self.stats.record_error(f"{self.config.reward}: {type(exc).__name__}: {exc}")
            return 0.0
        return value

    def close(self) -> None:
        if self.toolbox is not None:
            self.toolbox.close()
        close = getattr(self.reward, "close", None)
        if close is not None:
            close()
