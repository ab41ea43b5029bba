"""Tests that need a CUDA GPU, and no vLLM (the GPU machine lent to sessions has torch,
transformers and peft, but no vLLM): marked `gpu`, skipped without CUDA, run by
`bench/gpu_check.sh` (`pytest -m gpu`) where a GPU is present."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from .conftest import REPO

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("kind", ["cuda-ipc", "nccl"])
def test_gpu_transport_half_is_bit_exact(kind):
    """Sender and receiver processes on one GPU host (torch only): every tensor arrives intact."""
    if kind == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("nccl needs 2 GPUs: NCCL refuses two ranks on one device")
    done = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_transport_check.py"), "--only", kind],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["transport"] == kind and row["all_bit_exact"]
