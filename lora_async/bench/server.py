"""A training server (`generator.server.command`) on a loopback port, for tests and benchmarks."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import IO, Iterator

from ..generator.server.command import SHUTDOWN_GRACE_S, training_server_command
from .proc import free_port, stop_group


@contextlib.contextmanager
def training_server(model_dir: Path, max_lora_rank: int, max_loras: int = 4, max_model_len: int = 1024,
                    kv_cache_gb: float = 1.0, cpus: str | None = None, log: Path | None = None,
                    startup_timeout_s: float = 600.0) -> Iterator[str]:
    """A `training_server_command` server on a free loopback port; yields its base URL once it
    answers, and stops it (SIGTERM, then SIGKILL) on exit. For tests and benchmarks."""
    import time

    import requests

    port = free_port()
    cmd, env = training_server_command(model_dir, "127.0.0.1", port, max_lora_rank, max_loras, max_model_len,
                                       kv_cache_gb)
    if cpus:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    sink: IO[str] | int = open(log, "w") if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                tail = log.read_text()[-2000:] if log is not None else ""
                raise RuntimeError(f"vllm serve exited with {proc.returncode} {tail}")
            try:
                if requests.get(url + "/v1/models", timeout=2).ok:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not answer within {startup_timeout_s:.0f} s")
            time.sleep(1)
        yield url
    finally:
        stop_group(proc, SHUTDOWN_GRACE_S)
        if not isinstance(sink, int):
            sink.close()
