"""`lora-async serve`: vLLM's OpenAI-compatible server on the base model, with the latest
version of every adapter of a run registered under its plain name.

The server is `vllm serve` (its `api_server` module) in a child process; Ctrl-C or SIGTERM is
passed on to it and waited for, so shutdown is clean.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from .adapters import AdapterStore
from .bench.proc import stop_group
from .config import vllm_rank
from .generator.server.command import SHUTDOWN_GRACE_S, training_server_command

if TYPE_CHECKING:
    from .base_recipe import Recipe

@dataclass(frozen=True)
class ServedAdapter:
    name: str
    version: int
    path: Path
    rank: int


def served_adapters(run_dir: Path) -> list[ServedAdapter]:
    """The newest stored version of each adapter of a run."""
    store = AdapterStore(run_dir)
    found = []
    for name in store.names():
        latest = store.latest(name)
        if latest is None:
            continue
        config = json.loads((latest.path / "adapter_config.json").read_text())
        found.append(ServedAdapter(name, latest.version, latest.path.resolve(), int(config.get("r", 8))))
    return found


def server_command(run_dir: Path, host: str, port: int, max_model_len: int, kv_cache_gb: float) -> tuple[list[str], list[ServedAdapter], Path]:
    from .learner.served_base import run_base

    config_file = run_dir / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{run_dir} is not a lora-async run directory (no config.json)")
    adapters = served_adapters(run_dir)
    if not adapters:
        raise FileNotFoundError(f"{run_dir} has no stored adapters (adapters/<name>/v<k>/)")
    model_dir, _ = run_base(run_dir)  # the base the run's generator served: its adapters' own
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", "base",
        "--host", host, "--port", str(port), "--max-model-len", str(max_model_len),
        "--enable-lora", "--max-lora-rank", str(vllm_rank(max(a.rank for a in adapters))),
        "--max-loras", str(len(adapters)), "--max-cpu-loras", str(len(adapters)),
        "--kv-cache-memory-bytes", str(int(kv_cache_gb * (1 << 30))),
        "--disable-log-stats", "--uvicorn-log-level", "warning",
        "--lora-modules", *[f"{a.name}={a.path}" for a in adapters],
    ]
    return cmd, adapters, model_dir


def serve_for_training(model: str, host: str, port: int, max_lora_rank: int, max_loras: int,
                       max_model_len: int = 1024, kv_cache_gb: float = 1.0, api_key: str | None = None,
                       console: Console | None = None, recipe: "Recipe | None" = None) -> int:
    from .models import resolve_model

    console = console or Console(stderr=True)
    model_dir = resolve_model(model, console)
    if recipe is not None:
        from .learner.served_base import served_base

        model_dir = served_base(model_dir, recipe, console)
    cmd, env = training_server_command(model_dir, host, port, max_lora_rank, max_loras, max_model_len,
                                       kv_cache_gb, api_key)
    console.print(f"serving {model_dir} as 'base' for training runs at http://{host}:{port}\n"
                  f"  use: generator.type = \"server\", generator.urls = [\"http://{host}:{port}\"]")
    return run_child(cmd, env)


def example_requests(adapters: list[ServedAdapter], host: str, port: int) -> list[str]:
    url = f"http://{host}:{port}/v1/chat/completions"
    return [
        f"curl -s {url} -H 'Content-Type: application/json' -d "
        f"'{{\"model\": \"{a.name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], "
        f"\"max_tokens\": 32}}'"
        for a in adapters
    ]


def serve(run_dir: Path, host: str, port: int, max_model_len: int = 1024, kv_cache_gb: float = 1.0,
          console: Console | None = None) -> int:
    console = console or Console(stderr=True)
    cmd, adapters, model_dir = server_command(run_dir, host, port, max_model_len, kv_cache_gb)
    console.print(f"serving {model_dir} as 'base' with adapters:")
    for a in adapters:
        console.print(f"  {a.name:<16} v{a.version}  {a.path}", highlight=False)
    console.print("example requests (one per adapter):")
    for line in example_requests(adapters, host, port):
        console.print(f"  {line}", highlight=False, soft_wrap=True)
    env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    return run_child(cmd, env)


def run_child(cmd: list[str], env: dict[str, str]) -> int:
    """Run the server in its own process group, passing SIGINT/SIGTERM on; its exit code."""
    child = subprocess.Popen(cmd, env=env, start_new_session=True)

    def forward(signum: int, _frame: object) -> None:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                return _exit_code(child.wait())
            except KeyboardInterrupt:
                forward(signal.SIGINT, None)
    finally:
        stop_server(child)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, give it SHUTDOWN_GRACE_S, then SIGKILL."""
    stop_group(proc, SHUTDOWN_GRACE_S)


def _exit_code(code: int) -> int:
    # A server stopped by our SIGTERM is a clean shutdown.
    return 0 if code in (0, -signal.SIGTERM, 128 + signal.SIGTERM) else code
