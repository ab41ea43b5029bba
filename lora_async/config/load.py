"""Loading: TOML + `--set` overrides -> `TrainConfig`, and every problem as one `ConfigError` line.

Old keys are refused before validation with the exact change to make (`MIGRATIONS`). Pydantic
errors are located by walking the model classes along the error's `loc`, so union tags never
show up in a dotted path and unknown keys inside a backend name the backend they are not part of.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Iterator, Mapping, Sequence, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from ..errors import UserError
from .sections import SamplingConfig
from .tasks import DatasetTask, JsonlTask
from .train import TrainConfig


class ConfigError(UserError):
    """A configuration problem, phrased as one line for the user."""


# ---------------------------------------------------------------- migration of old keys

# (dotted key, '*' matching a list index; the old value that is refused, None = any; what to do).
# `{N}` in the text is replaced by the list index the key was found at.
MIGRATIONS: tuple[tuple[str, Any, str], ...] = (
    ("generator.backend", None, 'renamed generator.type ("vllm", "server" or "ray")'),
    *((f"generator.{key}", None, f"moved to [sampling] (sampling.{key})") for key in SamplingConfig.model_fields),
    ("sync.transport", "auto", "'auto' is gone: leave out [sync] to pick the transport from the generator"),
    ("adapters.*.generation", None, "renamed adapters.{N}.sampling"),
)


def _find(node: Any, path: list[str], found: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every (concrete dotted path, value) in raw data matching `path`."""
    if not path:
        yield found, node
        return
    head, rest = path[0], path[1:]
    if head == "*" and isinstance(node, list):
        for i, child in enumerate(node):
            yield from _find(child, rest, found + (str(i),))
    elif isinstance(node, dict) and head in node:
        yield from _find(node[head], rest, found + (head,))


def check_migrations(data: dict[str, Any], source: str) -> None:
    """Refuse keys of an older schema, saying exactly what to write instead (never rewrites)."""
    for pattern, old_value, text in MIGRATIONS:
        for where, value in _find(data, pattern.split(".")):
            if old_value is None or value == old_value:
                index = next((part for part, want in zip(where, pattern.split(".")) if want == "*"), "")
                raise ConfigError(f"{source}: {'.'.join(where)}: {text.replace('{N}', index)}")


# ---------------------------------------------------------------- error formatting


@dataclass(frozen=True)
class _Place:
    """Where an error's loc points, in the user's terms."""

    field: str                                # dotted path, union tags dropped
    member: str | None                        # 'generator.type = "vllm"' when the last key sits in a union member
    union: tuple[str, list[str]] | None       # (discriminator, tags) when the loc ends on a tagged union


def _unwrap(annotation: Any) -> tuple[Any, str | None]:
    """Strip Optional and Annotated; return the core type and a discriminator found on the way."""
    discriminator = None
    while True:
        if get_origin(annotation) is Annotated:
            for meta in annotation.__metadata__:
                if isinstance(getattr(meta, "discriminator", None), str):
                    discriminator = meta.discriminator
            annotation = get_args(annotation)[0]
        elif get_origin(annotation) in (Union, types.UnionType):
            members = [arg for arg in get_args(annotation) if arg is not type(None)]
            if len(members) > 1:
                return annotation, discriminator
            annotation = members[0]
        else:
            return annotation, discriminator


def _tags(union: Any, discriminator: str) -> dict[str, type[BaseModel]]:
    return {tag: member for member in get_args(union)
            for tag in get_args(member.model_fields[discriminator].annotation)}


def _locate(loc: tuple[Any, ...]) -> _Place:
    parts: list[str] = []
    annotation: Any = TrainConfig
    discriminator: str | None = None
    member = owner = None  # the union member we are in; the member holding the last key
    for i, item in enumerate(loc):
        core, found = _unwrap(annotation)
        discriminator = discriminator or found
        if get_origin(core) in (Union, types.UnionType):
            tags = _tags(core, discriminator) if discriminator else {}
            if item not in tags:
                break  # a plain union: pydantic's labels of its members are not keys
            member = f"{'.'.join(parts)}.{discriminator} = \"{item}\""
            annotation, discriminator = tags[item], None
            continue
        if isinstance(core, type) and issubclass(core, BaseModel) and item in core.model_fields:
            info = core.model_fields[item]
            annotation = info.annotation
            discriminator = info.discriminator if isinstance(info.discriminator, str) else None
        elif get_origin(core) is list and isinstance(item, int):
            annotation = get_args(core)[0]
        else:
            parts.extend(str(part) for part in loc[i:])  # an unknown key or a scalar's inner detail
            owner = member
            break
        owner, member = member, None
        parts.append(str(item))
    else:
        core, found = _unwrap(annotation)
        discriminator = discriminator or found
        if get_origin(core) in (Union, types.UnionType) and discriminator:
            return _Place(".".join(parts), owner, (discriminator, list(_tags(core, discriminator))))
    return _Place(".".join(parts) or "(root)", owner, None)


