"""Atomic checkpoints: adapters, optimizers, RNG, version counters, task position.

    OUT/checkpoints/step-000012/{state.json, <adapter>.safetensors, <adapter>.optim.pt}
    OUT/checkpoints/step-000012/frozen/<adapter>@v<k>.safetensors   (a game's kept opponents)
    OUT/checkpoints/LATEST      (name of the newest complete checkpoint)

A checkpoint is written into a temporary directory, renamed into place, and only then named
in LATEST (itself replaced atomically). A kill at any moment leaves the previous checkpoint
intact. Resume continues version numbering and the task stream where they stopped.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from .files import replaced_dir, write_text_atomic

if TYPE_CHECKING:
    from .adapter_version import AdapterVersion
    from .learner.protocol import LearnerAPI

KEEP = 2  # checkpoints kept on disk (the newest and one before it)


@dataclass
class RunState:
    step: int  # learner steps of the whole run (all adapters)
    steps: dict[str, int]  # per adapter: its learner steps
    next_problem: dict[str, int]  # per adapter: index of the next training problem to draw
    wall_s: float
    counters: dict[str, dict[str, int]]  # per adapter (`Counters.as_dict`)
    auto: dict[str, Any] | None = None  # an auto run's measurements and decisions (`orchestrator.auto_state`)
    leagues: dict[str, dict[str, Any]] | None = None  # per adapter with one: its league (`League.state_dict`)


FROZEN = "frozen"  # a checkpoint's folder of kept versions (a game's frozen opponents), one file each


def save_checkpoint(out_dir: Path, state: RunState, learner: "LearnerAPI",
                    frozen: "Sequence[AdapterVersion]" = ()) -> Path:
    """`frozen`: the kept versions a resumed run publishes again (a game's opponents from the
    past); a file the previous checkpoint holds already is linked, not written again."""
    from safetensors.torch import save_file

    root = out_dir / "checkpoints"
    name = f"step-{state.step:06d}"
    previous = latest_checkpoint(out_dir)
    with replaced_dir(root / name) as tmp:
        if frozen:
            save_frozen(tmp / FROZEN, frozen, previous / FROZEN if previous is not None else None)
        versions = {}
        for adapter in learner.adapters:
            save_file(learner.adapter_tensors(adapter), str(tmp / f"{adapter}.safetensors"))
            torch.save(learner.state_dict(adapter), tmp / f"{adapter}.optim.pt")
            versions[adapter] = learner.version(adapter)
        payload = {
            "step": state.step,
            "steps": state.steps,
            "versions": versions,
            "next_problem": state.next_problem,
            "wall_s": state.wall_s,
            "counters": state.counters,
            "auto": state.auto,
            "leagues": state.leagues,
            "rng": {
                "python": _py_rng_to_json(random.getstate()),
                "torch": torch.get_rng_state().tolist(),
            },
        }
        (tmp / "state.json").write_text(json.dumps(payload))
    write_text_atomic(root / "LATEST", name)
    for old in sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return root / name


def latest_checkpoint(out_dir: Path) -> Path | None:
    pointer = out_dir / "checkpoints" / "LATEST"
    if not pointer.is_file():
        return None
    path = out_dir / "checkpoints" / pointer.read_text().strip()
    return path if (path / "state.json").is_file() else None


def load_checkpoint(path: Path, learner: "LearnerAPI") -> RunState:
    """Restore learner adapters/optimizers/versions and the RNG; return the run counters."""
    from safetensors.torch import load_file

    payload = json.loads((path / "state.json").read_text())
    for adapter in learner.adapters:
        learner.load_adapter_tensors(adapter, load_file(str(path / f"{adapter}.safetensors")))
        learner.load_state_dict(adapter, torch.load(path / f"{adapter}.optim.pt", weights_only=False))
    random.setstate(_py_rng_from_json(payload["rng"]["python"]))
    torch.set_rng_state(torch.tensor(payload["rng"]["torch"], dtype=torch.uint8))
    return RunState(payload["step"], payload["steps"], payload["next_problem"], payload["wall_s"],
                    payload["counters"], payload.get("auto"), payload.get("leagues"))


def save_frozen(folder: Path, versions: "Sequence[AdapterVersion]", previous: Path | None) -> None:
    """Each kept version as `<adapter>@v<k>.safetensors`, its peft config in the file's metadata."""
    from safetensors.torch import save_file

    folder.mkdir()
    for version in versions:
        path = folder / f"{version.served_name}.safetensors"
        old = previous / path.name if previous is not None else None
        if old is not None and old.is_file():
            os.link(old, path)  # the same version's bytes: the checkpoint stays whole on its own
            continue
        save_file({k: t.contiguous() for k, t in version.tensors.items()}, str(path),
                  metadata={"peft_config": json.dumps(version.peft_config)})


def load_frozen(path: Path) -> tuple[list["AdapterVersion"], list[str]]:
    """The kept versions a checkpoint holds (none for a run without a game's frozen opponents),
    and a line for each file that could not be read (the run goes on without that version)."""
    from safetensors import safe_open

    from .adapter_version import AdapterVersion, parse_served_name

    versions, problems = [], []
    for file in sorted((path / FROZEN).glob("*.safetensors")):
        try:
            adapter, number = parse_served_name(file.name.removesuffix(".safetensors"))
            with safe_open(str(file), "pt") as handle:
                tensors = {key: handle.get_tensor(key) for key in handle.keys()}
                peft_config = json.loads((handle.metadata() or {}).get("peft_config", "{}"))
        except Exception as exc:
            problems.append(f"{file}: {type(exc).__name__}: {exc}")
            continue
        versions.append(AdapterVersion(adapter, number, tensors, peft_config))
    return versions, problems


def checkpoint_auto(path: Path) -> dict[str, Any] | None:
    """An auto run's state in a checkpoint (None: none kept), read before anything is built: the
    run's mode is set up first."""
    return json.loads((path / "state.json").read_text()).get("auto")


def checkpoint_tensors(path: Path, adapter: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / f"{adapter}.safetensors"))


def _py_rng_to_json(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _py_rng_from_json(data: list) -> tuple:
    return (data[0], tuple(data[1]), data[2])
