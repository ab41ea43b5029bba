"""The losses on hand-made tensors, with exact expected values: each loss's value and gradient
against its formula worked by hand, REINFORCE's gradient at lag 0 for every loss, and the share
each one clips or masks on a batch built to need it; then the figures by lag."""

import math

import pytest
import torch

from lora_async.config import LOSS_TYPES, loss_of
from lora_async.lag_figures import LagStats, ess_fraction, run_averages
from lora_async.loss import LOSSES, m2po_mask, policy_loss


def t(*values):
    return torch.tensor(values, dtype=torch.float64)


def grad_of(kind, logp_values, behaviour, adv, **settings):
    """(loss, stats, d loss / d logp) for a loss config of `kind`."""
    logp = t(*logp_values).requires_grad_(True)
    loss, stats = policy_loss(logp, behaviour, adv, loss_of(kind, **settings))
    loss.backward()
    return float(loss.detach()), stats, logp.grad.tolist()


def test_every_configured_loss_has_a_function_and_back():
    assert set(LOSSES) == set(LOSS_TYPES)


# ---------------------------------------------------------------- each loss, by hand


def test_ppo_clip_takes_the_pessimistic_branch():
    behaviour = t(0.0, 0.0, 0.0, 0.0)
    logp = t(math.log(1.5), math.log(0.5), math.log(1.1), math.log(0.7))  # ratios 1.5, .5, 1.1, .7
    adv = t(1.0, -1.0, 2.0, -1.0)
    loss, stats = policy_loss(logp, behaviour, adv, loss_of("ppo-clip", clip_eps=0.2))
    # per token: -min(r*A, clip(r)*A)
    expected = -(min(1.5, 1.2) * 1) - min(0.5 * -1, 0.8 * -1) - min(1.1 * 2, 1.1 * 2) - min(0.7 * -1, 0.8 * -1)
    assert float(loss) == pytest.approx(expected)
    assert stats.tokens == 4
    assert stats.ratio_mean == pytest.approx((1.5 + 0.5 + 1.1 + 0.7) / 4)
    assert stats.ratio_max == pytest.approx(1.5) and stats.ratio_min == pytest.approx(0.5)
    # tokens 1 (r > 1+eps, A > 0), 2 and 4 (r < 1-eps, A < 0) take the clipped branch
    assert stats.clip_frac == pytest.approx(3 / 4)


def test_ppo_clip_gradient_vanishes_when_clipped():
    _, _, grad = grad_of("ppo-clip", [math.log(1.5)], t(0.0), t(1.0), clip_eps=0.2)
    assert grad == [0.0]
    _, _, grad = grad_of("ppo-clip", [math.log(1.1)], t(0.0), t(1.0), clip_eps=0.2)
    assert grad == pytest.approx([-1.1])  # d(-r*A)/dlogp = -r*A


def test_tis_truncates_and_stops_the_gradient_through_the_weight():
    loss, stats, grad = grad_of("tis", [math.log(3.0), math.log(0.5)], t(0.0, 0.0), t(1.0, 1.0), ratio_cap=2.0)
    # weights min(r, 2) = 2, 0.5 (detached): loss = -(2*logp1 + 0.5*logp2)
    assert loss == pytest.approx(-(2 * math.log(3.0) + 0.5 * math.log(0.5)))
    assert grad == pytest.approx([-2.0, -0.5])
    assert stats.clip_frac == pytest.approx(0.5)


def test_decoupled_weights_by_the_sampling_lag_and_leaves_out_tokens_over_the_cap():
    # ratios to the sampling version 1.5, 0.5, 3.0 (over the cap of 2: left out)
    loss, stats, grad = grad_of("decoupled", [math.log(1.5), math.log(0.5), math.log(3.0)], t(0.0, 0.0, 0.0),
                                t(1.0, -1.0, 1.0), clip_eps=0.2, ratio_cap=2.0)
    # the proximal ratio is 1 in value: loss = -(1.5 * 1 + 0.5 * -1 + 0)
    assert loss == pytest.approx(-(1.5 - 0.5))
    # d/dlogp = -w * A for kept tokens, 0 for the left-out one
    assert grad == pytest.approx([-1.5, 0.5, 0.0])
    assert stats.clip_frac == pytest.approx(1 / 3)


def test_decoupled_keeps_the_gradient_ppo_clip_loses_under_lag():
    # A sample one version old whose ratio already drifted past 1 + eps with A > 0: ppo-clip
    # (anchored at the sampling version) gives it no gradient; decoupled still pushes it.
    for kind, want in (("ppo-clip", 0.0), ("decoupled", -1.5)):
        _, _, grad = grad_of(kind, [math.log(1.5)], t(0.0), t(1.0))
        assert grad == pytest.approx([want]), kind


