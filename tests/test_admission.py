"""Rules written once: which runs are synchronous; the staleness window as the buffer, the
learner step's abort and admission ask it, held in force in one object; the admission owner's
counts; and when a flat group trains (`loss.has_gradient`)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from rich.console import Console

from lora_async.buffer import Group, RolloutBuffer, TrainSample
from lora_async.config import BufferConfig, loss_of
from lora_async.learner import Learner
from lora_async.loss import has_gradient
from lora_async.mode import Choice, Mode, initial_choice
from lora_async.orchestrator import train
from lora_async.orchestrator.admission import Admission, expected_lag, may_start
from lora_async.orchestrator.batches import trains_on
from lora_async.staleness import StalenessWindow, WindowInForce

from .fakes import FakeParts
from .test_orchestrator import config as fake_run_config


@pytest.mark.parametrize("mode, max_staleness, synchronous", [
    ("sync", 4, True), ("auto", 0, True), ("sync", 0, True), ("auto", 2, False), ("async", 3, False)])
def test_which_runs_are_synchronous_is_said_once(mode, max_staleness, synchronous):
    widest = StalenessWindow.widest(mode, max_staleness)
    assert widest.synchronous == synchronous and widest.max_staleness == (0 if synchronous else max_staleness)
    buffer = BufferConfig(mode=mode, max_staleness=max_staleness)
    assert buffer.window == widest and buffer.synchronous == synchronous
    assert not (synchronous and buffer.concurrent_from_start)
    choice = initial_choice(mode, max_staleness, shared=True, split=False)
    assert (choice is not None and choice.synchronous) == synchronous
    if choice is not None:  # pinned by the config: its widest window
        assert choice.window == widest


def test_a_choice_is_sync_exactly_at_staleness_zero():
    assert Choice(Mode.SYNC, 0, False, "x").window == StalenessWindow(0)
    assert Choice(Mode.ASYNC, 2, True, "x").window == StalenessWindow(2)
    for mode, staleness in ((Mode.ASYNC, 0), (Mode.SYNC, 2)):
        with pytest.raises(ValueError, match="sync is staleness 0"):
            Choice(mode, staleness, False, "x")


def test_the_window_in_force_is_one_object_the_buffer_and_every_admission_ask():
    window = WindowInForce(StalenessWindow(0))
    buffer = RolloutBuffer(10_000, window, "drop")
    admissions = [Admission(window), Admission(window)]
    for admission in admissions:
        admission.version_published(0)
        admission.step_began()  # a group started now trains one version behind
    assert window.synchronous and not buffer.window.admits(1)
    assert not any(a.may_start(0, 0, 4) for a in admissions)
    window.current = StalenessWindow(1)  # what a switch to async does (`auto.apply_choice`), once
    assert not window.synchronous and buffer.window.admits(1) and not buffer.window.admits(2)
    assert all(a.may_start(0, 0, 4) for a in admissions)


def test_a_run_holds_its_window_in_force_once(tmp_path):
    cfg = fake_run_config(tmp_path, buffer={"mode": "async", "max_staleness": 2}, run={"max_steps": 2, "canary_every": 0})
    seen: list[bool] = []

    def check(run) -> None:
        seen.append(run.buffer.window is run.window and all(a.admission.window is run.window
                                                            for a in run.adapters.values()))
        assert run.window.current == StalenessWindow(2)

    asyncio.run(train(cfg, console=Console(quiet=True), on_step=check,
                      parts=FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.01)))
    assert seen == [True, True]


def test_admission_rule():
    sync, one = StalenessWindow(0), StalenessWindow(1)
    # synchronous training: producers only while the learner waits for a batch
    assert may_start(False, 0, 8, sync) and may_start(False, 7, 8, sync)
    assert not may_start(False, 8, 8, sync) and not may_start(True, 0, 8, sync)
    # one step of staleness: one batch ahead while training, two while waiting
    assert may_start(True, 7, 8, one) and not may_start(True, 8, 8, one)
    assert may_start(False, 15, 8, one) and not may_start(False, 16, 8, one)
    # a hand-off on its way: the served version is already one behind the learner
    assert not may_start(False, 0, 8, sync, unpublished=1)
    assert not may_start(True, 0, 8, one, unpublished=1) and may_start(False, 7, 8, one, unpublished=1)


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_admission_starts_a_group_exactly_when_the_buffer_would_keep_it(staleness):
    """A group admitted with expected lag L is trained L versions behind: the buffer must keep
    it, and the first group admission refuses is one the buffer would drop."""
    window = StalenessWindow(staleness)
    buffer = RolloutBuffer(10_000, window, "drop")
    for busy in (False, True):
        for queued in range(40):
            lag = expected_lag(busy, queued, 4)
            sample = TrainSample("a", 10, [1], [2], [-0.1], 1.0)
            kept = buffer.admit(Group("a", 10, 0, [sample]), 10 + lag)
            assert may_start(busy, queued, 4, window) == kept


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_a_step_aborts_exactly_the_versions_its_new_version_leaves_outside_the_window(staleness):
    """`loop.train_step` stops rollouts below `window.oldest(version + 1)`: those, and only those,
    the buffer would drop once the step's version is out."""
    window = StalenessWindow(staleness)
    buffer = RolloutBuffer(10_000, window, "drop")
    learner_version = 5
    for sampled_on in range(0, learner_version + 1):
        aborted = sampled_on < window.oldest(learner_version + 1)
        sample = TrainSample("a", sampled_on, [1], [2], [-0.1], 1.0)
        assert aborted == (not buffer.admit(Group("a", sampled_on, 0, [sample]), learner_version + 1))


