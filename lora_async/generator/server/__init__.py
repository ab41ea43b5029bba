"""The `server` generator: remote OpenAI-compatible `vllm serve` replicas over HTTP."""

from .client import ServerClient, ServerError
from .generator import ServerGenerator

__all__ = ["ServerClient", "ServerError", "ServerGenerator"]
