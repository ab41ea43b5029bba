"""The data-parallel learner (`learner.devices`): the update of one learner, resume across rank
counts, dead and hung ranks, placement, and one real CLI run with two CPU ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lora_async.buffer import TrainSample
from lora_async.checkpoint import RunState, load_checkpoint, save_checkpoint
from lora_async.config import LearnerConfig, LoraConfig, default_loss
from lora_async.errors import TrainingError
from lora_async.learner import Learner
from lora_async.learner.packing import plan_step
from lora_async.learner.parallel import ParallelLearner, RankTimeouts, assign_micro_batches
from lora_async.placement import Placement, PlacementError, available_cpus, rank_placements, resolve

from .helpers import WHOLE_RUN_TIMEOUT_S

# Data-parallel ranks are spawned processes, each building a learner: the slow tier.
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(len(available_cpus()) < 2, reason="two CPU ranks need two cores")]

# fp32 throughout. The micro-batches are identical to one learner's, so step 1's losses are too;
# only the order in which the fp32 gradients are summed differs (each rank's share, then across
# ranks), ~1e-7 relative. AdamW divides each gradient by sqrt(v) + 1e-8, so an element whose
# gradient is near 1e-8 can turn that into a visible part of its lr-sized step. Measured with lr
# 1e-3: weights 1e-9 apart after one step, 5e-7 after two; ATOL leaves 20x of margin. Step 2
# then runs on weights that differ a little, and its loss (a sum of +-advantage terms under
# ratios up to ~40 on this random model) moves by ~1e-6 relative: hence rel 1e-5 there.
ATOL = 1e-5
LR = 1e-3
ADAPTERS = {"main": (LoraConfig(rank=8), LR)}
LEARNER = LearnerConfig(dtype="float32", token_budget=48)  # a group per micro-batch: several per step
ONE_CORE_EACH = [Placement("cpu", frozenset({0})), Placement("cpu", frozenset({1}))]


def plain(model: Path) -> Learner:
    return Learner(model, ADAPTERS, LEARNER, default_loss(), Placement("cpu", None), 1.0, 0)


def parallel(model: Path, timeouts: RankTimeouts = RankTimeouts()) -> ParallelLearner:
    """Two ranks. Rank 1 pins its own process to core 1; rank 0 runs on the calling thread (the
    orchestrator's learner thread is pinned by `setup_run`; the test's thread is left alone)."""
    return ParallelLearner(model, ADAPTERS, LEARNER, default_loss(), ONE_CORE_EACH, 1.0, 0, timeouts=timeouts)


def batch(seed: int, groups: int = 4) -> list[TrainSample]:
    """`groups` GRPO groups of 4 (own prompt, completions of 4 to 10 tokens, advantages +-)."""
    rng = torch.Generator().manual_seed(seed)
    samples = []
    for k in range(groups):
        prompt = torch.randint(5, 2000, (6 + k,), generator=rng).tolist()
        for j in range(4):
            n = 4 + (3 * j + k + seed) % 7
            completion = torch.randint(5, 2000, (n,), generator=rng).tolist()
            # behaviour logprobs near the random model's (about -log(vocab)), so ratios are near 1
            samples.append(TrainSample("main", 0, prompt, completion, [-10.8] * n, 1.0, j - 1.5))
    return samples


def reset(learner: ParallelLearner, source: Learner) -> None:
    """Start `learner` (every rank) from `source`'s weights, optimizer and version."""
    learner.load_adapter_tensors("main", source.adapter_tensors("main"))
    learner.load_state_dict("main", source.state_dict("main"))


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = ATOL) -> None:
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= atol, f"adapters differ by {worst:.2e}"


def assert_ranks_agree(learner: ParallelLearner) -> None:
    ours, theirs = learner.adapter_tensors("main"), learner.rank_adapter_tensors(1, "main")
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.fixture(scope="module")
def pair(tiny_model):
    learner = parallel(tiny_model)
    yield learner
    learner.close()


def test_two_ranks_make_the_update_of_one_learner(pair, tiny_model):
    single = plain(tiny_model)
    reset(pair, single)
    assert os.sched_getaffinity(pair.ranks[0].process.pid) == {1}  # rank 1: one core of its own
    for step in range(2):
        samples = batch(step)
        shares = assign_micro_batches(samples, plan_step(samples, LEARNER.token_budget), 2)
        assert all(shares), "both ranks should have work in this test"
        one, two = single.train_step("main", samples), pair.train_step("main", samples)
        assert two.updated and two.version == one.version == step + 1
        assert (two.micro_batches, two.tokens_trained, two.padded_tokens) == (
            one.micro_batches, one.tokens_trained, one.padded_tokens)
        assert two.loss == pytest.approx(one.loss, rel=1e-12 if step == 0 else 1e-5)
        assert two.grad_norm == pytest.approx(one.grad_norm, rel=1e-5)
        assert two.loss_stats.tokens == one.loss_stats.tokens
        assert two.loss_stats.ratio_max == pytest.approx(one.loss_stats.ratio_max, rel=1e-4)
    assert_close(pair.adapter_tensors("main"), single.adapter_tensors("main"))
    assert_ranks_agree(pair)


