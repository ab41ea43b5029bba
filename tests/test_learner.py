"""The learner's objective on the tiny model: the loss a step uses, the ESS learning-rate scale,
and adapters added and removed while it lives (what the staleness benchmark's arms share)."""

from __future__ import annotations

import contextlib
import ctypes
import math
import os

import pytest
import torch

from lora_async.buffer import TrainSample
from lora_async.config import LOSS_TYPES, LearnerConfig, LoraConfig, default_loss, loss_of
from lora_async.learner import Learner, heap
from lora_async.placement import Placement


def learner(model, **settings) -> Learner:
    return Learner(model, {"main": (LoraConfig(rank=8), 1e-2)}, LearnerConfig(dtype="float32", **settings),
                   default_loss(), Placement("cpu", None), 1.0, 0)


def samples(adapter: str = "main", spread: float = 0.0) -> list[TrainSample]:
    """Two groups of 4; behaviour logprobs about the random model's own, each sample's shifted by
    `spread` times its index, so the sequence ratios differ (an ESS below 1) when spread > 0."""
    rng = torch.Generator().manual_seed(0)
    out = []
    for g in range(2):
        prompt = torch.randint(5, 2000, (5 + g,), generator=rng).tolist()
        for j in range(4):
            completion = torch.randint(5, 2000, (4 + j,), generator=rng).tolist()
            behaviour = [-10.8 + spread * (4 * g + j)] * len(completion)
            out.append(TrainSample(adapter, 0, prompt, completion, behaviour, 1.0, j - 1.5))
    return out


def weights(lrn: Learner, adapter: str = "main") -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in lrn.adapter_tensors(adapter).items()}


