"""The `vllm serve` a training run drives (`generator.type = "server"`): its command line.

`lora-async server` starts it (`serve.serve_for_training`), and so do the tests and benchmarks
(`bench.server.training_server`); `ServerGenerator` relies on what it turns on: runtime LoRA
loading, and sampling logprobs taken after temperature (what the learner's importance ratio
expects).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ...config import vllm_rank

SHUTDOWN_GRACE_S = 30.0  # how long a server gets to stop before it is killed


def training_server_command(model_dir: Path, host: str, port: int, max_lora_rank: int, max_loras: int,
                            max_model_len: int = 1024, kv_cache_gb: float = 1.0,
                            api_key: str | None = None) -> tuple[list[str], dict[str, str]]:
    """A server a training run drives (`generator.type = "server"`): runtime LoRA loading
    on, sampling logprobs after temperature (what the learner's importance ratio expects)."""
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", "base",
        "--host", host, "--port", str(port), "--max-model-len", str(max_model_len),
        "--enable-lora", "--max-lora-rank", str(vllm_rank(max_lora_rank)),
        "--max-loras", str(max_loras), "--max-cpu-loras", str(2 * max_loras),
        "--kv-cache-memory-bytes", str(int(kv_cache_gb * (1 << 30))),
        "--logprobs-mode", "processed_logprobs",
        "--disable-log-stats", "--uvicorn-log-level", "warning",
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    return cmd, env
