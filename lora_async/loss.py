"""The policy-gradient losses: one function per `loss.type`, and what each step reports by lag.

Notation, per trained token t: π = the learner now (`logp`, with gradient), μ = the version vLLM
sampled with (`behaviour`), r = π/μ = exp(log π − log μ), A = the sample's group-normalised
advantage, sg(·) = stop-gradient. Every loss returns a per-token value whose sum over the step,
divided by the step's trained tokens, is what the learner minimises (micro-batches accumulate
exactly), and a per-token flag: clipped, truncated or masked (the step's `clip_frac`).

    ppo-clip   −min(r·A, clip(r, 1−ε, 1+ε)·A)          PPO (Schulman et al. 2017), anchored at μ
    tis        −sg(min(r, cap))·A·log π                 truncated importance sampling
    decoupled  −w·min(u·A, clip(u, 1−ε, 1+ε)·A)          decoupled PPO (AReaL, arXiv 2505.24298)
    none       −A·log π                                 REINFORCE, no correction
    m2po       −M·r·A, M masks the largest (log r)²      M2PO (arXiv 2510.01161)
    cispo      −sg(clip(r, 1−ε_low, 1+ε_high))·A·log π   CISPO (MiniMax-M1, arXiv 2506.13585)
    topr       −A·log π (A ≥ 0); −sg(clip(r, 0, 1))·A·log π (A < 0)     TOPR (arXiv 2503.14286)
    + kl       β·(exp(ref − log π) − (ref − log π) − 1)   k3 estimator, ref = the base (adapter off)

At lag 0 with no train/inference mismatch (r = 1) every one of them has REINFORCE's gradient,
−A·∇log π per token; they differ in what they do with a token sampled by an older version.
A clip anchored at μ (ppo-clip) zeroes the gradient of the tokens that already moved past 1 ± ε in
the advantage's direction, and with lag those are many, and mostly the informative ones; the
others keep every token's gradient (cispo, topr, tis: a bounded weight), or mask only the few
whose ratio would dominate (m2po, decoupled).

Ratios are per token, as the sampling versions are (a continued sample holds tokens of several
versions). Tokens admitted stale (`buffer.stale_policy = "is-correct"`) are corrected by the loss
itself where it weights by the ratio; `none` gives them the truncated weight min(r, cap).

`LossStats.by_lag` splits what a step saw by each token's lag (`lag_figures.py`). Its ESS
fraction over all sequences, `LossStats.ess_frac`, is what `learner.lr_scale = "ess"` multiplies
the step's learning rate by the square root of (VCPO, arXiv 2602.17616).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .config import (CISPOLoss, DecoupledLoss, LossConfig, M2POLoss, NoCorrectionLoss, PPOClipLoss, TISLoss,
                     TOPRLoss)
from .lag_figures import LAG_BUCKETS, LagStats, ess_fraction, row_figures

@dataclass(frozen=True)
class Tokens:
    """One micro-batch's trained tokens, flat [N]; `mask` is 1 for a token that counts."""

    logp: torch.Tensor  # log π, with gradient
    behaviour: torch.Tensor  # log μ: vLLM's sampling logprob
    advantages: torch.Tensor
    mask: torch.Tensor
    stale: torch.Tensor | None = None  # bool: admitted outside the staleness window

    @property
    def log_ratio(self) -> torch.Tensor:
        return self.logp - self.behaviour


@dataclass(frozen=True)
class TokenLoss:
    per_token: torch.Tensor  # [N], with gradient
    dropped: torch.Tensor  # [N] bool: clipped, truncated or masked


# ---------------------------------------------------------------- the losses, one function each


def ppo_clip(tokens: Tokens, cfg: PPOClipLoss) -> TokenLoss:
    """PPO's clipped surrogate (Schulman et al. 2017, arXiv 1707.06347) with the ratio to the
    sampling version: −min(r·A, clip(r, 1−ε, 1+ε)·A). AReaL calls this the *coupled* objective:
    the trust region is anchored at μ, so under lag the tokens already outside it lose their
    gradient (`dropped`: the clipped branch was taken)."""
    ratio = torch.exp(tokens.log_ratio)
    adv = tokens.advantages
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps) * adv
    return TokenLoss(-torch.minimum(unclipped, clipped), clipped < unclipped)