def _either(tags: list[str]) -> str:
    quoted = [repr(tag) for tag in tags]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def format_validation_error(exc: ValidationError, source: str) -> str:
    """The first error as one line: `file: dotted.field: problem`."""
    err = exc.errors()[0]
    place, kind = _locate(err["loc"]), err["type"]
    field = place.field
    if place.union and kind in ("union_tag_invalid", "union_tag_not_found"):
        discriminator, tags = place.union
        field = f"{field}.{discriminator}"
        if kind == "union_tag_invalid":
            expected = [tag.strip("'") for tag in err["ctx"]["expected_tags"].split(", ")]
            msg = f"unknown {err['ctx']['tag']!r} (use {_either(expected)})"
        else:
            msg = f"required (one of {_either(tags)})"
    elif kind == "extra_forbidden" and place.member:
        msg = f"not a setting of {place.member} (check the spelling or the type)"
    elif kind == "extra_forbidden":
        msg = "unknown key (check the spelling; see `lora-async train --help`)"
    elif kind == "missing":
        msg = f"required for {place.member}" if place.member else "required field is missing"
    else:
        msg = err["msg"].removeprefix("Value error, ")
        if "input" in err and kind != "value_error" and not isinstance(err["input"], dict):
            msg += f" (got {err['input']!r})"
    more = len(exc.errors()) - 1
    suffix = f" [+{more} more]" if more else ""
    if field == "(root)" and re.match(r"^[a-z_][\w.]*[: ]", msg):
        return f"{source}: {msg}{suffix}"  # a cross-field check names its own dotted fields
    return f"{source}: {field}: {msg}{suffix}"


# ---------------------------------------------------------------- loading


def parse_override(text: str) -> tuple[list[str], Any]:
    """`dotted.key=value` -> (path, value); the value is parsed as TOML, else kept a string."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected dotted.key=value")
    key, raw = text.split("=", 1)
    path = _dotted(key.strip(), f"--set {text!r}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return path, value


Overrides = Union[Sequence[str], Mapping[str, Any]]  # ["run.max_steps=2"] (as --set), or {"run.max_steps": 2}


def apply_overrides(data: dict[str, Any], overrides: Overrides) -> dict[str, Any]:
    """Set dotted keys in raw config data: `--set` texts (values parsed as TOML), or a mapping
    of dotted keys to Python values (the Python API's `overrides=`)."""
    if isinstance(overrides, Mapping):
        pairs = [(_dotted(key, f"overrides[{key!r}]"), value, f"overrides[{key!r}]")
                 for key, value in overrides.items()]
    else:
        texts = [overrides] if isinstance(overrides, str) else list(overrides)
        pairs = [(*parse_override(text), f"--set {text!r}") for text in texts]
    for path, value, label in pairs:
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{label}: {'.'.join(path[:-1])} is not a section")
            node = child
        node[path[-1]] = value
    return data


def _dotted(key: Any, label: str) -> list[str]:
    if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key):
        raise ConfigError(f"{label}: {key!r} is not a dotted key")
    return key.split(".")


def load_config(path: str | os.PathLike[str] | None, overrides: Overrides = ()) -> TrainConfig:
    """Read TOML (or defaults when path is None), apply overrides (`--set` texts, or a mapping of
    dotted keys to values), validate. Any problem is one `ConfigError` line naming the field."""
    source = str(path) if path is not None else "<defaults>"
    data: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"{source}: config file not found")
        try:
            data = tomllib.loads(file.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    data = apply_overrides(data, overrides)
    if overrides:
        source += " (with overrides)" if isinstance(overrides, Mapping) else " (with --set)"
    config = validated(data, source)
    resolve_task_paths(config, Path(path).parent if path is not None else Path.cwd(), source)
    return config


def with_overrides(config: TrainConfig, overrides: Overrides) -> TrainConfig:
    """A copy of `config` with dotted keys set, validated as `load_config` validates."""
    return validated(apply_overrides(json.loads(dump_config(config)), overrides), "<TrainConfig> (with overrides)")


def validated(data: dict[str, Any], source: str) -> TrainConfig:
    """Raw config data as a `TrainConfig`: old keys refused, then validated; one `ConfigError` line."""
    check_migrations(data, source)
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None


LOCAL_DATA_SUFFIXES = (".parquet", ".json", ".jsonl", ".csv", ".arrow")  # a dataset path with one is a file


def resolve_task_paths(config: TrainConfig, base: Path, source: str) -> None:
    """Make every task's local file absolute (relative paths are relative to `base`, the config
    file's folder) and check it exists. A dataset path that names nothing local and looks like
    no file is a hub id, left as it is."""
    tasks = [("task", config.task)] if config.adapters is None else [
        (f"adapters.{i}.task", entry.task) for i, entry in enumerate(config.adapters)]
    for field_name, task in tasks:
        if not isinstance(task, (JsonlTask, DatasetTask)):
            continue
        task_path = Path(task.path).expanduser()
        if not task_path.is_absolute():
            task_path = base / task_path
        if task_path.is_file() if isinstance(task, JsonlTask) else task_path.exists():
            task.path = str(task_path.resolve())
        elif isinstance(task, JsonlTask) or Path(task.path).suffix in LOCAL_DATA_SUFFIXES \
                or task.path.startswith((".", "/", "~")):
            raise ConfigError(f"{source}: {field_name}.path: file not found: {task.path}")


def dump_config(config: TrainConfig) -> str:
    """The config as JSON, written next to the run's outputs; `TrainConfig.model_validate` of it
    gives the same run (a fleet entry's `sampling` keeps only the fields it set)."""
    return json.dumps(config.model_dump(mode="json"), indent=2)
