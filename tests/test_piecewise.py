"""The hot-swap's one copy, done piece by piece (`generator/vllm/piecewise.py`): the same bits
as a whole-buffer `copy_` and a `mul_` per range, and a value check that sees every piece."""

import math

import pytest
import torch

from lora_async.generator.vllm.piecewise import PIECE, copy_scaled


def _whole(source: torch.Tensor, dtype: torch.dtype, scale: list[tuple[int, int, float]]) -> torch.Tensor:
    target = source.to(dtype)
    for start, end, factor in scale:
        target[start:end].mul_(factor)
    return target


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_pieces_give_the_bits_of_one_copy_and_one_scaling_per_range(dtype):
    torch.manual_seed(0)
    total = 3 * PIECE + 1234  # ranges straddle pieces, and the last piece is short
    source = torch.randn(total) * 0.05
    scale = [(100, PIECE + 7, 16 / math.sqrt(8)), (2 * PIECE - 5, total, 2.0)]  # rsLoRA's factor, not a power of two
    target = torch.full((total,), float("nan"), dtype=dtype)
    assert copy_scaled(target, source, scale, check=True)
    assert torch.equal(target.view(torch.uint8), _whole(source, dtype, scale).view(torch.uint8))


@pytest.mark.parametrize("where", [0, PIECE - 1, PIECE, 3 * PIECE + 10])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_bad_value_in_any_piece_is_seen(where, bad):
    source = torch.zeros(3 * PIECE + 11)
    source[where] = bad
    target = torch.empty_like(source, dtype=torch.bfloat16)
    assert not copy_scaled(target, source, [(0, 5, 2.0)], check=True)
    assert copy_scaled(target, source, [], check=False)  # unchecked: no verdict


def test_float16_checks_in_float32_so_large_legitimate_values_pass():
    source = torch.full((2 * PIECE,), 60000.0)  # each fits float16; their sum would not
    target = torch.empty(2 * PIECE, dtype=torch.float16)
    assert copy_scaled(target, source, [], check=True)
