"""Grouped CPU LoRA ops: a faster stand-in for vLLM 0.32's CPU punica ops.

Why: vLLM's CPU punica path (`vllm/lora/ops/torch_ops`) gathers a full copy of the LoRA weight
for *every token* (`weights[indices]`, then a batched einsum). A batch rarely holds more than a
few adapters, so these group tokens by adapter slot and run one matmul per slot. Same
arithmetic, same dtypes, same semantics for every index (negative ones included); measured 1.5x
faster generation with an r=8 adapter on the 135M model, 64 prompts x 64 tokens on 2 cores
(`lora-async bench gen`, bench/RESULTS.md). `tests/test_vllm_ext.py` checks them against vLLM's
own functions on random inputs. Which ops they replace, and vLLM's signatures of them, are
listed and checked in `compat.py` (`PUNICA_OPS`).
"""

from __future__ import annotations

from typing import Any

from . import compat


# At most this many tokens, a batch of several adapters gathers each token's weights and runs one
# batched matmul (vLLM's way) instead of one matmul per adapter: a decode step of a league's games
# holds a token or two of each of 9 versions, and 9 small matmuls with their index bookkeeping cost
# more than the gather (bench/RESULTS.md section 24). Above it (prefill), the gather's copy of the
# weights per token would cost more than the loop.
GATHER_MAX_TOKENS = 64


def _grouped_matmul(inputs: Any, weights: Any, indices: Any, dtype: Any) -> Any:
    """out[t] = inputs[t] @ weights[indices[t]].T, one matmul per distinct index (a few tokens of
    several adapters: one batched matmul over each token's gathered weights)."""
    import torch

    stacked = weights.squeeze(1) if weights.dim() == 4 else weights
    x = inputs.to(dtype)
    distinct = torch.unique(indices)
    if distinct.numel() == 1:
        return x @ stacked[int(distinct)].to(dtype).T
    if x.shape[0] <= GATHER_MAX_TOKENS:
        return torch.bmm(x.unsqueeze(1), stacked[indices].to(dtype).transpose(1, 2)).squeeze(1)
    out = x.new_empty(x.shape[0], stacked.shape[1])
    for slot in distinct.tolist():
        rows = (indices == slot).nonzero().squeeze(1)
        out[rows] = x[rows] @ stacked[slot].to(dtype).T
    return out


def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):  # noqa: ANN001
    outputs = _grouped_matmul(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):  # noqa: ANN001
    outputs = _grouped_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(  # noqa: ANN201
    inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size, add_inputs=True  # noqa: ANN001
):
    outputs = _grouped_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs


def _explode(lora_indices_tensor: Any, seq_len_tensor: Any) -> Any:
    import torch

    return torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)


def sgmv_shrink(inputs, w, out, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,  # noqa: ANN001,ANN201
                batches, max_seq_length, token_nums, scaling):
    bgmv_shrink(inputs, w, out, _explode(lora_indices_tensor, seq_len_tensor), scaling)


def sgmv_expand(inputs, w, out, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,  # noqa: ANN001,ANN201
                batches, max_seq_length, token_nums, add_inputs=False):
    bgmv_expand(inputs, w, out, _explode(lora_indices_tensor, seq_len_tensor), add_inputs)


def sgmv_expand_slice(inputs, w, out, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,  # noqa: ANN001,ANN201
                      batches, max_seq_length, token_nums, slice_offset, slice_size, add_inputs=False):
    bgmv_expand_slice(
        inputs, w, out, _explode(lora_indices_tensor, seq_len_tensor), slice_offset, slice_size, add_inputs
    )


def ours() -> dict[str, Any]:
    """Our replacement of each op in `compat.PUNICA_OPS`, by name."""
    return {name: globals()[name] for name in compat.PUNICA_OPS}


def install_fast_cpu_lora_ops() -> bool:
    """Point vLLM's CPU punica wrapper at the grouped ops (in this process). Idempotent."""
    import vllm.lora.punica_wrapper.punica_cpu as punica_cpu

    problems = compat.punica_problems()
    if problems:
        raise compat.VllmCompatError("; ".join(problems))
    for name, op in ours().items():
        setattr(punica_cpu, name, op)
    return True
