"""The learner's speed on a placement, in seconds per token it computes on: a forward and a
backward pass of the live adapter over random tokens, the gradients then dropped (no update, no
version, the run's random streams untouched). An auto run times it on every core and on the
learner's share of them at start-up (`orchestrator/auto.py`), so its model knows what the
split costs the learner on this machine instead of assuming it, and the learner's first pass
at the new thread count is behind it before any step."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ..placement import Placement, pin_current_thread

if TYPE_CHECKING:
    from .learner import Learner

PROBE_ROWS, PROBE_LENGTH = 8, 64  # 512 tokens: about a second on one CPU core for a 135M model


def seconds_per_token(learner: "Learner", placement: Placement, seed: int = 0) -> float:
    """On the calling (learner's) thread, pinned to `placement` (and left there): one pass to
    warm the thread count up, then the one timed."""
    pin_current_thread(placement)
    model = learner.model
    vocab = min(int(model.config.vocab_size), 1000)
    ids = torch.randint(0, vocab, (PROBE_ROWS, PROBE_LENGTH), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(learner.device)

    def one_pass() -> float:
        started = time.perf_counter()
        logits = model(input_ids=ids).logits
        torch.logsumexp(logits.float(), dim=-1).mean().backward()
        return time.perf_counter() - started

    with torch.random.fork_rng(devices=[]):  # dropout, if any, draws from a copy
        try:
            one_pass()
            took = one_pass()
        finally:
            for param in model.parameters():
                param.grad = None
    return took / ids.numel()