def test_none_is_plain_policy_gradient():
    loss, stats, grad = grad_of("none", [-1.0, -2.0], t(-3.0, -0.5), t(2.0, -1.0))
    assert loss == pytest.approx(-(2 * -1.0) - (-1 * -2.0))
    assert grad == pytest.approx([-2.0, 1.0])
    assert stats.logprob_mismatch == pytest.approx((2.0 + 1.5) / 2)
    assert stats.clip_frac == 0.0


def test_none_with_stale_samples_uses_the_truncated_weight():
    logp = t(math.log(3.0), math.log(3.0)).requires_grad_(True)
    stale = torch.tensor([True, False])
    loss, _ = policy_loss(logp, t(0.0, 0.0), t(1.0, 1.0), loss_of("none", ratio_cap=2.0), stale=stale)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-2.0, -1.0])


def test_m2po_masks_the_largest_second_moments_until_the_mean_is_within_tau():
    # log ratios 0.1, -0.1, 0.3, 0.5: squares 0.01, 0.01, 0.09, 0.25. With tau 0.04: all four
    # average 0.09 (> tau), the smallest three 0.0367 (<= tau): the 0.5 token alone is masked.
    log_r = [0.1, -0.1, 0.3, 0.5]
    adv = t(1.0, -1.0, 1.0, 1.0)
    loss, stats, grad = grad_of("m2po", log_r, t(0.0, 0.0, 0.0, 0.0), adv, tau=0.04)
    r = [math.exp(x) for x in log_r]
    # loss = -sum(M * r * A); d/dlogp = -M * r * A (dr/dlogp = r); no clip on the kept ones
    assert loss == pytest.approx(-(r[0] * 1 - r[1] + r[2]))
    assert grad == pytest.approx([-r[0], r[1], -r[2], 0.0])
    assert stats.clip_frac == pytest.approx(1 / 4)
    # a looser tau keeps everything; a tighter one masks down to the smallest
    _, loose, _ = grad_of("m2po", log_r, t(0.0, 0.0, 0.0, 0.0), adv, tau=0.1)
    _, tight, _ = grad_of("m2po", log_r, t(0.0, 0.0, 0.0, 0.0), adv, tau=0.011)
    assert loose.clip_frac == 0.0 and tight.clip_frac == pytest.approx(2 / 4)


def test_m2po_masks_a_ratio_over_its_cap_that_the_second_moment_would_keep():
    # one token with r = 10 among 999 with r = 1: its (log 10)^2 / 1000 = 0.0053 <= tau, so only
    # the cap stops its 10x weight
    log_r = [math.log(10.0)] + [0.0] * 999
    _, stats, grad = grad_of("m2po", log_r, torch.zeros(1000, dtype=torch.float64),
                             torch.ones(1000, dtype=torch.float64), ratio_cap=3.0)
    assert grad[0] == 0.0 and grad[1] == pytest.approx(-1.0)
    assert stats.clip_frac == pytest.approx(1 / 1000)
    _, uncapped, grad = grad_of("m2po", log_r, torch.zeros(1000, dtype=torch.float64),
                                torch.ones(1000, dtype=torch.float64), ratio_cap=100.0)
    assert grad[0] == pytest.approx(-10.0) and uncapped.clip_frac == 0.0


def test_m2po_mask_is_the_prefix_of_the_sorted_second_moments():
    torch.manual_seed(0)
    log_r = torch.randn(200, dtype=torch.float64) * 0.3
    valid = torch.ones(200, dtype=torch.bool)
    kept = m2po_mask(log_r, valid, 0.04)
    squares = log_r ** 2
    assert float(squares[kept].mean()) <= 0.04
    # the largest kept square is below the smallest masked one, and one more token would break the bound
    assert float(squares[kept].max()) <= float(squares[~kept].min())
    one_more = torch.cat([squares[kept], squares[~kept].min().reshape(1)])
    assert float(one_more.mean()) > 0.04
    # tokens that do not count (padding) are neither kept nor weigh in the mean
    valid[:50] = False
    kept = m2po_mask(log_r, valid, 0.04)
    assert not bool(kept[:50].any()) and float(squares[kept].mean()) <= 0.04


