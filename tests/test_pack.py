"""Packing adapters into one buffer: round trip, owned copies, corruption, the metadata as
plain data."""

import dataclasses

import pytest
import torch

from lora_async.adapter_version import AdapterVersion
from lora_async.handoff import PackedAdapter, PackError, PackMeta
from lora_async.handoff.packed import unpack_owned, unpack_views
from lora_async.sync.pack import pack


def adapter():
    torch.manual_seed(0)
    tensors = {"base_model.model.l.q_proj.lora_A.weight": torch.randn(8, 64),
               "base_model.model.l.q_proj.lora_B.weight": torch.randn(96, 8)}
    return AdapterVersion("a", 3, tensors, {"r": 8, "lora_alpha": 16})


def test_round_trip_with_cast_and_alignment():
    version = adapter()
    packed = pack(version, dtype=torch.bfloat16, with_checksum=True)
    assert packed.buffer.dtype == torch.uint8
    assert all(m.offset % 64 == 0 for m in packed.meta.tensors)
    views = unpack_views(packed)
    for name, tensor in version.tensors.items():
        assert views[name].dtype == torch.bfloat16
        assert torch.equal(views[name], tensor.to(torch.bfloat16))
    assert packed.meta.peft_config == version.peft_config
    assert packed.meta.served_name == "a@v3" and packed.meta.nbytes == packed.nbytes


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
    with pytest.raises(PackError, match="truncated"):
        PackedAdapter.received(packed.meta, packed.buffer[:-100])
    short = PackedAdapter(packed.meta, packed.buffer[:-100])
    with pytest.raises(PackError, match="truncated"):
        unpack_views(short)


def test_meta_round_trips_through_plain_data():
    """What crosses vLLM's `collective_rpc` (which decodes without custom types) comes back equal,
    and a receiver unpacks the same tensors from it."""
    import json

    packed = pack(adapter(), torch.bfloat16, with_checksum=True)
    plain = json.loads(json.dumps(packed.meta.to_dict()))  # nothing but JSON types inside
    again = PackMeta.from_dict(plain)
    assert again == packed.meta and again.checksum is not None
    received = unpack_views(PackedAdapter.received(again, packed.buffer.clone()))
    assert {k: torch.equal(v, received[k]) for k, v in unpack_views(packed).items()} == dict.fromkeys(received, True)


@pytest.mark.parametrize("break_it", [
    lambda d: d.pop("tensors"),
    lambda d: d.pop("nbytes"),
    lambda d: d.update(version="3"),
    lambda d: d.update(adapter=7),
    lambda d: d.update(nbytes=-1),
    lambda d: d.update(checksum=123),
    lambda d: d.update(peft_config=["r", 8]),
    lambda d: d["tensors"][0].pop(),
    lambda d: d["tensors"][0].__setitem__(2, ["8", 64]),
    lambda d: d["tensors"][1].__setitem__(3, None),
], ids=["no-tensors", "no-nbytes", "version-text", "adapter-number", "negative-size", "checksum-number",
        "config-list", "short-entry", "shape-text", "offset-none"])
def test_malformed_meta_is_refused_with_pack_error(break_it):
    plain = pack(adapter(), with_checksum=True).meta.to_dict()
    break_it(plain)
    with pytest.raises(PackError, match="malformed adapter metadata"):
        PackMeta.from_dict(plain)


def test_a_meta_that_lies_about_its_tensors_is_refused_on_unpack():
    packed = pack(adapter())
    first = packed.meta.tensors[0]
    bigger = dataclasses.replace(first, shape=(first.shape[0] * 2, first.shape[1]))
    lying = dataclasses.replace(packed.meta, tensors=(bigger, *packed.meta.tensors[1:]))
    with pytest.raises(PackError, match="does not match"):
        unpack_views(PackedAdapter.received(lying, packed.buffer))


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
