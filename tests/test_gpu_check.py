"""`bench/gpu_check.py`, the GPU check script, kept runnable: its CPU smoke mode runs the same
code paths (learner steps at full precision and nf4, the data-parallel learner, the plan) on a
2-layer model of SmolLM2-135M's width."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import REPO

pytestmark = pytest.mark.slow


def test_gpu_check_smoke_runs_on_cpu(tmp_path, tokenizer_dir):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--device", "cpu", "--quick",
                           "--out", str(out), "--tokenizer", str(tokenizer_dir), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = {row["quantization"]: row for row in report["learner"]}
    assert set(rows) == {"none", "nf4"} and all(row["step_s_median"] > 0 for row in rows.values())
    assert all("error" not in row["plan"] and row["plan"]["learner_gb"] > 0 for row in rows.values())
    assert rows["nf4"]["plan"]["learner_gb"] < rows["none"]["plan"]["learner_gb"]
    assert report["data_parallel"]["max_weight_diff_vs_one_rank"] < 1e-4
