"""[loss]: the policy-gradient loss, a union on `type`, each loss with its own parameters.

The formulas and the papers are in `lora_async/loss.py`, one function per loss. Every loss
takes `kl_coef` (a KL penalty to the base model, the adapter switched off); the rest belong to
one loss each, so a setting the chosen loss does not read is an error, not a silent no-op.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field

from .sections import Section

# The default loss (`[loss]` left out, or given without `type`): see bench/RESULTS.md §20,
# where `lora-async bench staleness` measured every loss at lag 0, 2 and 4.
DEFAULT_LOSS = "m2po"


class LossBase(Section):
    """What every loss takes."""

    kl_coef: float = Field(0.0, ge=0.0, le=100.0, description="KL penalty to the base model (adapter off).")


class PPOClipLoss(LossBase):
    type: Literal["ppo-clip"] = Field("ppo-clip", description="PPO's clipped surrogate, anchored at the sampling version.")
    clip_eps: float = Field(0.2, gt=0.0, le=10.0, description="Clip range: the ratio is kept in (1-eps, 1+eps).")


class TISLoss(LossBase):
    type: Literal["tis"] = Field("tis", description="Truncated importance sampling (REINFORCE with a capped weight).")
    ratio_cap: float = Field(2.0, ge=1.0, le=1e4, description="The importance weight is truncated at this value.")


class DecoupledLoss(LossBase):
    type: Literal["decoupled"] = Field("decoupled", description="Decoupled PPO: clip at the learner, correct the lag.")
    clip_eps: float = Field(0.2, gt=0.0, le=10.0, description="Clip range around the proximal (learner) policy.")
    ratio_cap: float = Field(2.0, ge=1.0, le=1e4, description="Tokens whose lag weight exceeds this are left out.")


class NoCorrectionLoss(LossBase):
    type: Literal["none"] = Field("none", description="Plain policy gradient, no importance correction.")
    ratio_cap: float = Field(
        2.0, ge=1.0, le=1e4, description="Cap of the weight on tokens admitted stale (buffer.stale_policy = 'is-correct')."
    )


class M2POLoss(LossBase):
    type: Literal["m2po"] = Field("m2po", description="M2PO: second-moment masking of the ratio, no clip.")
    tau: float = Field(
        0.04, gt=0.0, le=100.0,
        description="Tokens with the largest (log ratio)^2 are masked until the kept tokens' mean is at most this.",
    )
    ratio_cap: float = Field(3.0, ge=1.0, le=1e4, description="Tokens whose ratio exceeds this are masked as well.")


class CISPOLoss(LossBase):
    type: Literal["cispo"] = Field("cispo", description="CISPO: a detached, clipped ratio weights A * log pi.")
    eps_low: float = Field(
        1.0, ge=0.0, le=1.0, description="The weight's floor is 1 - eps_low (1.0: no floor, as MiniMax-M1 and TRL)."
    )
    eps_high: float = Field(
        4.0, gt=0.0, le=1e4, description="The weight's ceiling is 1 + eps_high (4.0: a cap of 5, TRL's recommendation)."
    )


class TOPRLoss(LossBase):
    type: Literal["topr"] = Field("topr", description="TOPR: positives as SFT, negatives weighted by clip(ratio, 0, 1).")


LossConfig = Annotated[
    Union[PPOClipLoss, TISLoss, DecoupledLoss, NoCorrectionLoss, M2POLoss, CISPOLoss, TOPRLoss],
    Field(discriminator="type"),
]
LOSS_TYPES: tuple[str, ...] = ("ppo-clip", "tis", "decoupled", "none", "m2po", "cispo", "topr")


def default_loss() -> LossConfig:
    """The loss of a config that leaves out [loss]."""
    return loss_of(DEFAULT_LOSS)


def loss_of(kind: str, **settings: float) -> LossConfig:
    """The loss config of `kind` with `settings` (its defaults otherwise)."""
    from pydantic import TypeAdapter

    return TypeAdapter(LossConfig).validate_python({"type": kind, **settings})
