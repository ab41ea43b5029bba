"""Exporting a stored adapter: as a PEFT directory, or merged into a full model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .store import AdapterStore, StoredVersion, load_peft_dir, save_peft_dir


def pick_version(run_dir: Path, name: str, version: int | None) -> StoredVersion:
    store = AdapterStore(run_dir)
    versions = store.versions(name)
    if not versions:
        known = ", ".join(store.names()) or "none"
        raise FileNotFoundError(f"{run_dir}: no adapter named {name!r} (adapters: {known})")
    if version is None:
        return versions[-1]
    for stored in versions:
        if stored.version == version:
            return stored
    raise FileNotFoundError(f"{name}: no version {version} (stored: {[v.version for v in versions]})")


def export_adapter(run_dir: Path, name: str, dest: Path, version: int | None = None, merged: bool = False) -> Path:
    stored = pick_version(run_dir, name, version)
    if dest.exists() and any(dest.iterdir()):
        raise FileExistsError(f"{dest} exists and is not empty")
    if not merged:
        tensors, config = load_peft_dir(stored.path)
        return save_peft_dir(dest, tensors, config, stored.info)
    return _export_merged(run_dir, stored, dest)


def _export_merged(run_dir: Path, stored: StoredVersion, dest: Path) -> Path:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..learner.served_base import run_base

    # The base the run's generator served: for a quantised learner, its weights dequantised, so the
    # merged model computes what training sampled from.
    model_dir, _ = run_base(run_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, stored.path).merge_and_unload()
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.to(torch.bfloat16).save_pretrained(tmp)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp)
    for extra in ("generation_config.json",):
        if (model_dir / extra).is_file():
            shutil.copy(model_dir / extra, tmp / extra)
    if dest.exists():
        dest.rmdir()
    tmp.rename(dest)
    return dest
