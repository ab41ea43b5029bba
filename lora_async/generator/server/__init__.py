"""The `server` generator: remote OpenAI-compatible `vllm serve` replicas over HTTP.

`generator.ServerGenerator` drives them through `client.ServerClient`; `command` is the command
line they are started with (`lora-async server`, tests and benchmarks).
"""

from .client import ServerClient, ServerError
from .generator import ServerGenerator

__all__ = ["ServerClient", "ServerError", "ServerGenerator"]
