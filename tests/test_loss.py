"""The loss on hand-made tensors, with exact expected values."""

import math

import pytest
import torch

from lora_async.loss import policy_loss


def t(*values):
    return torch.tensor(values, dtype=torch.float64)


def test_ppo_clip_takes_the_pessimistic_branch():
    behaviour = t(0.0, 0.0, 0.0, 0.0)
    logp = t(math.log(1.5), math.log(0.5), math.log(1.1), math.log(0.7))  # ratios 1.5, .5, 1.1, .7
    adv = t(1.0, -1.0, 2.0, -1.0)
    loss, stats = policy_loss(logp, behaviour, adv, None, "ppo-clip", clip_eps=0.2)
    # per token: -min(r*A, clip(r)*A)
    expected = -(min(1.5, 1.2) * 1) - min(0.5 * -1, 0.8 * -1) - min(1.1 * 2, 1.1 * 2) - min(0.7 * -1, 0.8 * -1)
    assert float(loss) == pytest.approx(expected)
    assert stats.tokens == 4
    assert stats.ratio_mean == pytest.approx((1.5 + 0.5 + 1.1 + 0.7) / 4)
    assert stats.ratio_max == pytest.approx(1.5) and stats.ratio_min == pytest.approx(0.5)
    # tokens 1 (r > 1+eps, A > 0), 2 and 4 (r < 1-eps, A < 0) take the clipped branch
    assert stats.clip_frac == pytest.approx(3 / 4)


def test_ppo_clip_gradient_vanishes_when_clipped():
    logp = t(math.log(1.5)).requires_grad_(True)
    loss, _ = policy_loss(logp, t(0.0), t(1.0), None, "ppo-clip", clip_eps=0.2)
    loss.backward()
    assert float(logp.grad) == 0.0
    logp = t(math.log(1.1)).requires_grad_(True)
    loss, _ = policy_loss(logp, t(0.0), t(1.0), None, "ppo-clip", clip_eps=0.2)
    loss.backward()
    assert float(logp.grad) == pytest.approx(-1.1)  # d(-r*A)/dlogp = -r*A


def test_tis_truncates_and_stops_the_gradient_through_the_weight():
    logp = t(math.log(3.0), math.log(0.5)).requires_grad_(True)
    adv = t(1.0, 1.0)
    loss, stats = policy_loss(logp, t(0.0, 0.0), adv, None, "tis", ratio_cap=2.0)
    # weights min(r, 2) = 2, 0.5 (detached): loss = -(2*logp1 + 0.5*logp2)
    assert float(loss) == pytest.approx(-(2 * math.log(3.0) + 0.5 * math.log(0.5)))
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-2.0, -0.5])
    assert stats.clip_frac == pytest.approx(0.5)


def test_decoupled_weights_by_the_sampling_lag_and_leaves_out_tokens_over_the_cap():
    # ratios to the sampling version 1.5, 0.5, 3.0 (over the cap of 2: left out)
    logp = t(math.log(1.5), math.log(0.5), math.log(3.0)).requires_grad_(True)
    adv = t(1.0, -1.0, 1.0)
    loss, stats = policy_loss(logp, t(0.0, 0.0, 0.0), adv, None, "decoupled", clip_eps=0.2, ratio_cap=2.0)
    # the proximal ratio is 1 in value: loss = -(1.5 * 1 + 0.5 * -1 + 0)
    assert float(loss) == pytest.approx(-(1.5 - 0.5))
    loss.backward()
    # d/dlogp = -w * A for kept tokens, 0 for the left-out one
    assert logp.grad.tolist() == pytest.approx([-1.5, 0.5, 0.0])
    assert stats.clip_frac == pytest.approx(1 / 3)


def test_decoupled_keeps_the_gradient_ppo_clip_loses_under_lag():
    # A sample one version old whose ratio already drifted past 1 + eps with A > 0: ppo-clip
    # (anchored at the sampling version) gives it no gradient; decoupled still pushes it.
    for kind, want in (("ppo-clip", 0.0), ("decoupled", -1.5)):
        logp = t(math.log(1.5)).requires_grad_(True)
        loss, _ = policy_loss(logp, t(0.0), t(1.0), None, kind, clip_eps=0.2, ratio_cap=2.0)
        loss.backward()
        assert float(logp.grad) == pytest.approx(want), kind


def test_none_is_plain_policy_gradient():
    logp = t(-1.0, -2.0).requires_grad_(True)
    loss, stats = policy_loss(logp, t(-3.0, -0.5), t(2.0, -1.0), None, "none")
    assert float(loss) == pytest.approx(-(2 * -1.0) - (-1 * -2.0))
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-2.0, 1.0])
    assert stats.logprob_mismatch == pytest.approx((2.0 + 1.5) / 2)


def test_none_with_stale_samples_uses_the_truncated_weight():
    logp = t(math.log(3.0), math.log(3.0)).requires_grad_(True)
    stale = torch.tensor([True, False])
    loss, _ = policy_loss(logp, t(0.0, 0.0), t(1.0, 1.0), None, "none", ratio_cap=2.0, stale=stale)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-2.0, -1.0])


def test_kl_k3_against_reference():
    logp = t(-1.0, -2.0)
    ref = t(-1.5, -2.0)
    loss, stats = policy_loss(logp, logp.clone(), t(0.0, 0.0), None, "none", kl_coef=0.5, ref_logp=ref)
    k3 = math.exp(-0.5) - (-0.5) - 1
    assert float(loss) == pytest.approx(0.5 * k3)
    assert stats.kl == pytest.approx(k3 / 2)


def test_mask_excludes_padding_tokens():
    loss, stats = policy_loss(t(-1.0, -5.0), t(-1.0, -1.0), t(1.0, 1.0), t(1.0, 0.0), "none")
    assert float(loss) == pytest.approx(1.0)
    assert stats.tokens == 1


def test_unknown_loss_type():
    with pytest.raises(ValueError):
        policy_loss(t(0.0), t(0.0), t(0.0), None, "bogus")
