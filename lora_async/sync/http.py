"""The `http` transport: new versions for remote `vllm serve` replicas.

A version becomes a standard PEFT directory, written atomically (`adapters.save_peft_dir`)
under a sync directory the servers can read; its delivery asks every replica to load it under
its versioned name through the generator's receiver, its `ServerClient` (`/v1/load_lora_adapter`: servers
started by `lora-async server`). When one replica fails, the ones that loaded it unload it
again, so every replica keeps the same set. The directory of a version that is no longer live
is removed at the next publish (and all of them at close).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Iterator

from ..adapter_version import AdapterVersion, parse_served_name
from ..adapters.store import save_peft_dir
from ..generator.receivers import ServerReceiver
from ..generator.types import Delivery, Generator, PublishStats


def version_dir(sync_dir: Path, served_name: str) -> Path:
    """`sync_dir/<adapter>@v<k>`, refusing names that would land anywhere else."""
    parse_served_name(served_name)
    root = Path(sync_dir).resolve()
    path = (root / served_name).resolve()
    if path.parent != root:
        raise ValueError(f"{served_name!r} escapes the sync directory {root}")
    return path


class HttpTransport:
    name = "http"

    def __init__(self, generator: Generator[ServerReceiver], sync_dir: Path, timeout_s: float = 60.0,
                 retry_budget_s: float = 30.0) -> None:
        self.generator = generator
        self.sync_dir = Path(sync_dir).resolve()
        self.sync_dir.mkdir(parents=True, exist_ok=True)
        self.timeout_s, self.retry_budget_s = timeout_s, retry_budget_s

    def publish(self, version: AdapterVersion) -> PublishStats:
        started = time.perf_counter()
        self.generator.validate(version)
        path = save_peft_dir(version_dir(self.sync_dir, version.served_name), version.tensors, version.peft_config)
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())

        def load(servers: ServerReceiver, int_id: int) -> None:
            servers.load(version.served_name, str(path), timeout_s=self.timeout_s, retry_budget_s=self.retry_budget_s)

        try:
            stats = self.generator.register(Delivery(version.adapter, version.version, size, self.name, load,
                                                     started, path=str(path)))
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        self._prune(version.adapter)
        return stats

    def _prune(self, adapter: str) -> None:
        """Remove the directories of this adapter's versions that are no longer live."""
        live = set(self.generator.live_versions(adapter))
        for path, (name, version) in self._version_dirs():
            if name == adapter and version not in live:
                shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        for path, _ in self._version_dirs():
            shutil.rmtree(path, ignore_errors=True)

    def _version_dirs(self) -> Iterator[tuple[Path, tuple[str, int]]]:
        """Every version directory in the sync directory, with the (adapter, version) its name holds."""
        for path in list(self.sync_dir.iterdir()):
            try:
                parsed = parse_served_name(path.name)
            except ValueError:
                continue  # not a version's directory (nor one half-written: those start with a dot)
            yield path, parsed
