"""The rollout buffer: token bound, staleness, counts; GRPO advantages."""

import asyncio

import pytest
import torch

from lora_async.buffer import Group, RolloutBuffer, TrainSample, group_advantages
from lora_async.learner.packing import build_micro_batch
from lora_async.staleness import StalenessWindow


def group(version, n=2, tokens_each=10, adapter="a", reward=(0.0, 1.0)):
    samples = [TrainSample(adapter, version, [1] * (tokens_each // 2), [2] * (tokens_each - tokens_each // 2),
                           [-0.1] * (tokens_each - tokens_each // 2), reward[i % 2]) for i in range(n)]
    return Group(adapter, version, 0, samples)


def test_advantages_are_group_normalised():
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    adv = group_advantages([0.0, 1.0])
    assert adv == pytest.approx([-1.0, 1.0], abs=1e-5)
    adv = group_advantages([0.0, 0.0, 0.0, 1.0])
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)
    assert adv[3] == pytest.approx(3 ** 0.5, rel=1e-4)


def test_token_bound_blocks_producers_until_the_learner_takes():
    async def scenario():
        buf = RolloutBuffer(max_tokens=40, window=StalenessWindow(4), stale_policy="drop")
        await buf.put(group(0))  # 20 tokens
        await buf.put(group(0))  # 40 tokens: full
        third = asyncio.create_task(buf.put(group(0)))
        for _ in range(10):  # the loop runs the put as far as it gets: nothing else here could let it on
            await asyncio.sleep(0)
        assert not third.done() and buf.tokens == 40
        await buf.take("a", 0)
        await asyncio.wait_for(third, 1.0)
        assert buf.tokens == 40 and buf.groups() == 2
    asyncio.run(scenario())


def test_oversized_group_enters_an_empty_buffer():
    async def scenario():
        buf = RolloutBuffer(max_tokens=10, window=StalenessWindow(1), stale_policy="drop")
        await asyncio.wait_for(buf.put(group(0, tokens_each=50)), 1.0)
        assert buf.tokens == 100
    asyncio.run(scenario())


def test_stale_groups_are_dropped_and_counted():
    async def scenario():
        buf = RolloutBuffer(max_tokens=1000, window=StalenessWindow(1), stale_policy="drop")
        await buf.put(group(0, n=3))  # lag 2 at version 2: dropped
        await buf.put(group(1, n=3))  # lag 1: kept
        got = await buf.take("a", 2)
        assert got.version == 1
        assert [s.policy_lag for s in got.samples] == [1, 1, 1]
        assert buf.counters.dropped_stale == 3 and buf.counters.admitted_stale == 0
        assert buf.tokens == 0
    asyncio.run(scenario())


def test_is_correct_admits_stale_groups_marked_for_correction():
    async def scenario():
        buf = RolloutBuffer(max_tokens=1000, window=StalenessWindow(0), stale_policy="is-correct")
        await buf.put(group(3, n=2))
        got = await buf.take("a", 5)
        assert all(s.stale and s.policy_lag == 2 for s in got.samples)
        assert buf.counters.admitted_stale == 2 and buf.counters.dropped_stale == 0
    asyncio.run(scenario())


def spanning(versions, reward=1.0):
    """A completion continued on newer versions (partial rollouts): `versions` per token."""
    n = len(versions)
    return TrainSample("a", min(versions), [1, 2], list(range(10, 10 + n)), [-0.5] * n, reward,
                       versions=None if len(set(versions)) == 1 else versions)


def test_a_sample_spanning_versions_is_judged_by_the_version_it_finished_on():
    """At learner v4 with max_staleness 1, a sample begun on v2 and finished on v3 trains (its
    continuation is not thrown away); only its v2 tokens are marked, for importance correction."""
    buf = RolloutBuffer(max_tokens=1000, window=StalenessWindow(1), stale_policy="drop")
    continued, fresh = spanning([2, 2, 3, 3]), spanning([3, 3, 3], reward=0.0)
    assert buf.admit(Group("a", 2, 0, [continued, fresh]), learner_version=4)
    assert continued.policy_lag == 2 and continued.token_lags() == [2, 2, 1, 1]  # lag: the oldest token's
    assert continued.token_stale() == [True, True, False, False] and continued.stale
    assert fresh.token_stale() == [False] * 3 and not fresh.stale and fresh.policy_lag == 1
    assert (buf.counters.stale_tokens_corrected, buf.counters.dropped_stale, buf.counters.admitted_stale) == (2, 0, 0)
    mb = build_micro_batch([continued, fresh], [[0, 1]], pad_id=0, device=torch.device("cpu"))
    assert mb.stale.tolist() == [True, True, False, False, False, False, False]  # token by token
    assert mb.lag.tolist() == [2, 2, 1, 1, 1, 1, 1]


def test_a_sample_that_finished_outside_the_window_is_dropped_as_before():
    buf = RolloutBuffer(max_tokens=1000, window=StalenessWindow(1), stale_policy="drop")
    assert not buf.admit(Group("a", 2, 0, [spanning([2, 2]), spanning([3, 3])]), learner_version=4)  # v2: 2 behind
    assert not buf.admit(Group("a", 1, 0, [spanning([1, 2])]), learner_version=4)  # finished on v2
    assert buf.counters.dropped_stale == 3 and buf.counters.stale_tokens_corrected == 0


def test_is_correct_marks_every_token_outside_the_window_of_a_late_group():
    buf = RolloutBuffer(max_tokens=1000, window=StalenessWindow(1), stale_policy="is-correct")
    late, fresh = spanning([1, 2]), spanning([3, 3])
    assert buf.admit(Group("a", 1, 0, [late, fresh]), learner_version=4)
    assert late.token_stale() == [True, True] and fresh.token_stale() == [False, False]
    assert buf.counters.admitted_stale == 2 and buf.counters.stale_tokens_corrected == 2


def test_adapters_have_separate_queues():
    async def scenario():
        buf = RolloutBuffer(max_tokens=1000, window=StalenessWindow(1), stale_policy="drop")
        await buf.put(group(0, adapter="x"))
        await buf.put(group(0, adapter="y"))
        assert (await buf.take("y", 0)).adapter == "y"
        assert buf.groups("x") == 1 and buf.groups("y") == 0
    asyncio.run(scenario())


def test_informative_groups():
    g = group(0)
    for s, a in zip(g.samples, group_advantages(g.rewards)):
        s.advantage = a
    assert g.informative
    flat = group(0, reward=(1.0, 1.0))
    assert not flat.informative
