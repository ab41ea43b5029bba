"""Versioned adapters on disk, in standard PEFT format.

    OUT/adapters/<name>/v<k>/adapter_model.safetensors
    OUT/adapters/<name>/v<k>/adapter_config.json
    OUT/adapters/<name>/v<k>/lora_async.json      (step, reward, wall time: for `adapters list`)
    OUT/adapters/<name>/final/                    (copy of the last version)

Every directory is written to a temporary sibling and renamed into place, so a reader (or a
`vllm serve --lora-modules`) never sees half an adapter.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..files import replaced_dir

VERSION_DIR_RE = re.compile(r"^v(\d+)$")


def save_peft_dir(path: Path, tensors: dict[str, torch.Tensor], peft_config: dict,
                  info: dict | None = None) -> Path:
    """Atomically write a PEFT adapter directory (replacing any previous one)."""
    from safetensors.torch import save_file

    with replaced_dir(path) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
                  str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(peft_config, indent=2, default=str))
        if info is not None:
            (tmp / "lora_async.json").write_text(json.dumps(info, indent=2))
    return Path(path)


def load_peft_dir(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    path = Path(path)
    weights = path / "adapter_model.safetensors"
    config = path / "adapter_config.json"
    if not weights.is_file() or not config.is_file():
        raise FileNotFoundError(f"{path} is not a PEFT adapter directory (needs adapter_model.safetensors "
                                "and adapter_config.json)")
    return load_file(str(weights)), json.loads(config.read_text())


@dataclass(frozen=True)
class StoredVersion:
    adapter: str
    version: int
    path: Path
    info: dict

    @property
    def size_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())


class AdapterStore:
    """The `adapters/` folder of a run directory."""

    def __init__(self, run_dir: Path) -> None:
        self.root = Path(run_dir) / "adapters"

    def path(self, adapter: str, version: int | str) -> Path:
        leaf = version if isinstance(version, str) else f"v{version}"
        resolved = (self.root / adapter / leaf).resolve()
        if self.root.resolve() not in resolved.parents:
            raise ValueError(f"adapter path {adapter}/{leaf} escapes {self.root}")
        return self.root / adapter / leaf

    def save(self, adapter: str, version: int, tensors: dict[str, torch.Tensor], peft_config: dict,
             info: dict, final: bool = False) -> Path:
        path = save_peft_dir(self.path(adapter, version), tensors, peft_config, {**info, "version": version})
        if final:
            save_peft_dir(self.path(adapter, "final"), tensors, peft_config, {**info, "version": version})
        return path

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))

    def versions(self, adapter: str) -> list[StoredVersion]:
        folder = self.root / adapter
        found = []
        for child in folder.iterdir() if folder.is_dir() else []:
            match = VERSION_DIR_RE.match(child.name)
            if match and (child / "adapter_config.json").is_file():
                info_file = child / "lora_async.json"
                info = json.loads(info_file.read_text()) if info_file.is_file() else {}
                found.append(StoredVersion(adapter, int(match[1]), child, info))
        return sorted(found, key=lambda v: v.version)

    def latest(self, adapter: str) -> StoredVersion | None:
        versions = self.versions(adapter)
        return versions[-1] if versions else None