def delta(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([(after[k] - before[k]).flatten() for k in before])


@pytest.mark.parametrize("kind", LOSS_TYPES)
def test_ess_scale_moves_the_adapter_by_sqrt_ess_of_the_plain_step_with_every_loss(tiny_model, kind):
    # Adam's first step is lr * g / (|g| + eps) per coordinate: the same direction whatever the
    # gradient's size, so a step at lr * s moves every weight s times as far
    plain, scaled = learner(tiny_model), learner(tiny_model, lr_scale="ess")
    for lrn in (plain, scaled):
        lrn.set_objective(loss_of(kind), lrn.cfg.lr_scale)
    batch = samples(spread=0.3)
    before = weights(plain)
    one, two = plain.train_step("main", batch), scaled.train_step("main", batch)
    assert one.lr_scale == 1.0
    ess = two.loss_stats.ess_frac
    assert ess is not None and 0.0 < ess < 0.9
    assert two.lr_scale == pytest.approx(math.sqrt(ess))
    moved_plain, moved_scaled = delta(weights(plain), before), delta(weights(scaled), before)
    torch.testing.assert_close(moved_scaled, moved_plain * two.lr_scale, rtol=1e-4, atol=1e-7)
    # the configured rate is what the optimizer keeps (a checkpoint saves it, not a step's)
    assert scaled.adapters["main"].optimizer.param_groups[0]["lr"] == 1e-2


def test_ess_scale_is_one_when_every_sequence_weighs_the_same(tiny_model):
    lrn = learner(tiny_model, lr_scale="ess")
    batch = samples()
    logprobs = lrn.logprobs("main", batch)  # the learner's own: every ratio 1
    for s, lp in zip(batch, logprobs):
        s.logprobs = lp
    stats = lrn.train_step("main", batch)
    assert stats.loss_stats.ess_frac == pytest.approx(1.0, abs=1e-6) and stats.lr_scale == pytest.approx(1.0, abs=1e-6)


def test_the_step_reports_its_tokens_by_lag(tiny_model):
    lrn = learner(tiny_model)
    batch = samples()
    for s in batch[4:]:
        s.policy_lag = 2
    stats = lrn.train_step("main", batch)
    by_lag = stats.loss_stats.by_lag
    assert set(by_lag) == {0, 2}
    assert by_lag[0].tokens == sum(s.trained_tokens for s in batch[:4])
    assert len(by_lag[2].seq_log_weights) == 4 and by_lag[2].negative == 2 and by_lag[2].positive == 2


def test_an_added_adapter_starts_where_a_new_learners_first_one_does(tiny_model):
    first = learner(tiny_model)
    first.train_step("main", samples())
    first.add_adapter("arm", LoraConfig(rank=8), 1e-2, 1.0, seed=0)
    fresh = learner(tiny_model)
    added, new = first.adapter_tensors("arm"), fresh.adapter_tensors("main")
    assert added.keys() == new.keys() and all(torch.equal(added[k], new[k]) for k in new)
    assert first.version("arm") == 0
    # another seed, other weights
    first.add_adapter("other", LoraConfig(rank=8), 1e-2, 1.0, seed=1)
    assert not all(torch.equal(first.adapter_tensors("other")[k], new[k]) for k in new)


def test_a_removed_adapter_is_gone_and_the_next_one_trains_with_its_own_objective(tiny_model):
    lrn = learner(tiny_model)
    lrn.add_adapter("arm", LoraConfig(rank=8), 1e-2, 1.0, seed=0)
    lrn.remove_adapter("main")
    assert list(lrn.adapters) == ["arm"] and "main" not in lrn.model.peft_config
    assert not any(".main." in name for name, _ in lrn.model.named_parameters())
    lrn.set_objective(loss_of("cispo"), "ess")
    stats = lrn.train_step("arm", samples("arm", spread=0.3))
    assert stats.updated and lrn.version("arm") == 1 and stats.lr_scale < 1.0
    with pytest.raises(ValueError, match="already has"):
        lrn.add_adapter("arm", LoraConfig(rank=8), 1e-2, 1.0, seed=0)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


@contextlib.contextmanager
def freed_holes(libc, mib: int = 128):
    """`mib` MiB that malloc freed in the middle of its heap (every other 4 MiB block), where glibc
    keeps them, as it keeps a CPU step's freed activations; the blocks between are freed on exit."""
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free(libc.malloc(30 << 20))  # a freed mmapped block raises the mmap threshold, as torch's first frees do
    blocks = [libc.malloc(4 << 20) for _ in range(mib // 2)]
    for b in blocks:
        ctypes.memset(b, 1, 4 << 20)
    for b in blocks[::2]:
        libc.free(b)
    try:
        yield
    finally:
        for b in blocks[1::2]:
            libc.free(b)


glibc = pytest.mark.skipif(heap._libc() is None, reason="glibc's malloc_trim only")


@glibc
def test_release_freed_memory_returns_the_heaps_holes():
    libc = heap._libc()
    with freed_holes(libc):
        kept = rss_mib()
        assert heap.release_freed_memory()
        assert kept - rss_mib() > 100


@glibc
def test_a_cpu_step_returns_what_malloc_kept(tiny_model):
    lrn = learner(tiny_model)
    lrn.train_step("main", samples())
    with freed_holes(heap._libc()):
        kept = rss_mib()
        lrn.train_step("main", samples())
        assert kept - rss_mib() > 100


def test_the_step_counts_the_cpu_time_it_took(tiny_model):
    # the step row's learner_cpu_s (a diagnostic: CPU seconds over the learner's step)
    lrn = learner(tiny_model)
    stats = lrn.train_step("main", samples())
    assert 0.0 < stats.cpu_s and stats.seconds > 0.0
    # the process's CPU time over the step: at most every core's worth of the wall time
    assert stats.cpu_s <= stats.seconds * os.cpu_count() + 0.05  # type: ignore[operator]


def test_the_speed_probe_times_a_pass_and_leaves_the_adapter_as_it_was(tiny_model):
    # auto's start-up calibration of the learner (learner/probe.py): no update, no version, no
    # gradient left behind, the run's random stream untouched
    from lora_async.learner import probe

    lrn = learner(tiny_model)
    before = {k: v.clone() for k, v in lrn.adapter_tensors("main").items()}
    rng = torch.random.get_rng_state()
    per_token = probe.seconds_per_token(lrn, Placement("cpu", frozenset(os.sched_getaffinity(0))))
    assert 0.0 < per_token < 1.0
    assert lrn.version("main") == 0
    assert all(p.grad is None for p in lrn.model.parameters())
    assert all(torch.equal(before[k], v) for k, v in lrn.adapter_tensors("main").items())
    assert torch.equal(torch.random.get_rng_state(), rng)