def tis(tokens: Tokens, cfg: TISLoss) -> TokenLoss:
    """Truncated importance sampling: −sg(min(r, cap))·A·log π. The weight corrects the lag
    and is bounded; the gradient is never dropped (`dropped`: the weight was truncated)."""
    ratio = torch.exp(tokens.log_ratio)
    weight = ratio.clamp(max=cfg.ratio_cap).detach()
    return TokenLoss(-weight * tokens.advantages * tokens.logp, ratio > cfg.ratio_cap)


def decoupled(tokens: Tokens, cfg: DecoupledLoss) -> TokenLoss:
    """Decoupled PPO (AReaL, arXiv 2505.24298): −w·min(u·A, clip(u, 1−ε, 1+ε)·A) with
    u = π/π_prox, w = π_prox/μ. With one optimizer step per batch the proximal policy is the
    learner's weights as they are, π_prox = sg(π): u is 1 in value (its gradient ∇log π), so the
    clip never binds, and w = sg(r) corrects the lag. Tokens with w > cap are left out rather
    than truncated (`dropped`)."""
    prox = tokens.logp.detach()
    u = torch.exp(tokens.logp - prox)
    adv = tokens.advantages
    surrogate = torch.minimum(u * adv, u.clamp(1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps) * adv)
    weight = torch.exp(prox - tokens.behaviour)
    kept = weight <= cfg.ratio_cap
    return TokenLoss(-torch.where(kept, weight * surrogate, torch.zeros_like(surrogate)), ~kept)


def no_correction(tokens: Tokens, cfg: NoCorrectionLoss) -> TokenLoss:
    """REINFORCE on the advantages, −A·log π, blind to the lag (a baseline for comparison).
    Tokens admitted stale get the truncated weight sg(min(r, cap)), as `tis` gives every token."""
    per_token = -tokens.advantages * tokens.logp
    if tokens.stale is not None and bool(tokens.stale.any()):
        weight = torch.exp(tokens.log_ratio).clamp(max=cfg.ratio_cap).detach()
        per_token = torch.where(tokens.stale.bool(), weight * per_token, per_token)
    return TokenLoss(per_token, torch.zeros_like(per_token, dtype=torch.bool))


def m2po_mask(log_ratio: torch.Tensor, valid: torch.Tensor, tau: float) -> torch.Tensor:
    """M2PO's second-moment mask: among the `valid` tokens, drop those with the largest
    (log r)², largest first, until the mean (log r)² over the kept ones is ≤ τ. Returns the
    kept tokens (bool). Sorting once and comparing the running mean of the smallest k values
    with τ finds the largest k whose mean is ≤ τ; as the values grow along the sort, every
    smaller k qualifies too, so the kept set is the k smallest."""
    m2 = (log_ratio.detach() ** 2).masked_fill(~valid, 0.0)
    n = int(valid.sum())
    if n == 0:
        return valid.clone()
    values, order = torch.sort(m2[valid])
    running_mean = torch.cumsum(values, 0) / torch.arange(1, n + 1, dtype=values.dtype, device=values.device)
    keep_count = int((running_mean <= tau).sum())  # a prefix: the running mean of a sorted list grows
    kept_valid = torch.zeros(n, dtype=torch.bool, device=log_ratio.device)
    kept_valid[order[:keep_count]] = True
    kept = torch.zeros_like(valid)
    kept[valid] = kept_valid
    return kept


def m2po(tokens: Tokens, cfg: M2POLoss) -> TokenLoss:
    """M2PO (arXiv 2510.01161): −M·r·A with no ε-clip. M keeps a token unless it is among those
    with the largest second moment (log r)², masked until the mean over the kept tokens is ≤ τ
    (`m2po_mask`), or its ratio is above `ratio_cap`. The paper reports that this masks
    ~0.06% of tokens where PPO's clip drops 1.22%, and matches on-policy training with data
    256 updates stale. The second moment is taken over the micro-batch (usually the whole step
    here); the bound then holds for the step as well."""
    log_ratio = tokens.log_ratio
    ratio = torch.exp(log_ratio)
    valid = tokens.mask.bool() & (ratio.detach() <= cfg.ratio_cap)
    kept = m2po_mask(log_ratio, valid, cfg.tau)
    per_token = torch.where(kept, -ratio * tokens.advantages, torch.zeros_like(ratio))
    return TokenLoss(per_token, tokens.mask.bool() & ~kept)


