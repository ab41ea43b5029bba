"""Shared fixtures: a tiny random-weight Llama (real tokenizer) and one vLLM engine per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    from lora_async.models import embedded_tokenizer

    return embedded_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, 128-wide Llama with random bf16 weights and the SmolLM2 tokenizer."""
    from lora_async.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", tokenizer_dir)
