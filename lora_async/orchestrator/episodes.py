"""Rollouts of environment tasks: a group is `samples_per_prompt` episodes of one problem,
played concurrently, each turn on the newest version (see `envs.episode`).

An episode the environment broke (`env_error`) scores 0 and is counted, and is left out of the
group's training: its tokens say nothing about the policy. Without partial rollouts, an episode
whose turn was aborted as stale drops its whole group, as single-turn groups are dropped.
"""

from __future__ import annotations

import asyncio

from ..buffer import Group, TrainSample, group_advantages
from ..envs.episode import EpisodeAborted, EpisodeSettings, Trajectory
from ..envs.source import EnvSource
from ..generator.types import GenStatus
from .state import AdapterRun, Run, TrainingError

MIN_EPISODES = 2  # a group needs two scored episodes for a group-normalised advantage


async def make_env_group(run: Run, adapter: AdapterRun, index: int, tag: object) -> Group | None:
    """Play, score and package one group of episodes (None when it cannot be trained on)."""
    source: EnvSource = adapter.task  # type: ignore[assignment]
    settings = EpisodeSettings.for_adapter(run.config, adapter.spec)
    n = adapter.spec.sampling.samples_per_prompt
    group_key = (adapter.name, index)  # its episodes share a replica where there are several
    played = await asyncio.gather(*(source.play(index, "train", run.tokenizer, settings, run.generate, adapter.name, tag,
                                                group_key) for _ in range(n)), return_exceptions=True)
    aborted = [p for p in played if isinstance(p, EpisodeAborted)]
    unexpected = [p for p in played if isinstance(p, BaseException) and not isinstance(p, EpisodeAborted)]
    if unexpected:
        raise unexpected[0]
    episodes: list[Trajectory] = [p for p in played if isinstance(p, Trajectory)]
    adapter.counters.record_episodes(episodes)
    report_env_error(run, adapter, episodes)
    if aborted:
        status = aborted[0].result.status
        if status is GenStatus.ENGINE_DEAD:
            run.fail(TrainingError(f"the vLLM engine died: {aborted[0].result.error}"))
        elif status is GenStatus.ABORTED_STALE:
            adapter.counters.aborted_stale += 1
        else:
            adapter.counters.groups_failed += 1
        return None
    scored = [t for t in episodes if t.outcome != "env_error" and t.oldest_version is not None]
    adapter.counters.tokens_generated += sum(sum(t.trained) for t in episodes)
    if len(scored) < MIN_EPISODES:
        adapter.counters.groups_failed += 1
        return None
    rewards = [t.reward for t in scored]
    samples = [TrainSample(adapter.name, t.oldest_version, t.prompt_ids, t.ids, t.logprobs, t.reward,  # type: ignore[arg-type]
                           advantage, t.outcome, trained=t.trained, versions=t.versions)
               for t, advantage in zip(scored, group_advantages(rewards))]
    group = Group(adapter.name, min(s.version for s in samples), index, samples)
    group.episodes = [episode_row(t) for t in episodes]
    return group


def episode_row(t: Trajectory) -> dict[str, float]:
    """What the metrics keep of an episode."""
    sampled = [v for v, trained in zip(t.versions, t.trained) if trained]
    return {"turns": t.turns, "tool_calls": t.tool_calls, "tool_errors": t.tool_errors,
            "success": float(t.success), "reward": t.reward, "truncated": float(t.outcome == "truncated"),
            "env_error": float(t.outcome == "env_error"), "resumed_turns": t.resumed_turns,
            "tokens_reprefilled": t.tokens_reprefilled, "tokens": len(t.ids),
            "version_span": (max(sampled) - min(sampled)) if sampled else 0}


def report_env_error(run: Run, adapter: AdapterRun, episodes: list[Trajectory]) -> None:
    """The first environment fault is shown at once; the count is in the metrics."""
    failed = next((t for t in episodes if t.outcome == "env_error"), None)
    if failed is not None and not adapter.reported_env_error:
        adapter.reported_env_error = True
        run.console.print(f"[red]{adapter.name}: the environment failed (the episode scores 0 and is not "
                          f"trained on; counted as env_errors): {failed.error}[/]", highlight=False)
