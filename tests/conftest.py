"""Shared fixtures (a tiny random-weight Llama with the real tokenizer) and the tiers' guard.

Tiers (markers in pyproject.toml): unit tests run on fakes and tiny models with no engine;
`vllm` tests start the real vLLM CPU engine; `slow` tests run training end to end (the CLI, or
`train` on real parts); `ray` tests start a local Ray cluster; `long` and `gpu` tests are not in
`make test`. `make test-fast` runs the unit tier with `LORA_ASYNC_TEST_TIER=unit`, and then a
test that starts an engine, Ray, or a training run without its marker fails at once, naming the
marker it lacks: a tier cannot quietly grow slow.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent
TIER_ENV = "LORA_ASYNC_TEST_TIER"
CLI_NAMES = ("lora_async", "lora-async")
HEAVY_COMMANDS = ("train", "eval", "bench", "serve", "server")
CONFIG_ERROR_EXIT = 2  # the CLI's exit code for a config mistake, found before anything loads


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    from lora_async.models import embedded_tokenizer

    return embedded_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, 128-wide Llama with random bf16 weights and the SmolLM2 tokenizer."""
    from lora_async.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", tokenizer_dir)


def _heavy_cli(args: Any) -> str | None:
    """The lora-async command a subprocess runs, when it is one that loads models."""
    argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
    if not any(name in part for part in argv for name in CLI_NAMES):
        return None
    return next((a for a in argv if a in HEAVY_COMMANDS), None)


@pytest.fixture(autouse=True)
def _unit_tier_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """In the unit tier, refuse what belongs to another: a vLLM engine (`vllm`), a training run
    on real parts or a CLI command that went past its config check (`slow`), Ray (`ray`)."""
    if os.environ.get(TIER_ENV) != "unit":
        yield
        return
    node = request.node.nodeid

    def refuse(what: str, marker: str) -> Any:
        def refused(*args: Any, **kwargs: Any) -> Any:
            pytest.fail(f"{node} {what} but is not marked `{marker}`: mark it (it does not belong in the unit tier)",
                        pytrace=False)
        return refused

    from lora_async.generator.vllm.client import EngineClient
    from lora_async.orchestrator import lifecycle

    monkeypatch.setattr(EngineClient, "start", classmethod(refuse("starts a vLLM engine", "vllm")))
    monkeypatch.setattr(lifecycle.LocalParts, "__init__", refuse("trains on real parts (model, engine, learner)",
                                                                "slow"))
    monkeypatch.setattr("lora_async.generator.ray.cluster.connect", refuse("starts Ray", "ray"))
    started: list[tuple[subprocess.Popen, str]] = []
    popen_init = subprocess.Popen.__init__

    def watched(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        popen_init(self, args, *rest, **kwargs)
        command = _heavy_cli(args)
        if command is not None:
            started.append((self, command))

    monkeypatch.setattr(subprocess.Popen, "__init__", watched)
    yield
    for process, command in started:
        if process.returncode != CONFIG_ERROR_EXIT:
            pytest.fail(f"{node} ran `lora-async {command}` past its config check (exit {process.returncode}) but is "
                        "not marked `slow`: mark it (it does not belong in the unit tier)", pytrace=False)
