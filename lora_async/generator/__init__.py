"""The generator: vLLM serving many adapter versions at once, with in-memory hot-swap."""

from .types import AdapterVersion, GenRequest, GenResult, Generator, PublishStats, Sample

__all__ = ["AdapterVersion", "GenRequest", "GenResult", "Generator", "PublishStats", "Sample"]