def test_the_admission_owner_counts_every_group_between_admission_and_the_learner():
    admission = Admission(StalenessWindow(1))
    per_step = 2
    assert admission.unpublished(0) == 1  # nothing served yet
    admission.version_published(0)
    for _ in range(3):
        assert admission.may_start(buffered=0, learner_version=0, groups_per_step=per_step)
        admission.group_started()
    assert not admission.may_start(1, 0, per_step)  # 3 generating + 1 buffered: two steps out
    assert admission.may_start(0, 0, per_step)
    admission.group_finished()  # into the buffer: still counted, as buffered
    assert admission.in_flight == 2 and not admission.may_start(2, 0, per_step)
    admission.batch_holds(collected=2, carried=1)  # the collector took them (one left for later)
    assert not admission.may_start(0, 0, per_step)  # 2 generating + 2 collected + 1 carried
    admission.step_began()  # the learner took the batch: collected leave the count, the step adds one
    assert admission.busy and admission.collected == 0
    assert admission.may_start(0, 0, per_step) is False  # busy + (2 + 1) // 2 = 2
    admission.group_finished()
    admission.group_finished()
    assert admission.may_start(0, 0, per_step)  # busy + 1 // 2 = 1
    admission.step_ended()
    # the step made version 1; until it is served, groups start on version 0, one behind
    assert admission.unpublished(1) == 1 and not admission.may_start(2, 1, per_step)
    admission.version_published(1)
    assert admission.unpublished(1) == 0 and admission.may_start(2, 1, per_step)


def samples_with(advantages: list[float]) -> list[TrainSample]:
    return [TrainSample("a", 0, [1], [2, 3], [-0.1, -0.2], 1.0, a) for a in advantages]


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("skip_flat", [True, False])
def test_the_collector_and_the_learner_ask_one_rule_when_a_flat_group_trains(kl_coef, skip_flat):
    """A flat group (every advantage 0) has a gradient only through the KL term; the collector
    keeps it then (or always, without filtering), and the learner trains its samples then."""
    assert has_gradient(0.5, 0.0) and has_gradient(0.0, 0.1) and not has_gradient(0.0, 0.0)
    run = SimpleNamespace(config=SimpleNamespace(loss=loss_of("ppo-clip", kl_coef=kl_coef),
                                                 learner=SimpleNamespace(skip_flat_groups=skip_flat)))
    learner = SimpleNamespace(loss_cfg=loss_of("ppo-clip", kl_coef=kl_coef))
    flat, informative = samples_with([0.0, 0.0]), samples_with([1.0, -1.0])
    assert trains_on(run, Group("a", 0, 0, informative))
    assert Learner.trainable(learner, informative) == informative
    kept = trains_on(run, Group("a", 0, 0, flat))
    trained = Learner.trainable(learner, flat)
    assert kept == (kl_coef > 0 or not skip_flat)
    assert (trained == flat) == (kl_coef > 0)  # without KL a flat group taken as it came moves nothing


def test_the_buffer_keeps_its_window():
    async def scenario():
        buffer = RolloutBuffer(10_000, StalenessWindow(2), "drop")
        for version in (0, 1, 2, 3):
            await buffer.put(Group("a", version, version, [TrainSample("a", version, [1], [2], [-0.1], 1.0)]))
        got = await buffer.take("a", 3)
        assert got.version == 1 and buffer.counters.dropped_stale == 1  # v0 is 3 behind v3

    asyncio.run(scenario())
