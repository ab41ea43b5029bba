"""Grouped CPU LoRA ops: a faster stand-in for vLLM 0.32's CPU punica ops.

Why: vLLM's CPU punica path (`vllm/lora/ops/torch_ops`) gathers a full copy of the LoRA weight
for *every token* (`weights[indices]`, then a batched einsum). These compute the same products
without that copy:
- a batch of one adapter (the usual case): one matmul with its slot's weights;
- a batch of several adapters (a league's games: a few tokens of each of 9 versions): one GEMM
  over every slot's weights at once, laid out for it once per weight version and kept; each
  token takes its own slot's columns (shrink), or multiplies only its own slot's rows (expand:
  the other slots' inputs are zero);
- several adapters and many tokens (a long prefill): one matmul per adapter.
Which slot each token uses is worked out once per batch, not once per op call (a step calls the
ops twice per LoRA module of every layer). Same arithmetic and dtypes as vLLM's, same semantics
for every index (negative ones included). Measured 1.5x faster generation with one r=8 adapter
on the 135M model, 64 prompts x 64 tokens on 2 cores (`lora-async bench gen`), and a league of 8
past versions from 0.68 to 0.89 of single-seat episodes/s (bench/RESULTS.md section 24).
`tests/test_vllm_ext.py` checks them against vLLM's own functions on random inputs. Which ops
they replace, and vLLM's signatures of them, are listed and checked in `compat.py` (`PUNICA_OPS`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from . import compat

# Up to this many tokens x slots, a batch of several adapters runs one GEMM over every slot. It
# does `slots` times the multiply-adds one matmul per adapter does, but one matmul per adapter
# costs its index bookkeeping: measured on 2 cores with 12 slots of r=8 (the 135M model's
# widths), the GEMM is faster up to 1,280 tokens for expand and breaks even there for shrink.
ALL_SLOTS_MAX_WORK = 12 * 1024


@dataclass
class _Plan:
    """Which slot each token of a batch uses, worked out once per engine step: a step calls the
    ops twice per LoRA module of every layer, all with the same indices."""

    indices: Any  # as vLLM passed them (one per sequence for the sgmv ops), a copy
    seq_lens: Any  # the sgmv ops' sequence lengths (a copy), or None
    tokens: Any  # one slot index per token
    slots: list[int]  # the distinct ones
    _columns: dict[tuple[int, int], Any] = field(default_factory=dict)

    def matches(self, indices: Any, seq_lens: Any) -> bool:
        import torch

        return _same(self.indices, indices) and (seq_lens is None if self.seq_lens is None
                                                 else seq_lens is not None and _same(self.seq_lens, seq_lens))

    def columns(self, slots: int, rank: int) -> Any:
        """Each token's `rank` columns among `slots` slots laid side by side (negative indices
        count from the end, as vLLM's `weights[indices]` does)."""
        import torch

        if (slots, rank) not in self._columns:
            self._columns[slots, rank] = (torch.remainder(self.tokens, slots) * rank).unsqueeze(1) + torch.arange(rank)
        return self._columns[slots, rank]


def _same(a: Any, b: Any) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a, b))