def test_a_rank_without_micro_batches_still_steps_with_the_others(pair, tiny_model):
    single = plain(tiny_model)
    reset(pair, single)
    samples = batch(5, groups=1)
    assert assign_micro_batches(samples, plan_step(samples, LEARNER.token_budget), 2) == [[0], []]
    one, two = single.train_step("main", samples), pair.train_step("main", samples)
    assert two.updated and two.micro_batches == 1 and two.loss == pytest.approx(one.loss, rel=1e-12)
    assert_close(pair.adapter_tensors("main"), single.adapter_tensors("main"))
    assert_ranks_agree(pair)  # rank 1 summed zeros and took the same step
    none = pair.train_step("main", [TrainSample("main", 0, [1, 2], [3], [-1.0], 0.0, 0.0)])
    assert not none.updated and none.version == 1  # nothing trainable: no rank is asked


def test_the_ess_scale_is_rank_0s_for_every_rank(pair, tiny_model):
    # the scale comes from every rank's sequences, so it is the one learner's, and each rank steps with it
    single = plain(tiny_model)
    reset(pair, single)
    for learner in (single, pair.local):
        learner.set_objective(default_loss(), "ess")
    try:
        samples = batch(7)
        for i, s in enumerate(samples):
            s.logprobs = [lp + 0.2 * (i % 5) for lp in s.logprobs]  # uneven sequence ratios
        one, two = single.train_step("main", samples), pair.train_step("main", samples)
        assert one.lr_scale < 0.95 and two.lr_scale == pytest.approx(one.lr_scale, rel=1e-9)
        assert_close(pair.adapter_tensors("main"), single.adapter_tensors("main"))
        assert_ranks_agree(pair)
    finally:
        pair.local.set_objective(default_loss(), "none")


def test_checkpoints_resume_with_any_number_of_ranks(pair, tiny_model, tmp_path):
    def checkpoint(learner, out: Path) -> Path:
        version = learner.version("main")
        return save_checkpoint(out, RunState(version, {"main": version}, {"main": 0}, 0.0, {"main": {}}), learner)

    single = plain(tiny_model)
    reset(pair, single)
    pair.train_step("main", batch(0))
    # two ranks -> one: rank 0's state is the checkpoint
    restored = plain(tiny_model)
    load_checkpoint(checkpoint(pair, tmp_path / "two"), restored)
    assert restored.version("main") == 1
    assert_close(restored.adapter_tensors("main"), pair.adapter_tensors("main"), atol=0.0)
    ours, theirs = restored.state_dict("main")["optimizer"], pair.state_dict("main")["optimizer"]
    assert all(torch.equal(ours["state"][i]["exp_avg_sq"], theirs["state"][i]["exp_avg_sq"]) for i in ours["state"])
    # one rank -> two: every rank loads it (weights and AdamW state), so the next steps agree
    restored.train_step("main", batch(1))
    load_checkpoint(checkpoint(restored, tmp_path / "one"), pair)
    assert pair.version("main") == 2
    assert_close(pair.rank_adapter_tensors(1, "main"), restored.adapter_tensors("main"), atol=0.0)
    restored.train_step("main", batch(2))
    pair.train_step("main", batch(2))
    assert pair.version("main") == 3
    assert_close(pair.adapter_tensors("main"), restored.adapter_tensors("main"))
    assert_ranks_agree(pair)  # a rank that kept its own AdamW moments would step elsewhere


def test_a_killed_rank_fails_the_next_step_as_dead_not_as_hung(tiny_model):
    learner = parallel(tiny_model)
    try:
        before = learner.adapter_tensors("main")
        os.kill(learner.ranks[0].process.pid, signal.SIGKILL)
        # its death, seen at once: not the silence timeout (minutes), which says "sent nothing"
        with pytest.raises(TrainingError, match=r"learner rank 1 \(pid \d+\) died \(killed by SIGKILL\)") as info:
            learner.train_step("main", batch(0))
        assert "\n" not in str(info.value)
        with pytest.raises(TrainingError, match="cannot continue"):
            learner.train_step("main", batch(0))
        assert_close(learner.adapter_tensors("main"), before, atol=0.0)  # rank 0's state is still there to save
    finally:
        learner.close()