def cispo(tokens: Tokens, cfg: CISPOLoss) -> TokenLoss:
    """CISPO (MiniMax-M1, arXiv 2506.13585; ScaleRL, arXiv 2510.13786):
    −sg(clip(r, 1−ε_low, 1+ε_high))·A·log π. The ratio is clipped as a weight, never as the
    objective, so no token's gradient is dropped (`dropped`: the weight was clipped). The
    defaults, no floor and a cap of 5, are those TRL documents (after ScaleRL)."""
    ratio = torch.exp(tokens.log_ratio)
    low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    weight = ratio.clamp(low, high).detach()
    return TokenLoss(-weight * tokens.advantages * tokens.logp, (ratio < low) | (ratio > high))


def topr(tokens: Tokens, cfg: TOPRLoss) -> TokenLoss:
    """TOPR, tapered off-policy REINFORCE (arXiv 2503.14286): samples with A ≥ 0 train as plain
    SFT weighted by A, −A·log π, with no ratio at all; samples with A < 0 get the weight
    sg(clip(r, 0, 1)), so pushing down a completion the learner already left behind fades out
    (`dropped`: a negative token whose weight was cut below its ratio). The paper classifies by
    the reward's sign; here by the group-normalised advantage's, with the ratio per token."""
    del cfg  # TOPR has no parameter of its own
    ratio = torch.exp(tokens.log_ratio)
    negative = tokens.advantages < 0
    weight = torch.where(negative, ratio.clamp(0.0, 1.0), torch.ones_like(ratio)).detach()
    return TokenLoss(-weight * tokens.advantages * tokens.logp, negative & (ratio > 1.0))


LossFunction = Callable[[Tokens, Any], TokenLoss]
LOSSES: dict[str, LossFunction] = {
    "ppo-clip": ppo_clip, "tis": tis, "decoupled": decoupled, "none": no_correction,
    "m2po": m2po, "cispo": cispo, "topr": topr,
}


# ---------------------------------------------------------------- what a step reports


@dataclass
class LossStats:
    tokens: int = 0
    ratio_sum: float = 0.0
    ratio_min: float = float("inf")
    ratio_max: float = float("-inf")
    clipped: int = 0
    kl_sum: float = 0.0
    mismatch_sum: float = 0.0  # |logp - behaviour_logp|
    onpolicy_tokens: int = 0  # tokens of samples with policy_lag 0 ...
    onpolicy_mismatch_sum: float = 0.0  # ... where any mismatch is numerics, not learning
    by_lag: dict[int, LagStats] = field(default_factory=dict)  # lag bucket (`LAG_BUCKETS`) -> its figures

    def merge(self, other: "LossStats") -> None:
        self.tokens += other.tokens
        self.ratio_sum += other.ratio_sum
        self.ratio_min = min(self.ratio_min, other.ratio_min)
        self.ratio_max = max(self.ratio_max, other.ratio_max)
        self.clipped += other.clipped
        self.kl_sum += other.kl_sum
        self.mismatch_sum += other.mismatch_sum
        self.onpolicy_tokens += other.onpolicy_tokens
        self.onpolicy_mismatch_sum += other.onpolicy_mismatch_sum
        for bucket, stats in other.by_lag.items():
            self.by_lag.setdefault(bucket, LagStats()).merge(stats)

    @property
    def ratio_mean(self) -> float:
        return self.ratio_sum / self.tokens if self.tokens else 1.0

    @property
    def clip_frac(self) -> float:
        return self.clipped / self.tokens if self.tokens else 0.0

    @property
    def kl(self) -> float:
        return self.kl_sum / self.tokens if self.tokens else 0.0

    @property
    def logprob_mismatch(self) -> float:
        return self.mismatch_sum / self.tokens if self.tokens else 0.0

    @property
    def onpolicy_mismatch(self) -> float | None:
        return self.onpolicy_mismatch_sum / self.onpolicy_tokens if self.onpolicy_tokens else None

    @property
    def ess_frac(self) -> float | None:
        """The ESS fraction of every sequence of the step, whatever its lag."""
        return ess_fraction([lw for stats in self.by_lag.values() for lw in stats.seq_log_weights])

    def lag_figures(self) -> dict[str, float | int | None]:
        """`lag0/tokens`, `lag0/clip_frac`, ... for each bucket that held tokens."""
        return row_figures(self.by_lag)