class GroupedLoraOps:
    """vLLM's CPU punica ops (`compat.PUNICA_OPS`, same names and arguments) as methods. Each
    stacked LoRA weight is laid out for the all-slot GEMM when first needed, and again only when
    a slot of it is written: vLLM's activation and our hot swap write in place, which moves the
    tensor's version counter."""

    def __init__(self) -> None:
        # id(stacked weight) -> (a weak reference to it, its version, dtype, the laid-out weights
        # or None where a slot holds NaN/Inf: zeros times Inf is NaN, so such a weight is never
        # multiplied across slots)
        self._laid_out: dict[int, tuple[weakref.ref, int, Any, Any]] = {}
        self._plan: _Plan | None = None  # the last batch's

    # ---------------------------------------------------------------- the products
    def _plan_for(self, indices: Any, seq_lens: Any = None) -> _Plan:
        import torch

        if self._plan is not None and self._plan.matches(indices, seq_lens):
            return self._plan
        copy = indices.clone()
        tokens = copy if seq_lens is None else torch.repeat_interleave(indices, seq_lens)
        self._plan = _Plan(copy, None if seq_lens is None else seq_lens.clone(), tokens, torch.unique(tokens).tolist())
        return self._plan

    def _grouped_matmul(self, inputs: Any, weights: Any, plan: _Plan, dtype: Any, shrink: bool) -> Any:
        """out[t] = inputs[t] @ weights[plan.tokens[t]].T"""
        import torch

        stacked = weights.squeeze(1) if weights.dim() == 4 else weights
        x = inputs.to(dtype)
        if len(plan.slots) == 1:
            return x @ stacked[plan.slots[0]].to(dtype).T
        if x.shape[0] * stacked.shape[0] <= ALL_SLOTS_MAX_WORK:
            laid = self._all_slots(weights, stacked, dtype, shrink)
            if laid is not None:
                slots, rank = stacked.shape[0], stacked.shape[1] if shrink else stacked.shape[2]
                columns = plan.columns(slots, rank)
                if shrink:  # every slot's product, then each token's own slot's columns
                    return (x @ laid.T).gather(1, columns)
                spread = x.new_zeros(x.shape[0], slots * rank)  # each token's input in its slot's columns
                return spread.scatter_(1, columns, x) @ laid
            return torch.bmm(x.unsqueeze(1), stacked[plan.tokens].to(dtype).transpose(1, 2)).squeeze(1)
        out = x.new_empty(x.shape[0], stacked.shape[1])
        for slot in plan.slots:
            rows = (plan.tokens == slot).nonzero().squeeze(1)
            out[rows] = x[rows] @ stacked[slot].to(dtype).T
        return out

    def _all_slots(self, weights: Any, stacked: Any, dtype: Any, shrink: bool) -> Any:
        """Every slot of `stacked` as one matrix: (slots x rank, in) for shrink, (slots x rank,
        out) for expand; kept until the weights are written. None if a slot is not finite."""
        import torch

        key, version = id(weights), weights._version
        kept = self._laid_out.get(key)
        if kept is not None and kept[0]() is weights and kept[1] == version and kept[2] == dtype:
            return kept[3]
        slots, rows, cols = stacked.shape
        laid = stacked.to(dtype).reshape(slots * rows, cols) if shrink else \
            stacked.to(dtype).transpose(1, 2).reshape(slots * cols, rows).contiguous()
        if not bool(torch.isfinite(laid).all()):
            laid = None
        # a freed weight's entry goes with it (before its id can be another tensor's)
        self._laid_out[key] = (weakref.ref(weights, lambda _: self._laid_out.pop(key, None)), version, dtype, laid)
        return laid

    # ---------------------------------------------------------------- vLLM's ops
    def bgmv_shrink(self, inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):  # noqa: ANN001
        self._shrink(inputs, lora_a_weights, output_tensor, self._plan_for(lora_indices_tensor), scaling)

    def bgmv_expand(self, inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):  # noqa: ANN001
        self._expand(inputs, lora_b_weights, output_tensor, self._plan_for(lora_indices_tensor), add_inputs)

    def bgmv_expand_slice(  # noqa: ANN201
        self, inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size,  # noqa: ANN001
        add_inputs=True,  # noqa: ANN001
    ):
        self._expand_slice(inputs, lora_b_weights, output_tensor, self._plan_for(lora_indices_tensor),
                           slice_offset, slice_size, add_inputs)

    def sgmv_shrink(self, inputs, w, out, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,  # noqa: ANN001,ANN201
                    batches, max_seq_length, token_nums, scaling):
        self._shrink(inputs, w, out, self._plan_for(lora_indices_tensor, seq_len_tensor), scaling)

    def sgmv_expand(self, inputs, w, out, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,  # noqa: ANN001,ANN201
                    batches, max_seq_length, token_nums, add_inputs=False):
        self._expand(inputs, w, out, self._plan_for(lora_indices_tensor, seq_len_tensor), add_inputs)

    def sgmv_expand_slice(self, inputs, w, out, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,  # noqa: ANN001,ANN201
                          batches, max_seq_length, token_nums, slice_offset, slice_size, add_inputs=False):
        self._expand_slice(inputs, w, out, self._plan_for(lora_indices_tensor, seq_len_tensor), slice_offset,
                           slice_size, add_inputs)

    # ---------------------------------------------------------------- where the products go
    def _shrink(self, inputs: Any, weights: Any, output_tensor: Any, plan: _Plan, scaling: float) -> None:
        outputs = self._grouped_matmul(inputs, weights, plan, output_tensor.dtype, True)
        output_tensor[:, : outputs.shape[1]] = scaling * outputs

    def _expand(self, inputs: Any, weights: Any, output_tensor: Any, plan: _Plan, add_inputs: bool) -> None:
        outputs = self._grouped_matmul(inputs, weights, plan, output_tensor.dtype, False)
        limit = output_tensor.shape[0]
        if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
            limit = 1
        common = min(outputs.shape[1], output_tensor.shape[1])
        if add_inputs:
            output_tensor[:, :common] += outputs[:limit, :common]
        else:
            output_tensor[:, :common] = outputs[:limit, :common]

    def _expand_slice(self, inputs: Any, weights: Any, output_tensor: Any, plan: _Plan, slice_offset: int,
                      slice_size: int, add_inputs: bool) -> None:
        outputs = self._grouped_matmul(inputs, weights, plan, output_tensor.dtype, False)
        if add_inputs:
            output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
        else:
            output_tensor[:, slice_offset : slice_offset + slice_size] = outputs


def ours() -> dict[str, Any]:
    """Our replacement of each op in `compat.PUNICA_OPS`, by name: one `GroupedLoraOps`'s methods."""
    ops = GroupedLoraOps()
    return {name: getattr(ops, name) for name in compat.PUNICA_OPS}


def install_fast_cpu_lora_ops() -> bool:
    """Point vLLM's CPU punica wrapper at the grouped ops (in this process). Idempotent."""
    import vllm.lora.punica_wrapper.punica_cpu as punica_cpu

    problems = compat.punica_problems()
    if problems:
        raise compat.VllmCompatError("; ".join(problems))
    for name, op in ours().items():
        setattr(punica_cpu, name, op)
    return True
