"""The dtype `auto` means: bfloat16 where the device computes it natively, else float32."""

import pytest

from lora_async import dtypes


@pytest.mark.parametrize("native, expected", [(True, "bfloat16"), (False, "float32")])
def test_auto_follows_native_bf16(monkeypatch, native, expected):
    monkeypatch.setattr(dtypes, "native_bf16", lambda device: native)
    assert dtypes.resolve_dtype("auto", "cpu") == expected
    assert dtypes.resolve_dtype("float16", "cpu") == "float16"  # an explicit choice is kept


def test_native_bf16_on_this_cpu_matches_its_flags():
    flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    assert dtypes.native_bf16("cpu") == ("avx512_bf16" in flags or "amx_bf16" in flags)
    with pytest.raises(ValueError, match="unsupported dtype"):
        dtypes.torch_dtype("int8")
