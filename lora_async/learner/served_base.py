"""The base a quantised learner's generator serves: the learner's own weights, dequantised.

With `model.quantization = "nf4"` (or "int8") the learner computes with bitsandbytes-rounded
weights. A generator serving the original checkpoint samples from another model: 0.45 nats per
token apart on the 135M model, a third of the tokens outside PPO's clip range
(bench/RESULTS.md §8). So by default (`generator.base = "learner"`) the generator serves a
checkpoint of the weights the learner's quantised layers multiply by, read off the layers
themselves at the learner's compute dtype (`base_weights`); every other tensor (embeddings,
norms, LM head) is the learner's own copy. Both halves then start from the same numbers, and
what is left between them is kernels and dtype, as in an unquantised run (§19).

This module is the cache of those copies. An entry is built once per (checkpoint content,
quantisation, compute dtype, device type, bitsandbytes version) under `<cache>/bases/`, beside
the embedded model, by one builder at a time across processes (a file lock). A changed
checkpoint or quantisation is another entry (built, and the one it supersedes removed); an
entry whose files no longer match the content hashes recorded when it was built is rebuilt.
Building loads the quantised base the way the learner does (`base_weights.quantised_base`),
then writes its weights in safetensors shards one tensor at a time (`write_shards`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import blake3
import torch

from ..base_recipe import Recipe
from ..dtypes import resolve_dtype, torch_dtype
from ..files import replaced_dir, write_text_atomic
from ..models import ModelError, cache_dir
from ..progress import Stage, gigabytes, stage
from .base_weights import copy_bytes, learner_weights, quantised_base

if TYPE_CHECKING:
    from rich.console import Console

    from ..config import TrainConfig

FORMAT = 1  # bump when what an entry holds changes: every entry is then rebuilt
SHARD_BYTES = 2 << 30
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
RECORD = "generator_base.json"  # in a run's output directory: the base its generator served


class ServedBaseError(ModelError):
    """The learner's base cannot be built for the generator (one line; the CLI's exit code 1)."""


def recipe_for(config: "TrainConfig", learner_device: str) -> Recipe | None:
    """The recipe of a run whose generator serves the learner's quantised base; None when it
    serves the checkpoint as it is (no quantisation, or `generator.base = "original"`)."""
    if config.model.quantization == "none" or config.generator.base == "original":
        return None
    device = torch.device(learner_device).type
    return Recipe(config.model.quantization, resolve_dtype(config.learner.dtype, learner_device), device)


def base_root() -> Path:
    return cache_dir() / "bases"


# ---------------------------------------------------------------- content hashes


def _file_hash(path: Path, memo: dict[str, list]) -> str:
    """blake3 of a file's bytes; `memo` (path -> [size, mtime_ns, hash]) skips files unchanged
    since they were last hashed, so an 8B checkpoint is read once, not at every start."""
    stat = path.stat()
    key = str(path.resolve())
    known = memo.get(key)
    if known is not None and known[:2] == [stat.st_size, stat.st_mtime_ns]:
        return str(known[2])
    digest = blake3.blake3(max_threads=blake3.blake3.AUTO).update_mmap(path).hexdigest()
    memo[key] = [stat.st_size, stat.st_mtime_ns, digest]
    return str(digest)


def _content_files(model_dir: Path) -> list[Path]:
    """What a checkpoint's content is: every visible file at its top level (weights, config,
    tokenizer: the served copy holds all of them)."""
    return sorted(p for p in model_dir.iterdir() if p.is_file() and not p.name.startswith("."))


def content_hash(model_dir: Path, memo: dict[str, list]) -> str:
    whole = blake3.blake3()
    for path in _content_files(model_dir):
        whole.update(f"{path.name}\0{_file_hash(path, memo)}\n".encode())
    return str(whole.hexdigest())


@contextlib.contextmanager
def _hash_memo(root: Path) -> Iterator[dict[str, list]]:
    path = root / "hashes.json"
    try:
        memo = json.loads(path.read_text())
    except (OSError, ValueError):
        memo = {}
    before = json.dumps(memo, sort_keys=True)
    yield memo
    for gone in [key for key in memo if not Path(key).exists()]:  # superseded entries' files
        del memo[gone]
    if json.dumps(memo, sort_keys=True) != before:
        write_text_atomic(path, json.dumps(memo, indent=1, sort_keys=True))


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One builder per entry across processes (two runs starting at once build it once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ---------------------------------------------------------------- the entry


def served_base(model_dir: Path, recipe: Recipe, console: "Console | None" = None) -> Path:
    """The directory of `recipe`'s dequantised copy of `model_dir`, built if missing or stale."""
    import bitsandbytes
    from rich.console import Console

    console = console or Console(stderr=True)
    model_dir = Path(model_dir).resolve()
    root = base_root()
    root.mkdir(parents=True, exist_ok=True)
    with _hash_memo(root) as memo:
        source = content_hash(model_dir, memo)
        identity = {"format": FORMAT, "source_hash": source, "recipe": asdict(recipe),
                    "bitsandbytes": bitsandbytes.__version__}
        key = blake3.blake3(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
        entry = root / f"{model_dir.name}-{recipe.quantization}-{recipe.dtype}-{recipe.device}-{key}"
        with _locked(root / f".{entry.name}.lock"):
            for stale in root.glob(f".{entry.name}.*"):  # a builder killed mid-way (the lock is ours now)
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
            problem = _check_entry(entry, memo)
            if problem is None:
                return entry
            if problem != "missing":
                console.print(f"[yellow]{entry} {problem}: building it again[/]")
            with stage(f"building the generator's base ({recipe.describe()}; one time) into {entry}",
                       console=console, unit=gigabytes) as progress:
                export_base(model_dir, recipe, entry, {**identity, "source": str(model_dir)}, memo, progress)
        _remove_superseded(root, entry, str(model_dir), recipe)
    return entry


@dataclass(frozen=True)
class BaseBuilder:
    """Builds `recipe`'s copy of a checkpoint on whichever machine calls it, quietly: what a
    generator replica on a node without the learner's copy runs (`generator.ray`). Picklable,
    so it travels there; the generator takes it as a `generator.types.LearnerBase`, without
    importing the learner."""

    recipe: Recipe

    def __call__(self, model_dir: Path) -> Path:
        from rich.console import Console

        return served_base(model_dir, self.recipe, Console(quiet=True))


def _check_entry(entry: Path, memo: dict[str, list]) -> str | None:
    """None if `entry` holds what it recorded when built; else what is wrong with it."""
    try:
        record = json.loads((entry / ".complete").read_text())
    except (OSError, ValueError):
        return "missing" if not entry.exists() else "is incomplete"
    for name, digest in record["files"].items():
        path = entry / name
        if not path.is_file():
            return f"lacks {name}"
        if _file_hash(path, memo) != digest:
            return f"has a changed {name} (its content hash differs from the one recorded)"
    return None


def _remove_superseded(root: Path, keep: Path, source: str, recipe: Recipe) -> None:
    """Entries built from an earlier content of the same checkpoint with the same recipe."""
    for entry in root.iterdir():
        if entry == keep or not entry.is_dir():
            continue
        with contextlib.suppress(OSError, ValueError, KeyError):
            record = json.loads((entry / ".complete").read_text())
            if record["source"] == source and record["recipe"] == asdict(recipe):
                shutil.rmtree(entry, ignore_errors=True)


def export_base(model_dir: Path, recipe: Recipe, entry: Path, identity: dict[str, Any] | None = None,
                memo: dict[str, list] | None = None, progress: Stage | None = None) -> dict[str, Any]:
    """Write `recipe`'s dequantised copy of `model_dir` to `entry` (replaced whole, or left as it
    was if this fails); returns what its `.complete` records. `served_base` caches it; the GPU
    check times it alone. `progress`: told the bytes to write, and each tensor's as it is."""
    memo = {} if memo is None else memo
    try:
        base = quantised_base(model_dir, recipe)
    except Exception as exc:
        from ..errors import error_line

        raise ServedBaseError(f"could not load {model_dir} as the learner does ({recipe.quantization}) to build "
                              f"the generator's base: {error_line(exc)}") from exc
    compute = torch_dtype(recipe.dtype)
    need = copy_bytes(base, compute)
    _check_disk(entry.parent, need)
    if progress is not None:
        progress.set_total(need)
    with _one_line_os_errors(entry), replaced_dir(entry) as tmp:
        weights = write_shards(tmp, learner_weights(base, compute), None if progress is None else progress.advance)
        del base
        for path in _content_files(model_dir):
            if path.suffix not in WEIGHT_SUFFIXES and not path.name.endswith(".index.json"):
                shutil.copy(path, tmp / path.name)
        config = json.loads((model_dir / "config.json").read_text())
        config.pop("quantization_config", None)
        config["torch_dtype"] = config["dtype"] = recipe.dtype
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        files = {p.name: _file_hash(p, memo) for p in _content_files(tmp)}
        done = {**(identity or {}), "files": files, "tensors": weights}
        (tmp / ".complete").write_text(json.dumps(done, indent=1))
    for name in files:  # hashed under the temporary path; a rename keeps size and mtime
        memo[str((entry / name).resolve())] = memo.pop(str((tmp / name).resolve()))
    if recipe.device == "cuda":
        torch.cuda.empty_cache()  # the quantised copy's memory, before the engine and the learner start
    return done


def _check_disk(where: Path, need: int) -> None:
    where.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(where).free
    if free < need * 1.02 + (64 << 20):
        raise ServedBaseError(f"the generator's base (the learner's weights, dequantised) needs {need / 1e9:.2f} GB "
                              f"in {where}, which has {free / 1e9:.2f} GB free: free some space, point "
                              "LORA_ASYNC_CACHE at a larger disk, or set generator.base = 'original'")


@contextlib.contextmanager
def _one_line_os_errors(entry: Path) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise ServedBaseError(f"could not write the generator's base to {entry}: {exc.strerror or exc}") from exc


def write_shards(out: Path, tensors: Iterator[tuple[str, torch.Tensor]],
                 written: Callable[[int], None] | None = None) -> int:
    """safetensors shards of at most `SHARD_BYTES` plus the HF index; returns the tensor count.
    `written`: told each tensor's bytes once its shard is on disk."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = count = 0
    names: list[list[str]] = [[]]
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            save_file(shards[-1], str(out / f"part-{len(shards)}.safetensors"), metadata={"format": "pt"})
            if written is not None:
                written(size)
            shards[-1] = {}
            shards.append({})
            names.append([])
            size = 0
        shards[-1][name] = tensor
        names[-1].append(name)
        size += nbytes
        count += 1
    save_file(shards[-1], str(out / f"part-{len(shards)}.safetensors"), metadata={"format": "pt"})
    if written is not None:
        written(size)
    total = len(shards)
    weight_map = {}
    for i, group in enumerate(names, 1):
        final = f"model-{i:05d}-of-{total:05d}.safetensors"
        (out / f"part-{i}.safetensors").rename(out / final)
        weight_map.update(dict.fromkeys(group, final))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    return count


# ---------------------------------------------------------------- a run's generator base


def generator_base(config: "TrainConfig", model_dir: Path, learner_device: str,
                   console: "Console | None" = None) -> tuple[Path, Recipe | None]:
    """The directory a run's generator serves and the recipe it was built by (None: the checkpoint)."""
    recipe = recipe_for(config, learner_device)
    return (model_dir if recipe is None else served_base(model_dir, recipe, console)), recipe


def record(out_dir: Path, model_name: str, served: Path, recipe: Recipe | None) -> None:
    """Note in a run's directory which base its generator served (`serve` and `export` read it)."""
    write_text_atomic(out_dir / RECORD, json.dumps({"model": model_name, "path": str(served),
                                                     "recipe": None if recipe is None else asdict(recipe)}, indent=1))


def run_base(run_dir: Path, console: "Console | None" = None) -> tuple[Path, Recipe | None]:
    """The base a finished run's generator served: its recorded recipe, rebuilt if the cache
    lost it; the checkpoint itself for runs that served it (or predate the record)."""
    from ..models import resolve_model

    path = Path(run_dir) / RECORD
    if path.is_file():
        noted = json.loads(path.read_text())
        model_dir = resolve_model(noted["model"], console)
        if noted["recipe"] is None:
            return model_dir, None
        recipe = Recipe(**noted["recipe"])
        return served_base(model_dir, recipe, console), recipe
    return resolve_model(json.loads((Path(run_dir) / "config.json").read_text())["model"]["name"], console), None
