"""Token-level trajectories in the learner: the trained mask, per-token versions and lags, and
logprobs that equal an unpacked forward (episodes interleave sampled and environment tokens)."""

import math

import torch

from lora_async.buffer import Group, RolloutBuffer, TrainSample
from lora_async.learner.packing import build_micro_batch, plan_step
from lora_async.config import loss_of
from lora_async.loss import policy_loss
from lora_async.staleness import StalenessWindow

PROMPT = [1, 510, 2114, 314, 260]
# turn 1 sampled on v3 | environment/template delta | turn 2 sampled on v4 (v5 after a switch)
TURN1, ENV, TURN2 = [44, 55, 66], [2, 198, 1, 4093, 198], [77, 88, 99, 111]


def episode(logprob_env: float = 0.0, advantage: float = 1.0) -> TrainSample:
    ids = TURN1 + ENV + TURN2
    trained = [True] * 3 + [False] * 5 + [True] * 4
    versions = [3, 3, 3] + [-1] * 5 + [4, 4, 5, 5]
    logprobs = [-0.1, -0.2, -0.3] + [logprob_env] * 5 + [-0.4, -0.5, -0.6, -0.7]
    return TrainSample("a", 3, PROMPT, ids, logprobs, 1.0, advantage, trained=trained, versions=versions)


def test_only_sampled_tokens_are_targets_token_by_token():
    s = episode()
    mb = build_micro_batch([s], [[0]], pad_id=0, device=torch.device("cpu"))
    assert mb.targets.tolist() == TURN1 + TURN2
    p = len(PROMPT)
    # each sampled token is predicted from the position before it; environment positions never
    want_cols = [p - 1, p, p + 1] + [p + 7, p + 8, p + 9, p + 10]
    assert mb.cols.tolist() == want_cols
    env_positions = set(range(p + 3, p + 8))
    assert not {c + 1 for c in mb.cols.tolist()} & env_positions  # no environment token is a target
    assert mb.behaviour.tolist() == torch.tensor([-0.1, -0.2, -0.3, -0.4, -0.5, -0.6, -0.7]).tolist()
    assert mb.lengths == [7]
    # the input holds the whole conversation: environment tokens are context
    assert mb.input_ids[0, : p + 12].tolist() == PROMPT + TURN1 + ENV + TURN2


def test_each_token_has_its_own_lag():
    buffer = RolloutBuffer(10_000, window=StalenessWindow(4), stale_policy="drop")
    s = episode()
    group = Group("a", s.version, 0, [s])
    assert buffer.admit(group, learner_version=6)
    assert s.policy_lag == 3  # counted on the oldest trained token (v3)
    mb = build_micro_batch([s], [[0]], pad_id=0, device=torch.device("cpu"))
    assert mb.lag.tolist() == [3, 3, 3, 2, 2, 1, 1]
    assert s.version_span == 2


def test_staleness_counts_the_version_a_sample_finished_on_and_marks_older_tokens():
    buffer = RolloutBuffer(10_000, window=StalenessWindow(2), stale_policy="drop")
    s = episode()  # tokens from v3 to v5
    assert buffer.admit(Group("a", s.version, 0, [s]), learner_version=6)  # it finished on v5: 1 behind
    assert s.policy_lag == 3  # still the oldest token's lag
    # only the v3 tokens are outside the window; environment tokens are never marked
    assert s.token_stale() == [True] * 3 + [False] * 9
    assert buffer.counters.stale_tokens_corrected == 3 and buffer.counters.dropped_stale == 0
    mb = build_micro_batch([s], [[0]], pad_id=0, device=torch.device("cpu"))
    assert mb.stale.tolist() == [True] * 3 + [False] * 4  # one mark per trained token
    late = episode()
    assert not buffer.admit(Group("a", late.version, 0, [late]), learner_version=8)  # v5 is 3 behind
    assert buffer.counters.dropped_stale == 1


def test_no_environment_token_reaches_the_loss():
    """Garbage behaviour logprobs on environment tokens change nothing: they are never read."""
    torch.manual_seed(0)
    losses = []
    for env_logprob in (0.0, float("nan"), 1e9):
        s = episode(logprob_env=env_logprob)
        mb = build_micro_batch([s], [[0]], pad_id=0, device=torch.device("cpu"))
        logp = torch.linspace(-1.0, -0.1, mb.targets.numel(), requires_grad=True)
        loss, stats = policy_loss(logp, mb.behaviour, mb.advantages, loss_of("ppo-clip"))
        loss.backward()
        assert stats.tokens == 7 and math.isfinite(float(loss))
        losses.append((float(loss), logp.grad.clone()))
    assert all(abs(loss - losses[0][0]) < 1e-9 for loss, _ in losses)
    assert all(torch.equal(grad, losses[0][1]) for _, grad in losses)


def test_episode_logprobs_equal_an_unpacked_forward(tiny_model):
    """Two episodes sharing an opening (one prompt tree), packed with a single-turn sample and
    split over micro-batches: the trained tokens' logprobs equal a plain forward, to 1e-5."""
    from lora_async.config import LearnerConfig, LoraConfig, default_loss
    from lora_async.learner import Learner
    from lora_async.placement import Placement

    learner = Learner(tiny_model, {"a": (LoraConfig(rank=8), 1e-3)},
                      LearnerConfig(dtype="float32", token_budget=40), default_loss(), Placement("cpu", None), 0.8, 0)
    rng = torch.Generator().manual_seed(1)
    learner.load_adapter_tensors("a", {k: torch.randn(v.shape, generator=rng) * 0.05
                                       for k, v in learner.adapter_tensors("a").items()})
    other = TrainSample("a", 2, PROMPT, [300, 301, 302, 2, 198, 1, 303, 304],
                        [-1.0] * 8, 0.0, -1.0, trained=[True, True, True, False, False, False, True, True],
                        versions=[2, 2, 2, -1, -1, -1, 3, 3])
    single = TrainSample("a", 3, [1, 900, 901], [400, 401, 402], [-1.0] * 3, 1.0, 1.0)
    samples = [episode(), other, single]
    assert len(plan_step(samples, 40)) > 1
    packed = learner.logprobs("a", samples)
    for s, got in zip(samples, packed):
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        with torch.no_grad():
            logits = learner.model(input_ids=ids).logits[0].float() / 0.8
        logp = logits.log_softmax(-1)
        p = len(s.prompt_ids)
        want = [float(logp[p + j - 1, s.completion_ids[j]]) for j, t in enumerate(s.token_trained()) if t]
        assert len(got) == s.trained_tokens
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-5)


def test_a_step_trains_only_sampled_tokens(tiny_model):
    from lora_async.config import LearnerConfig, LoraConfig, default_loss
    from lora_async.learner import Learner
    from lora_async.placement import Placement

    learner = Learner(tiny_model, {"a": (LoraConfig(rank=8), 1e-3)},
                      LearnerConfig(dtype="float32"), default_loss(), Placement("cpu", None), 1.0, 0)
    stats = learner.train_step("a", [episode(advantage=1.0), episode(logprob_env=float("nan"), advantage=-1.0)])
    assert stats.updated and stats.tokens_trained == 14 and math.isfinite(stats.loss)
