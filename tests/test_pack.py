"""Packing adapters into one buffer: round trip, owned copies, corruption."""

import pytest
import torch

from lora_async.generator.types import AdapterVersion
from lora_async.sync.pack import PackError, PackedAdapter, pack, unpack_owned, unpack_views


def adapter():
    torch.manual_seed(0)
    tensors = {"base_model.model.l.q_proj.lora_A.weight": torch.randn(8, 64),
               "base_model.model.l.q_proj.lora_B.weight": torch.randn(96, 8)}
    return AdapterVersion("a", 3, tensors, {"r": 8, "lora_alpha": 16})


def test_round_trip_with_cast_and_alignment():
    version = adapter()
    packed = pack(version, dtype=torch.bfloat16, with_checksum=True)
    assert packed.buffer.dtype == torch.uint8
    assert all(m.offset % 64 == 0 for m in packed.tensors)
    views = unpack_views(packed)
    for name, tensor in version.tensors.items():
        assert views[name].dtype == torch.bfloat16
        assert torch.equal(views[name], tensor.to(torch.bfloat16))
    assert packed.peft_config == version.peft_config


def test_unpack_owned_is_a_copy():
    packed = pack(adapter())
    owned = unpack_owned(packed)
    first = next(iter(owned.values()))
    first.mul_(0)  # vLLM scales lora_B in place: must not reach the sender's buffer
    assert not torch.equal(next(iter(unpack_views(packed).values())), first)


def test_checksum_mismatch_is_rejected():
    packed = pack(adapter(), with_checksum=True)
    packed.buffer[5] ^= 0xFF
    with pytest.raises(PackError, match="checksum"):
        unpack_views(packed)


def test_truncated_buffer_is_rejected():
    packed = pack(adapter())
    meta = packed.meta()
    with pytest.raises(PackError, match="truncated"):
        PackedAdapter.from_meta(meta, packed.buffer[:-100])
    short = PackedAdapter(packed.adapter, packed.version, packed.buffer[:-100], packed.tensors)
    with pytest.raises(PackError, match="truncated"):
        unpack_views(short)


def test_meta_round_trip():
    packed = pack(adapter(), with_checksum=True)
    again = PackedAdapter.from_meta(packed.meta(), packed.buffer.clone())
    assert again.checksum == packed.checksum
    assert unpack_views(again).keys() == unpack_views(packed).keys()


def test_gather_makes_one_buffer_lora_a_first_with_views_that_own_nothing_of_the_source():
    """`AdapterVersion.gather`: every lora_A tensor, then every lora_B one, laid end to end in
    one CPU buffer; the views hold the source's values and stay put when the source changes."""
    state = {
        "base_model.model.l0.q.lora_A.weight": torch.randn(2, 3),
        "base_model.model.l0.q.lora_B.weight": torch.randn(4, 2),
        "base_model.model.l1.q.lora_A.weight": torch.randn(2, 3),
        "base_model.model.l1.q.lora_B.weight": torch.randn(4, 2),
    }
    expected = {k: v.clone() for k, v in state.items()}
    version = AdapterVersion.gather("a", 3, state, {"r": 2})
    assert list(version.tensors) == [k for k in state if "lora_A" in k] + [k for k in state if "lora_B" in k]
    assert version.flat is not None and version.flat.numel() == sum(v.numel() for v in state.values())
    assert version.nbytes == version.flat.numel() * 4
    offset = 0
    for name, view in version.tensors.items():
        assert view.data_ptr() == version.flat.data_ptr() + offset * 4
        offset += view.numel()
        assert torch.equal(view, expected[name])
    for tensor in state.values():
        tensor.zero_()
    assert all(torch.equal(version.tensors[k], expected[k]) for k in state)


def test_gather_copies_mixed_dtypes_one_by_one():
    state = {"x.lora_A.weight": torch.randn(2, 3), "x.lora_B.weight": torch.randn(3, 2).half()}
    version = AdapterVersion.gather("a", 0, state, {})
    assert version.flat is None
    assert {k: v.dtype for k, v in version.tensors.items()} == {k: v.dtype for k, v in state.items()}
    assert all(torch.equal(version.tensors[k], state[k]) and version.tensors[k].data_ptr() != state[k].data_ptr()
               for k in state)


def test_the_sync_benchmarks_plain_copy_row_copies_every_byte(tiny_model):
    """`bench sync`'s torch-copy row (the floor the hot-swap is compared with) copies a whole
    version as the learner hands it over, in the engine's dtype."""
    from lora_async.bench.sync import run_sync_bench

    [row] = run_sync_bench(str(tiny_model), [8], 3, ("torch-copy",), cpus=None)
    assert row["transport"] == "torch-copy" and row["measured"] and row["versions"] == 3
    assert row["bytes"] > 0 and row["p50_ms"] > 0
