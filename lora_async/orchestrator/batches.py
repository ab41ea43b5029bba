"""Collecting: one batch of groups per learner step, per adapter.

A batch is `learner.groups_per_step` groups with a gradient (`loss.has_gradient`: rewards not all
equal, or a KL term; the others are skipped and counted; `learner.skip_flat_groups = false`
keeps them) that the learner can take in one step. The lag is stamped against the learner's
version when a group is taken (stale ones are dropped then).
"""

from __future__ import annotations

import asyncio

from ..buffer import Group
from ..loss import has_gradient
from ..outcomes import EpisodeStats
from .state import MAX_PULL_FACTOR, AdapterRun, Run, samples_of

TAKE_POLL_S = 1.0  # how often a waiting collector re-checks the limits and the run's state
INFORMATIVE_EMA = 0.1  # smoothing of the share of groups with a reward signal (admission uses it)


def start_collectors(run: Run, ready: asyncio.Queue) -> list[asyncio.Task]:
    return [asyncio.create_task(collect_loop(run, a, ready)) for a in run.adapters.values()]


async def collect_loop(run: Run, adapter: AdapterRun, ready: asyncio.Queue) -> None:
    """Hand the learner one batch of this adapter at a time, until its steps are done."""
    adapter.marks = run.marks(adapter)
    while not run.finished(adapter):
        groups = await collect_batch(run, adapter)
        if groups is None:
            return
        adapter.trained.clear()
        await ready.put((adapter, groups))
        await adapter.trained.wait()


async def collect_batch(run: Run, adapter: AdapterRun) -> list[Group] | None:
    """The next batch (None when the run stops first). After pulling MAX_PULL_FACTOR batches'
    worth of groups without filling it, it returns what it has, even nothing, so the run keeps
    its step budget and the metrics show the flat rewards instead of waiting forever."""
    cfg = run.config.learner
    groups, adapter.carry = adapter.carry, []
    adapter.admission.batch_holds(len(groups), 0)
    adapter.pulled_rewards = [s.reward for g in groups for s in g.samples]
    adapter.pulled_parts = {}
    adapter.pulled_episodes = EpisodeStats()
    for g in groups:
        adapter.pulled_episodes.merge(g.episodes)
        pull_parts(adapter, g)
    pulled = 0
    while len(groups) < cfg.groups_per_step:
        if run.finished(adapter):
            return None
        group = await take(run, adapter)
        if group is None:
            continue
        pulled += 1
        adapter.pulled_rewards.extend(group.rewards)
        adapter.pulled_episodes.merge(group.episodes)
        pull_parts(adapter, group)
        trains = trains_on(run, group)
        adapter.informative_rate += INFORMATIVE_EMA * (float(trains) - adapter.informative_rate)
        if not trains:
            adapter.counters.zero_adv_groups += 1
        elif groups and not run.learner.fits(samples_of(groups + [group])):
            adapter.carry.append(group)
            adapter.admission.batch_holds(len(groups), len(adapter.carry))
            break
        else:
            groups.append(group)
            adapter.admission.batch_holds(len(groups), 0)
        if pulled >= MAX_PULL_FACTOR * cfg.groups_per_step:
            if not groups and not adapter.warned_flat:
                adapter.warned_flat = True
                run.console.print(f"[yellow]{adapter.name}: no reward signal in the last {pulled} groups "
                                  f"(every sample of a group scored the same, e.g. {group.rewards[0]}): "
                                  "steps make no update[/]")
            break
    return groups


def trains_on(run: Run, group: Group) -> bool:
    """Whether a step takes `group`: it has a gradient, or filtering is off (a step then takes the
    groups as they come; a flat group counts towards groups_per_step but moves nothing)."""
    kl_coef = run.config.loss.kl_coef
    return any(has_gradient(s.advantage, kl_coef) for s in group.samples) or not run.config.learner.skip_flat_groups


async def take(run: Run, adapter: AdapterRun) -> Group | None:
    """The next admissible group of `adapter`, or None after TAKE_POLL_S without one."""
    dropped = run.buffer.counters.dropped_stale
    try:
        # the lag is against the learner's version (a publish may still be on its way)
        group = await asyncio.wait_for(run.buffer.take(adapter.name, run.learner.version(adapter.name)), TAKE_POLL_S)
    except asyncio.TimeoutError:
        if run.buffer.counters.dropped_stale != dropped:
            await run.notify()  # stale groups left the queue: producers may start again
        return None
    await run.notify()
    return group


def pull_parts(adapter: AdapterRun, group: Group) -> None:
    """Each reward function's values of a group taken for this step (those it scored)."""
    for name, values in group.reward_parts.items():
        adapter.pulled_parts.setdefault(name, []).extend(v for v in values if v is not None)
