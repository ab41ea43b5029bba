"""Rollouts: producers that keep the generator busy, within the admission rule (`admission.py`).

Each adapter has its own producers (its weight's share of `generator.groups_in_flight`). A
producer starts a group when admitted, has the adapter's rollout source generate and score it
(`rollout.RolloutSource`: one request of n completions, or n episodes), counts what it came to,
and puts the group in the rollout buffer, until the run stops.

A producer held back (by admission, or by a full buffer: both wait for the learner) marks
`Wait.ADMISSION` on the run's board for as long as it is; its rollouts' reward, tool and
environment waits go to the adapter's `Waits` through its `RolloutContext`.
"""

from __future__ import annotations

import asyncio

from ..buffer import Group
from ..errors import TrainingError
from ..generator.types import GenStatus
from ..rollout import GroupRollout, RolloutContext, sub_seed
from ..timing import Wait
from .state import AdapterRun, Run

ADMISSION_POLL_S = 0.25  # producers re-check admission at least this often (stale drops notify no one)
ROLLOUT_TAG = "rollout"  # GenRequest.tag of training rollouts (the only requests cut short as stale)
PRODUCER = "producer"  # a producer task is named "producer <adapter>" (what a debugger or a test sees)


def producer_quota(weights: dict[str, float], groups_in_flight: int) -> dict[str, int]:
    """Producers per adapter: groups in flight shared by weight, at least one each."""
    total = sum(weights.values())
    return {name: max(1, round(groups_in_flight * w / total)) for name, w in weights.items()}


def start_producers(run: Run) -> list[asyncio.Task]:
    quota = producer_quota({n: a.spec.weight for n, a in run.adapters.items()},
                           run.config.generator.groups_in_flight)
    return [asyncio.create_task(produce(run, a), name=f"{PRODUCER} {a.name}")
            for a in run.adapters.values() for _ in range(quota[a.name])]


async def produce(run: Run, adapter: AdapterRun) -> None:
    """One producer of one adapter. An unexpected error fails the run (a silently dead producer
    would hang it)."""
    try:
        while run.running:
            await admitted(run, adapter)
            if not run.running:
                return
            # partial rollouts follow the mode in force (an auto run may turn async mid-run)
            index = adapter.next_problem
            ctx = RolloutContext(run.generate, run.tokenizer, ROLLOUT_TAG, adapter.waits, run.partial_rollouts,
                                 sub_seed(run.config.run.seed, index))
            adapter.next_problem += 1
            adapter.admission.group_started()
            adapter.counters.groups_started += 1
            try:
                group = record(run, adapter, await adapter.source.rollout(index, ctx))
                if group is not None:
                    with adapter.waits.waiting(Wait.ADMISSION):  # a full buffer holds it back too
                        await run.buffer.put(group)
            finally:
                adapter.admission.group_finished()
                await run.notify()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        run.console.print_exception(show_locals=False)
        run.fail(TrainingError(f"a rollout producer of {adapter.name} failed: {type(exc).__name__}: {exc}"))


async def admitted(run: Run, adapter: AdapterRun) -> None:
    """Wait until a new group of `adapter` may start (or the run stops). Only a producer actually
    held back marks the admission wait."""
    per_step = run.config.learner.groups_per_step

    def held_back() -> bool:
        return run.running and not adapter.admission.may_start(
            run.buffer.groups(adapter.name), run.learner.version(adapter.name),
            adapter.groups_consumed_per_step(per_step))

    async with run.producers_wake:
        if not held_back():
            return
        with adapter.waits.waiting(Wait.ADMISSION):
            while held_back():
                try:
                    await asyncio.wait_for(run.producers_wake.wait(), ADMISSION_POLL_S)
                except asyncio.TimeoutError:
                    pass


def record(run: Run, adapter: AdapterRun, rollout: GroupRollout) -> Group | None:
    """Count what a group came to; its group to buffer, or None. The first reward or environment
    fault is shown at once (the count is in the metrics); a dead engine fails the run."""
    counters = adapter.counters
    counters.tokens_generated += rollout.tokens
    counters.episode_stats.merge(rollout.episodes)
    if rollout.fault is not None and not adapter.reported_fault:
        adapter.reported_fault = True
        run.console.print(f"[red]{adapter.name}: {rollout.fault}[/]", highlight=False)
    if rollout.status is GenStatus.ABORTED_STALE:
        counters.aborted_stale += 1
    elif rollout.status is GenStatus.ENGINE_DEAD:
        run.fail(TrainingError(f"the vLLM engine died: {rollout.error}"))
    elif rollout.group is None:
        counters.groups_failed += 1
    return rollout.group