def test_a_hung_rank_fails_the_step_after_the_silence_timeout(tiny_model):
    learner = parallel(tiny_model, RankTimeouts(silence_s=2.0))
    pid = learner.ranks[0].process.pid
    try:
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(TrainingError, match=r"learner rank 1 .* sent nothing for 2 s .* hung"):  # its timeout's
            learner.train_step("main", batch(0))
    finally:
        learner.close()
    assert not learner.ranks and not os.path.exists(f"/proc/{pid}")  # killed, stopped or not


def test_rank_placements_split_the_learner_cores_and_keep_gpus_apart(monkeypatch):
    assert rank_placements(["cpu", "cpu"], Placement("cpu", frozenset({4, 5, 6}))) == [
        Placement("cpu", frozenset({4})), Placement("cpu", frozenset({5, 6}))]
    with pytest.raises(PlacementError, match="learner.devices: 3 CPU ranks need a core each"):
        rank_placements(["cpu"] * 3, Placement("cpu", frozenset({0, 1})))
    monkeypatch.setattr("lora_async.placement.cuda_available", lambda: True)
    monkeypatch.setattr("lora_async.placement.gpu_count", lambda: 4)
    generator, learner = resolve("auto", None, "auto", None, True, learner_devices=["cuda:0", "cuda:1", "cuda:3"])
    assert (generator.device, learner.device) == ("cuda:2", "cuda:0")  # the generator takes the free GPU
    with pytest.raises(PlacementError, match="takes every GPU"):
        resolve("auto", None, "auto", None, True, learner_devices=[f"cuda:{i}" for i in range(4)])


def test_nccl_between_a_learner_and_a_generator_on_one_gpu_is_refused_before_anything_loads(monkeypatch):
    # NCCL refuses two ranks on one device ("Duplicate GPU detected"): measured on an H200
    from lora_async.config import TrainConfig
    from lora_async.placement import place_run

    monkeypatch.setattr("lora_async.placement.cuda_available", lambda: True)
    monkeypatch.setattr("lora_async.placement.gpu_count", lambda: 1)
    one_gpu = {"generator": {"type": "vllm", "device": "cuda:0", "engine_process": "separate"},
               "learner": {"device": "cuda:0"}}
    with pytest.raises(PlacementError, match=r"sync.transport 'nccl' needs the generator on another GPU.*cuda-ipc"):
        place_run(TrainConfig.model_validate({**one_gpu, "sync": {"transport": "nccl"}}))
    generator, ranks = place_run(TrainConfig.model_validate({**one_gpu, "sync": {"transport": "cuda-ipc"}}))
    assert generator.device == ranks[0].device == "cuda:0"
    monkeypatch.setattr("lora_async.placement.gpu_count", lambda: 2)
    two = {"generator": {"type": "vllm", "device": "cuda:1", "engine_process": "separate"},
           "learner": {"device": "cuda:0"}, "sync": {"transport": "nccl"}}
    generator, ranks = place_run(TrainConfig.model_validate(two))
    assert (generator.device, ranks[0].device) == ("cuda:1", "cuda:0")


def test_a_gpu_this_machine_lacks_exits_2_with_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "lora_async", "train", "--set", 'learner.devices=["cuda:7"]'],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "learner.devices" in lines[0] and "cuda:7" in lines[0], done.stderr
    assert not any(tmp_path.iterdir())  # refused before anything loads (exit 2, the config check's): nothing written


@pytest.mark.slow
def test_cli_trains_with_two_cpu_ranks_and_publishes(tmp_path, tiny_model):
    from lora_async.metrics import read_metrics

    from .test_train import make_config

    # token_budget 48: each group is a micro-batch of its own, so both ranks train every step
    config = make_config(tmp_path, tiny_model, "ddp",
                         learner={"devices": ["cpu", "cpu"], "cpus": "0-1", "token_budget": 48})
    done = subprocess.run([sys.executable, "-m", "lora_async", "train", str(config)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=WHOLE_RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "learner on 2 data-parallel ranks (cpu cores 0; cpu cores 1)" in " ".join(done.stderr.split())
    rows = [r for r in read_metrics(tmp_path / "ddp" / "metrics.jsonl") if "kind" not in r]
    assert [r["version"] for r in rows] == [1, 2, 3]  # rank 0 published every update
    canaries = [r for r in read_metrics(tmp_path / "ddp" / "metrics.jsonl") if r.get("kind") == "canary"]
    assert canaries and all(c["canary_mismatch"] < 0.1 for c in canaries)  # vLLM serves rank 0's weights
    assert (tmp_path / "ddp" / "adapters" / "main" / "v3" / "adapter_model.safetensors").is_file()
    assert json.loads((tmp_path / "ddp" / "summary.json").read_text())["steps"] == 3
