"""An environment task as a rollout source: the user's factory loaded by module path, its tools,
and the held-out split.

A training group is `samples_per_prompt` episodes of one problem, played concurrently, each turn
on the newest version (see `episode.py`). An episode the environment broke (`env_error`) scores
0 and is counted, and is left out of the group's training: its tokens say nothing about the
policy. Without partial rollouts, an episode whose turn was aborted as stale drops its whole
group, as single-turn groups are dropped. Held-out evaluation plays greedy episodes.

Loading checks everything that can be checked before an engine starts: the module imports, the
object is callable, what it builds has `reset` and `step`, and its tools have JSON schemas. Any
failure is one `EnvLoadError` line naming the config field (`task.env`), exit code 2 in the CLI.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import os
import sys
from typing import Any, Callable

from ..buffer import Group, TrainSample, group_advantages
from ..config import EnvTask
from ..errors import UserError, error_line
from ..league import League
from ..outcomes import EpisodeStats, Outcome
from ..rollout import EVAL_EXAMPLES, EvalResult, Generate, GroupRollout, RewardStats, RolloutContext, sub_seed
from ..config import auto_workers
from ..rewards import Batch, Rewards, make_rewards
from ..sandbox import describe as describe_isolation, is_sandboxed
from ..timing import NO_WAITS, Waits
from ..tokenizer import Tokenizer
from .base import EnvFactory, EnvLike, Split, check_env
from .episode import Episode, EpisodeAborted, EpisodeError, EpisodeSettings, Trajectory, call_env
from .render import ChatRenderer
from .tools import SimulatedLatency, ToolBox, ToolError, tool_schemas


REWARD_FIELDS = ("prompt", "completion", "answer", "messages", "turns", "tool_calls", "env_reward")  # + info
MIN_EPISODES = 2  # a group needs two scored episodes for a group-normalised advantage


class EnvLoadError(UserError, ValueError):
    """`task.env` names something that cannot be used (one line, naming the field)."""


def load_object(spec: str, where: str) -> Any:
    """`module.path:name` (name may be dotted) imported from the current directory or sys.path."""
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a user's my_env.py next to the config, as for rewards
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise EnvLoadError(f"{where} = {spec!r}: cannot import {module_name!r} ({error_line(exc)})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise EnvLoadError(f"{where} = {spec!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise EnvLoadError(f"{where} = {spec!r}: {attr} is a {type(obj).__name__}, not a factory "
                           "(a class or a function (index, split) -> environment)")
    return obj


def env_tools(spec: str) -> list[Any]:
    """The tools of the environment `spec` builds first (none if it cannot be built: loading the
    task says why, with the field's name)."""
    try:
        return list(getattr(load_object(spec, "task.env")(0, "train"), "tools", []) or [])
    except Exception:
        return []


class EnvSource:
    """One adapter's environment task (`rollout.RolloutSource`): `settings` for its training
    episodes, `group_size` of them per group, `eval_settings` for held-out ones."""

    name = "env"

    def __init__(self, config: EnvTask, seed: int, where: str, adapter: str, settings: EpisodeSettings,
                 eval_settings: EpisodeSettings, group_size: int, in_flight: int = 1) -> None:
        """`in_flight`: episodes at once (tools and rewards keep that many calls going, unless
        `tool_workers` / `reward_workers` say)."""
        self.config, self.seed, self.where = config, seed, where
        self.adapter, self.settings, self.eval_settings, self.group_size = adapter, settings, eval_settings, group_size
        self.system_prompt = config.system_prompt
        self.stats = RewardStats()  # calls: episodes ended; errors: environment faults
        self.factory: EnvFactory = load_object(config.env, where)
        try:
            probe = self.factory(0, "train")
        except Exception as exc:
            raise EnvLoadError(f"{where} = {config.env!r}: calling it as (0, 'train') raised "
                               f"{error_line(exc)}") from None
        try:
            check_env(probe, f"{where} = {config.env!r}")
            self.tools = list(getattr(probe, "tools", []) or [])
            self.schemas = tool_schemas(self.tools)
        except (TypeError, ToolError) as exc:
            raise EnvLoadError(str(exc) if str(exc).startswith(where) else f"{where} = {config.env!r}: {exc}") from None
        latency = config.tool_latency
        self.toolbox = (ToolBox(self.tools, config.tool_timeout_s, auto_workers(config.tool_workers, in_flight),
                                None if latency is None else SimulatedLatency(latency.median_s, latency.sigma,
                                                                              latency.seed + seed),
                                env=config.sandbox_env())
                        if self.tools else None)
        self.reward: Rewards | None = None
        if config.reward is not None:
            try:
                self.reward = make_rewards(config.reward_list(), config.reward_weights, config.reward_timeout_s,
                                           auto_workers(config.reward_workers, in_flight), self.stats,
                                           env=config.sandbox_env())
            except Exception:
                self.close()
                raise
        self._renderers: dict[int, ChatRenderer] = {}

    def heldout(self) -> list[int]:
        """Indices of the held-out episodes (split "eval")."""
        return list(range(self.config.heldout))

    @property
    def heldout_size(self) -> int:
        return self.config.heldout

    def renderer(self, tokenizer: Tokenizer) -> ChatRenderer:
        key = id(tokenizer)
        if key not in self._renderers:
            self._renderers[key] = ChatRenderer(tokenizer, self.schemas, self.system_prompt)
        return self._renderers[key]

    def describe(self) -> str:
        tools = ", ".join(t.__name__ for t in self.tools) or "none"
        line = (f"environment {self.config.env} (tools: {tools}; up to {self.config.max_turns} turns, "
                f"{len(self.heldout())} held out)")
        if self.config.tool_latency is not None:
            latency = self.config.tool_latency
            line += (f"; SIMULATED tool latency: lognormal, median {latency.median_s:g}s, sigma {latency.sigma:g} "
                     "(task.tool_latency)")
        if self.reward is not None:
            line += "; " + self.reward.describe(list(REWARD_FIELDS))
        if any(is_sandboxed(t) for t in self.tools):
            line += "; code runs in " + describe_isolation(self.config.sandbox)
        return line

    async def build(self, index: int, split: Split) -> EnvLike:
        """The environment of problem `index` (EpisodeError or TypeError if the factory fails)."""
        env = await call_env(self.factory, index, split, timeout_s=self.config.env_timeout_s, what="the factory")
        check_env(env, self.where)
        return env

    async def opening_ids(self, index: int, split: Split, tokenizer: Tokenizer) -> list[int] | None:
        """The rendered opening of an episode (None if the environment fails to open it)."""
        try:
            env = await self.build(index, split)
            messages = await call_env(env.reset, timeout_s=self.config.env_timeout_s, what="reset")
            return self.renderer(tokenizer).opening(messages)
        except (EpisodeError, TypeError, KeyError):
            return None

    league: League | None = None  # only a game against past versions has one (`envs.games`)

    def pinned(self) -> list[tuple[str, int]]:
        return []

    async def probe_prompt(self, tokenizer: Tokenizer) -> list[int] | None:
        """The first held-out episode's opening."""
        return await self.opening_ids(0, "eval", tokenizer)

    async def rollout(self, index: int, ctx: RolloutContext) -> GroupRollout:
        """Play, score and package one group of episodes."""
        group_key = (self.adapter, index)  # its episodes share a replica where there are several
        # the episodes play at once: their environment, tool and reward calls overlap
        settings = self.settings if ctx.partial else dataclasses.replace(self.settings, partial=False)
        played = await asyncio.gather(*(self.play(index, "train", ctx.tokenizer, settings, ctx.generate,
                                                  self.adapter, ctx.tag, group_key, ctx.waits, sub_seed(ctx.seed, i))
                                        for i in range(self.group_size)),
                                      return_exceptions=True)
        unexpected = [p for p in played if isinstance(p, BaseException) and not isinstance(p, EpisodeAborted)]
        if unexpected:
            raise unexpected[0]
        episodes = [p for p in played if isinstance(p, Trajectory)]
        stats = EpisodeStats.of(episodes)
        broken = next((t for t in episodes if t.outcome is Outcome.ENV_ERROR), None)
        fault = None if broken is None else ("the environment failed (the episode scores 0 and is not trained on; "
                                             f"counted as env_errors): {broken.error}")
        return self.group_of(index, played, episodes, stats, fault)

    def group_of(self, index: int, played: list, trajectories: list[Trajectory], stats: EpisodeStats,
                 fault: str | None) -> GroupRollout:
        """One group's rollout from its trajectories of this adapter: aborted if any episode was
        (`played` holds the EpisodeAborted), too few scored ones train nothing, else each scored
        trajectory is a sample with its group advantage."""
        aborted = next((p for p in played if isinstance(p, EpisodeAborted)), None)
        if aborted is not None:
            return GroupRollout.failed(aborted.result, episodes=stats, fault=fault)
        tokens = sum(sum(t.trained) for t in trajectories)
        scored = [(t, oldest) for t in trajectories
                  if t.outcome is not Outcome.ENV_ERROR and (oldest := t.oldest_version) is not None]
        if len(scored) < MIN_EPISODES:
            return GroupRollout.failed(tokens=tokens, episodes=stats, fault=fault)
        advantages = group_advantages([t.reward for t, _ in scored])
        samples = [TrainSample(self.adapter, oldest, t.prompt_ids, t.ids, t.logprobs, t.reward, advantage, t.outcome,
                               trained=t.trained, versions=t.versions)
                   for (t, oldest), advantage in zip(scored, advantages)]
        group = Group(self.adapter, min(s.version for s in samples), index, samples, episodes=stats)
        return GroupRollout(group, tokens=tokens, episodes=stats, fault=fault)

    async def evaluate(self, generate: Generate, tokenizer: Tokenizer, adapter: str | None, limit: int = 0,
                       done: Callable[[], None] | None = None) -> EvalResult:
        """Greedy episodes on the held-out split: success rate (`accuracy`), turns and tool use."""

        async def one(index: int) -> Trajectory:
            trajectory = await self.play(index, "eval", tokenizer, self.eval_settings, generate, adapter, None)
            if done is not None:
                done()
            return trajectory

        played = await asyncio.gather(*(one(i) for i in self.heldout()[: limit or None]), return_exceptions=True)
        failed = next((p for p in played if isinstance(p, BaseException)), None)
        if failed is not None:
            raise RuntimeError(f"evaluation episode failed: {failed}")
        episodes = [p for p in played if isinstance(p, Trajectory)]
        n, stats = len(episodes), EpisodeStats.of(episodes)
        versions = [v for t in episodes for v, trained in zip(t.versions, t.trained) if trained]
        return EvalResult(adapter=adapter, version=max(versions) if adapter is not None and versions else None,
                          accuracy=stats.successes / n if n else 0.0,
                          mean_reward=sum(t.reward for t in episodes) / n if n else 0.0, n=n,
                          examples=[transcript(t) for t in episodes[:EVAL_EXAMPLES]], extra=stats.eval_figures())

    async def play(self, index: int, split: Split, tokenizer: Tokenizer, settings: EpisodeSettings, generate: Generate,
                   adapter: str | None, tag: object, group: object = None, waits: Waits = NO_WAITS,
                   seed: int | None = None) -> Trajectory:
        """One episode of problem `index`. Environment faults end it as `env_error` (counted);
        generation faults raise `EpisodeAborted`. Its environment, tool and reward calls are timed
        in `waits` (a training rollout's; held-out episodes record nothing); `seed` seeds its
        sampling (None: unseeded)."""
        try:
            env = await self.build(index, split)
            trajectory = await Episode(env, self.renderer(tokenizer), self.toolbox, settings, generate, adapter,
                                       tag, group, waits, seed).play()
        except (EpisodeError, TypeError) as exc:
            trajectory = Trajectory([], outcome=Outcome.ENV_ERROR, error=str(exc))
        if trajectory.outcome is Outcome.DONE and self.reward is not None:
            trajectory.reward = await self._score(self.reward, trajectory, waits)
        if trajectory.outcome is Outcome.ENV_ERROR:
            self.stats.record_error(f"{self.config.env}: {trajectory.error}")
        self.stats.calls += 1
        return trajectory

    async def _score(self, reward: Rewards, trajectory: Trajectory, waits: Waits = NO_WAITS) -> float:
        """The user's reward of a finished episode (a failed call scores 0 and is counted)."""
        users = [m["content"] for m in trajectory.messages[: trajectory.opened] if m["role"] == "user"]
        replies = [m["content"] for m in trajectory.messages[trajectory.opened:] if m["role"] == "assistant"]
        fields = {**trajectory.info, "messages": trajectory.messages, "turns": trajectory.turns,
                  "tool_calls": trajectory.tool_calls, "env_reward": trajectory.reward}
        batch = Batch(users[-1] if users else "", str(trajectory.info.get("answer", "")),
                      [replies[-1] if replies else ""], [[i for i, t in zip(trajectory.ids, trajectory.trained) if t]],
                      fields)
        return (await reward.score(batch, waits)).rewards[0]

    def close(self) -> None:
        toolbox, reward = getattr(self, "toolbox", None), getattr(self, "reward", None)  # a part-built source too
        if toolbox is not None:
            toolbox.close()
        if reward is not None:
            reward.close()


def transcript(t: Trajectory) -> tuple[str, str, str]:
    """(the opening's last user message, the conversation after it, the outcome): an eval example."""
    opening = next((m["content"] for m in reversed(t.messages[: t.opened]) if m["role"] == "user"), "")
    lines = [f"[{m['role']}] {m['content']}" for m in t.messages[t.opened:]]
    return opening, "\n".join(lines), f"{t.outcome}, reward {t.reward:g}"
