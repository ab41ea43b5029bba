"""Completion-token logprobs from the model: only the predicting positions go through the LM
head, and the log-softmax over the vocabulary runs in chunks (the 49k-vocab fp32 logits never
exist for a whole batch; in backward each chunk is recomputed instead of kept)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from .packing import MicroBatch


def _chunk_logprobs(hidden: torch.Tensor, targets: torch.Tensor, head_weight: torch.Tensor,
                    temperature: float) -> torch.Tensor:
    logits = (hidden @ head_weight.T).float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.log_softmax(-1).gather(1, targets[:, None]).squeeze(1)


def completion_logprobs(model: Any, mb: MicroBatch, temperature: float, chunk: int) -> torch.Tensor:
    """Logprob of every completion token ([N]); only those positions go through the LM head."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = causal_lm.model(  # no KV cache: nothing is generated, and checkpointed layers refuse one
        input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids, use_cache=False,
    ).last_hidden_state
    picked = hidden[mb.rows, mb.cols]
    weight = causal_lm.get_output_embeddings().weight
    parts = []
    for h, t in zip(picked.split(chunk), mb.targets.split(chunk)):
        if torch.is_grad_enabled():
            # Recompute the chunk's logits in backward instead of keeping [chunk, vocab] fp32.
            parts.append(checkpoint(_chunk_logprobs, h, t, weight, temperature, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(h, t, weight, temperature))
    return torch.cat(parts) if parts else picked.new_zeros(0)