def test_cispo_weights_log_pi_by_the_detached_clipped_ratio_and_keeps_every_gradient():
    # ratios 0.5, 1.2, 7.0 with eps_low 0.2, eps_high 4: weights clip to 0.8, 1.2, 5.0
    log_r = [math.log(0.5), math.log(1.2), math.log(7.0)]
    adv = t(1.0, -1.0, 2.0)
    loss, stats, grad = grad_of("cispo", log_r, t(0.0, 0.0, 0.0), adv, eps_low=0.2, eps_high=4.0)
    weights = [0.8, 1.2, 5.0]
    assert loss == pytest.approx(-sum(w * a * lp for w, a, lp in zip(weights, [1.0, -1.0, 2.0], log_r)))
    assert grad == pytest.approx([-0.8, 1.2, -10.0])  # -w * A: no token's gradient is zero
    assert stats.clip_frac == pytest.approx(2 / 3)  # 0.5 under the floor, 7.0 over the cap


def test_cispo_defaults_have_no_floor_and_a_cap_of_five():
    _, stats, grad = grad_of("cispo", [math.log(0.01), math.log(6.0)], t(0.0, 0.0), t(1.0, 1.0))
    assert grad == pytest.approx([-0.01, -5.0])
    assert stats.clip_frac == pytest.approx(1 / 2)


def test_topr_trains_positives_as_sft_and_tapers_negatives_by_the_ratio():
    # A >= 0: -A*logp whatever the ratio; A < 0: -clip(r, 0, 1)*A*logp
    log_r = [math.log(3.0), math.log(3.0), math.log(0.5)]
    adv = t(2.0, -1.0, -1.0)
    loss, stats, grad = grad_of("topr", log_r, t(0.0, 0.0, 0.0), adv)
    assert loss == pytest.approx(-(2.0 * log_r[0] + 1.0 * -1.0 * log_r[1] + 0.5 * -1.0 * log_r[2]))
    assert grad == pytest.approx([-2.0, 1.0, 0.5])
    assert stats.clip_frac == pytest.approx(1 / 3)  # the negative with r = 3 was cut to 1


@pytest.mark.parametrize("kind", LOSS_TYPES)
def test_at_lag_0_with_no_mismatch_every_loss_has_reinforces_gradient(kind):
    torch.manual_seed(1)
    logp_values = (torch.rand(12, dtype=torch.float64) * -3).tolist()
    adv = torch.randn(12, dtype=torch.float64)
    behaviour = t(*logp_values)  # the learner computes exactly what vLLM sampled with: r = 1
    _, stats, grad = grad_of(kind, logp_values, behaviour, adv)
    assert grad == pytest.approx((-adv).tolist(), abs=1e-12)
    assert stats.clip_frac == 0.0


@pytest.mark.parametrize("kind", ["ppo-clip", "tis", "decoupled", "m2po", "cispo", "topr"])
def test_each_correcting_loss_clips_or_masks_something_on_a_batch_far_off_policy(kind):
    # half the tokens 8x likelier under the learner than under the sampler, with both signs of A
    log_r = [math.log(8.0)] * 4 + [0.0] * 4
    adv = t(1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0)
    _, stats, _ = grad_of(kind, log_r, torch.zeros(8, dtype=torch.float64), adv)
    assert 0.0 < stats.clip_frac <= 0.5


def test_kl_k3_against_reference():
    logp = t(-1.0, -2.0)
    ref = t(-1.5, -2.0)
    loss, stats = policy_loss(logp, logp.clone(), t(0.0, 0.0), loss_of("none", kl_coef=0.5), ref_logp=ref)
    k3 = math.exp(-0.5) - (-0.5) - 1
    assert float(loss) == pytest.approx(0.5 * k3)
    assert stats.kl == pytest.approx(k3 / 2)


@pytest.mark.parametrize("kind", LOSS_TYPES)
def test_the_kl_term_is_added_to_every_loss(kind):
    logp, ref = t(-1.0, -2.0), t(-1.5, -2.0)
    plain, _ = policy_loss(logp, logp.clone(), t(1.0, -1.0), loss_of(kind))
    with_kl, _ = policy_loss(logp, logp.clone(), t(1.0, -1.0), loss_of(kind, kl_coef=0.5), ref_logp=ref)
    assert float(with_kl - plain) == pytest.approx(0.5 * (math.exp(-0.5) + 0.5 - 1))


def test_mask_excludes_padding_tokens():
    loss, stats = policy_loss(t(-1.0, -5.0), t(-1.0, -1.0), t(1.0, 1.0), loss_of("none"), mask=t(1.0, 0.0))
    assert float(loss) == pytest.approx(1.0)
    assert stats.tokens == 1


# ---------------------------------------------------------------- the figures by lag


