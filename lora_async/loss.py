"""The policy-gradient loss on token logprobs, with importance correction against vLLM.

All inputs are same-shaped tensors over completion tokens (flat [N] in the learner), with an
optional 0/1 `mask`. The loss is returned
as a *sum* over tokens so micro-batches can be accumulated and divided once by the step's
token count (an exact token-mean over the whole step).

    ratio_t = exp(logp_t - behaviour_logp_t)      # current adapter vs the version vLLM sampled
    ppo-clip:  -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)
    tis:       -min(ratio, cap).detach() * A * logp          (truncated importance sampling)
    decoupled: -w * min(r * A, clip(r, 1 - eps, 1 + eps) * A),  r = exp(logp - prox), w = exp(prox - behaviour)
               (decoupled PPO: the clip is anchored at the proximal policy, the learner's weights
               before this update, prox = logp.detach(); the sampling lag is corrected by w, and
               tokens with w > cap are left out rather than truncated)
    none:      -A * logp                                      (no correction; for comparison)
    kl:        + beta * (exp(ref - logp) - (ref - logp) - 1)  (k3 estimator, ref = adapter off)

Stale samples admitted under the `is-correct` policy get the truncated weight
min(ratio, cap).detach() when the loss itself does not correct (`none`); `ppo-clip` and `tis`
already weight by the ratio.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def has_gradient(advantage: float, kl_coef: float) -> bool:
    """Whether a sample moves the adapter: through its advantage, or, with a KL term, even with a
    zero advantage (a flat group). The learner trains and the collector keeps samples by this."""
    return advantage != 0.0 or kl_coef > 0.0


def policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
    kind: str,
    clip_eps: float = 0.2,
    ratio_cap: float = 2.0,
    kl_coef: float = 0.0,
    ref_logp: torch.Tensor | None = None,
    stale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Summed per-token loss and its statistics; `advantages` and `stale` match `logp`."""
    mask = torch.ones_like(logp) if mask is None else mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)
    log_ratio = logp - behaviour_logp
    ratio = torch.exp(log_ratio)
    if kind == "ppo-clip":
        clipped_ratio = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
        unclipped = ratio * adv
        clipped = clipped_ratio * adv
        per_token = -torch.minimum(unclipped, clipped)
        was_clipped = (clipped < unclipped).to(logp.dtype)
    elif kind == "tis":
        weight = ratio.clamp(max=ratio_cap).detach()
        per_token = -weight * adv * logp
        was_clipped = (ratio > ratio_cap).to(logp.dtype)
    elif kind == "decoupled":
        # One optimizer step per batch: the proximal policy is the learner's weights as they are
        # now, so r = 1 in value (its gradient is d logp) and the clip never binds; it would with
        # several updates per batch. What differs from ppo-clip under lag is the anchor: ppo-clip
        # clips against the *sampling* version, and zeroes the gradient of every token whose
        # ratio already drifted past 1 +- eps in the advantage's direction.
        prox = logp.detach()
        prox_ratio = torch.exp(logp - prox)
        surrogate = torch.minimum(prox_ratio * adv, prox_ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv)
        weight = torch.exp(prox - behaviour_logp)
        kept = weight <= ratio_cap
        per_token = -torch.where(kept, weight * surrogate, torch.zeros_like(surrogate))
        was_clipped = (~kept).to(logp.dtype)
    elif kind == "none":
        per_token = -adv * logp
        if stale is not None and bool(stale.any()):
            weight = ratio.clamp(max=ratio_cap).detach()
            per_token = torch.where(stale.bool(), weight * per_token, per_token)
        was_clipped = torch.zeros_like(logp)
    else:
        raise ValueError(f"unknown loss type {kind!r}")
    kl_sum = 0.0
    if kl_coef > 0.0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp")
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * kl
        kl_sum = float((kl.detach() * mask).sum())
    loss = (per_token * mask).sum()
    with torch.no_grad():
        on = mask.bool()
        r = ratio[on]
        stats = LossStats(
            tokens=int(on.sum()),
            ratio_sum=float(r.sum()),
            ratio_min=float(r.min()) if r.numel() else float("inf"),
            ratio_max=float(r.max()) if r.numel() else float("-inf"),
            clipped=int((was_clipped * mask).sum()),
            kl_sum=kl_sum,
            mismatch_sum=float(log_ratio[on].abs().sum()),
        )
    return loss, stats