def has_gradient(advantage: float, kl_coef: float) -> bool:
    """Whether a sample moves the adapter: through its advantage, or, with a KL term, even with a
    zero advantage (a flat group). The learner trains and the collector keeps samples by this."""
    return advantage != 0.0 or kl_coef > 0.0


def lag_stats(log_ratio: torch.Tensor, dropped: torch.Tensor, lag: torch.Tensor, advantages: torch.Tensor,
              lengths: list[int]) -> dict[int, LagStats]:
    """Each token's figures in its lag bucket (`lag_figures.py`); each sequence (`lengths`:
    consecutive tokens per sequence) in the bucket of its oldest token, for its ratio and its
    advantage's sign."""
    out: dict[int, LagStats] = {}
    buckets = lag.clamp(max=LAG_BUCKETS[-1])
    squared = log_ratio.detach() ** 2
    for bucket in buckets.unique().tolist():
        here = buckets == bucket
        out[int(bucket)] = LagStats(tokens=int(here.sum()), dropped=int((dropped & here).sum()),
                                    log_ratio_sq_sum=float(squared[here].sum()))
    start = 0
    for length in lengths:
        if length:
            end = start + length
            out[int(buckets[start:end].max())].add_sequence(float(log_ratio[start:end].sum()), float(advantages[start]))
            start = end
    return out


def policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    cfg: LossConfig,
    mask: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    stale: torch.Tensor | None = None,
    lag: torch.Tensor | None = None,
    lengths: list[int] | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The summed per-token loss of `cfg.type` (plus the KL term) and its statistics.

    Inputs are flat and alike in shape; `mask` (1 = counts) defaults to every token, `lag` to 0,
    `lengths` (tokens per sequence, consecutive) to one sequence of all of them."""
    mask = torch.ones_like(logp) if mask is None else mask.to(logp.dtype)
    tokens = Tokens(logp, behaviour_logp, advantages.to(logp.dtype), mask, stale)
    result = LOSSES[cfg.type](tokens, cfg)
    per_token = result.per_token
    kl_sum = 0.0
    if cfg.kl_coef > 0.0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp")
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + cfg.kl_coef * kl
        kl_sum = float((kl.detach() * mask).sum())
    loss = (per_token * mask).sum()
    with torch.no_grad():
        on = mask.bool()
        log_ratio = tokens.log_ratio
        r = torch.exp(log_ratio[on])
        lag = torch.zeros_like(logp, dtype=torch.long) if lag is None else lag.long()
        lengths = [int(on.sum())] if lengths is None else lengths
        stats = LossStats(
            tokens=int(on.sum()),
            ratio_sum=float(r.sum()),
            ratio_min=float(r.min()) if r.numel() else float("inf"),
            ratio_max=float(r.max()) if r.numel() else float("-inf"),
            clipped=int((result.dropped & on).sum()),
            kl_sum=kl_sum,
            mismatch_sum=float(log_ratio[on].abs().sum()),
            by_lag=lag_stats(log_ratio[on].cpu(), result.dropped[on].cpu(), lag[on].cpu(),
                             tokens.advantages[on].cpu(), segment_lengths(on, lengths)),
        )
    return loss, stats


def segment_lengths(on: torch.Tensor, lengths: list[int]) -> list[int]:
    """`lengths` counted over the tokens that count (`on`) only."""
    if bool(on.all()):
        return lengths
    out, start = [], 0
    for length in lengths:
        out.append(int(on[start:start + length].sum()))
        start += length
    return out