def test_each_token_and_sequence_lands_in_its_lag_bucket():
    # three sequences: [lag 0, 0] A=+1, [lag 2, 2, 2] A=-0.5, [lag 5] A=+2 (bucket 3+)
    log_r = t(0.0, 0.0, 0.2, -0.1, 0.3, math.log(9.0))
    lag = torch.tensor([0, 0, 2, 2, 2, 5])
    adv = t(1.0, 1.0, -0.5, -0.5, -0.5, 2.0)
    _, stats = policy_loss(log_r.clone(), torch.zeros(6, dtype=torch.float64), adv, loss_of("ppo-clip"),
                           lag=lag, lengths=[2, 3, 1])
    figures = stats.lag_figures()
    assert figures["lag0/tokens"] == 2 and figures["lag2/tokens"] == 3 and figures["lag3+/tokens"] == 1
    assert "lag1/tokens" not in figures
    assert figures["lag2/log_ratio_sq"] == pytest.approx((0.04 + 0.01 + 0.09) / 3)
    assert figures["lag0/adv_pos"] == 1.0 and figures["lag0/adv_neg"] is None
    assert figures["lag2/adv_neg"] == -0.5 and figures["lag3+/adv_pos"] == 2.0
    # the r = 9 token (A > 0) is clipped; in lag 2 none is: with A < 0, ratios above 1 + eps take
    # the unclipped branch (min(1.35 * -0.5, 1.2 * -0.5) = -0.675)
    assert figures["lag3+/clip_frac"] == 1.0 and figures["lag2/clip_frac"] == 0.0
    assert figures["lag0/ess_frac"] == 1.0  # one sequence in the bucket: trivially full
    assert stats.ess_frac == pytest.approx(ess_fraction([0.0, 0.4, math.log(9.0)]))


def test_a_sequence_spanning_versions_counts_in_the_bucket_of_its_oldest_token():
    _, stats = policy_loss(t(0.1, 0.1, 0.1), torch.zeros(3, dtype=torch.float64), t(1.0, 1.0, 1.0),
                           loss_of("none"), lag=torch.tensor([2, 1, 1]), lengths=[3])
    assert stats.by_lag[1].tokens == 2 and stats.by_lag[2].tokens == 1
    assert stats.by_lag[2].seq_log_weights == pytest.approx([0.3]) and stats.by_lag[1].seq_log_weights == []


def test_ess_fraction():
    assert ess_fraction([0.0, 0.0, 0.0, 0.0]) == pytest.approx(1.0)
    assert ess_fraction([0.0, -1000.0, -1000.0, -1000.0]) == pytest.approx(0.25)  # one dominates: 1/B
    assert ess_fraction([1000.0, 1000.0]) == pytest.approx(1.0)  # no overflow: scale-free
    assert ess_fraction([0.0, math.log(3.0)]) == pytest.approx((1 + 3) ** 2 / (2 * (1 + 9)))
    assert ess_fraction([]) is None


def test_micro_batch_stats_merge_into_the_steps():
    a = LagStats(tokens=2, dropped=1, log_ratio_sq_sum=0.5, seq_log_weights=[0.0], positive=1, positive_adv_sum=1.0)
    b = LagStats(tokens=2, dropped=0, log_ratio_sq_sum=0.1, seq_log_weights=[0.0], negative=1, negative_adv_sum=-2.0)
    a.merge(b)
    assert a.figures() == {"tokens": 4, "clip_frac": 0.25, "log_ratio_sq": pytest.approx(0.15), "ess_frac": 1.0,
                           "adv_pos": 1.0, "adv_neg": -2.0}


def test_run_averages_weight_fractions_by_tokens_and_the_rest_by_steps():
    rows = [{"lag0/tokens": 100, "lag0/clip_frac": 0.0, "lag0/log_ratio_sq": 0.0, "lag0/ess_frac": 1.0},
            {"lag0/tokens": 300, "lag0/clip_frac": 0.4, "lag0/log_ratio_sq": 0.2, "lag0/ess_frac": 0.5,
             "lag2/tokens": 10, "lag2/clip_frac": 0.5, "lag2/adv_neg": None},
            {"step": 3}]
    averages = run_averages(rows)
    assert averages["lag0/tokens"] == 400 and averages["lag2/tokens"] == 10
    assert averages["lag0/clip_frac"] == pytest.approx(0.3)  # (0 * 100 + 0.4 * 300) / 400
    assert averages["lag0/ess_frac"] == pytest.approx(0.75)  # (1.0 + 0.5) / 2 steps
    assert "lag2/adv_neg" not in averages and "lag1/tokens" not in averages
