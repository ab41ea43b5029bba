"""The configuration reference (docs/configuration.md), generated from the pydantic schema.

`python -m lora_async.config.reference > docs/configuration.md` (`make docs`) writes it, and a
test checks that the committed file is current. Every table of the config tree gets a section
(each member of a tagged union its own), and every field a row: dotted name, type, default,
bounds and description, as the schema gives them. A table met twice (a fleet entry's `lora`,
`sampling` and `task`) is described once and linked to.
"""

from __future__ import annotations

import json
import re
import types
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from .backends import ENGINE_HOME_TEXT
from .load import _tags, _unwrap
from .train import TrainConfig

COMMAND = "python -m lora_async.config.reference > docs/configuration.md"
HEADER = f"""# Configuration reference

<!-- Generated from the config schema by `make docs` ({COMMAND}); do not edit. -->

Every table and key a run's TOML file may hold, generated from the schema that validates it:
the dotted name, its type, its default, its bounds and what it does. An unknown key or a value
out of bounds is an error that names the dotted key (exit code 2). How to write a config, and
the rules that join several tables: [config.md](config.md). A key left out takes its default;
"unset" means the key is left out (TOML has no null).
"""


def anchor(heading: str) -> str:
    """The anchor GitHub gives a markdown heading: lower case, markup and punctuation dropped,
    spaces as hyphens (a repeated heading gets -1, -2, ... added by the caller)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"[*`]", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@dataclass(frozen=True)
class Row:
    """One field: the cells of its row."""

    key: str
    type: str
    default: str
    bounds: str
    description: str


@dataclass
class Table:
    """One section of the reference: a heading, lines of text, and a row per field."""

    heading: str
    level: int
    intro: list[str]
    rows: list[Row] = field(default_factory=list)


@dataclass
class Pending:
    """A table found while describing its parent, described after the parent's siblings."""

    key: str
    heading: str
    annotation: Any  # a model class, or a tagged union of them
    discriminator: str | None
    description: str
    default: Any


class Reference:
    """Walks the schema breadth first, so a table shared by several parents is described under
    the first dotted key that reaches it (`lora`, before `adapters.N.lora`)."""

    def __init__(self) -> None:
        self.tables: list[Table] = []
        self.links: dict[Any, str] = {}  # a model class or union -> "[heading](#anchor)"
        self.queue: deque[Pending] = deque()

    def build(self) -> list[Table]:
        top = Table("Top level", 2, ["The tables of a config file, each described below."])
        self.tables.append(top)
        top.rows.extend(self.row(name, info) for name, info in TrainConfig.model_fields.items())
        while self.queue:
            self.describe(self.queue.popleft())
        return self.tables

    def link(self, heading: str) -> str:
        return f"[{heading}](#{anchor(heading)})"

    # ---- rows

    def row(self, key: str, info: FieldInfo) -> Row:
        core, discriminator = _unwrap(info.annotation)
        if isinstance(info.discriminator, str):
            discriminator = info.discriminator
        default = default_of(info)
        table_type = self.table_type(key, core, discriminator, info, default)
        if table_type is not None:
            return Row(key, table_type, table_default(default, discriminator), "", info.description or "")
        return Row(key, type_text(core), value_text(default), bounds_text(info), info.description or "")

    def table_type(self, key: str, core: Any, discriminator: str | None, info: FieldInfo,
                   default: Any) -> str | None:
        """The type cell of a field that is a table (its section queued), else None."""
        if is_model(core) or (is_union(core) and discriminator):
            return f"table: {self.reach(key, core, discriminator, info, default)}"
        args = get_args(core)
        if get_origin(core) is list and args and is_model(args[0]):
            return f"array of tables: {self.reach(f'{key}.N', args[0], None, info, None, array=True)}"
        if get_origin(core) is dict and len(args) == 2 and is_model(args[1]):
            return f"tables by name: {self.reach(f'{key}.NAME', args[1], None, info, None)}"
        return None

    def reach(self, key: str, annotation: Any, discriminator: str | None, info: FieldInfo, default: Any,
              array: bool = False) -> str:
        if annotation not in self.links:
            heading = f"[[{key.removesuffix('.N')}]]" if array else f"[{key}]"
            self.links[annotation] = self.link(heading)
            self.queue.append(Pending(key, heading, annotation, discriminator, info.description or "", default))
        return self.links[annotation]

    # ---- sections

    def describe(self, pending: Pending) -> None:
        if pending.discriminator is None:
            self.model_table(pending.key, pending.annotation, pending.heading, 2, [pending.description])
        else:
            self.union_tables(pending, pending.discriminator)

    def union_tables(self, pending: Pending, discriminator: str) -> None:
        tags = _tags(pending.annotation, discriminator)
        chosen = getattr(pending.default, discriminator, None)
        left_out = f'`{discriminator} = "{chosen}"`' if chosen else "as the description above says"
        members = ", ".join(self.link(member_heading(pending.key, discriminator, tag)) for tag in tags)
        intro = [pending.description, f"One table, chosen by `{discriminator}`: {members}. Left out: {left_out}."]
        self.tables.append(Table(pending.heading, 2, intro))
        for tag, member in tags.items():
            text = [first_line(member)]
            needs = getattr(member, "needs", None)
            if isinstance(needs, str) and needs in ENGINE_HOME_TEXT:
                text.append(f"Works with {ENGINE_HOME_TEXT[needs]}.")
            self.model_table(pending.key, member, member_heading(pending.key, discriminator, tag), 3, text)

    def model_table(self, key: str, model: type[BaseModel], heading: str, level: int, intro: list[str]) -> None:
        own = first_line(model)
        text = [line for line in intro if line and not own.startswith(line.rstrip("."))] + ([own] if own else [])
        if model.model_config.get("extra") == "allow":
            text.append("Other keys are allowed here, and passed on as they are.")
        table = Table(heading, level, text)
        self.tables.append(table)
        table.rows.extend(self.row(f"{key}.{name}", info) for name, info in model.model_fields.items())


def member_heading(key: str, discriminator: str, tag: str) -> str:
    return f'[{key}] {discriminator} = "{tag}"'


def is_model(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, BaseModel)


def is_union(value: Any) -> bool:
    return get_origin(value) in (Union, types.UnionType)


def first_line(model: type[BaseModel]) -> str:
    """The model's own docstring (not its base's), first paragraph on one line."""
    doc = model.__dict__.get("__doc__") or ""
    return " ".join(doc.strip().split("\n\n")[0].split())


def default_of(info: FieldInfo) -> Any:
    if info.default is not PydanticUndefined:
        return info.default
    if info.default_factory is not None:
        return info.get_default(call_default_factory=True, validated_data={})
    return PydanticUndefined


# ---- cells


def type_text(annotation: Any) -> str:
    core, _ = _unwrap(annotation)
    if get_origin(core) is Literal:
        return " | ".join(json.dumps(arg) for arg in get_args(core))
    if is_union(core):
        return " | ".join(type_text(arg) for arg in get_args(core) if arg is not type(None))
    if get_origin(core) is list:
        return f"list[{type_text(get_args(core)[0])}]"
    if get_origin(core) is dict:
        key, value = get_args(core)
        return f"table of {type_text(key)} -> {type_text(value)}"
    return getattr(core, "__name__", str(core))


def value_text(value: Any) -> str:
    """A default as it would be written in TOML."""
    if value is PydanticUndefined:
        return "required"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (str, list)):
        return json.dumps(value, ensure_ascii=False)
    return repr(value)


def table_default(value: Any, discriminator: str | None) -> str:
    if value is PydanticUndefined:
        return "required"
    if value is None:
        return "unset"
    if discriminator and isinstance(value, BaseModel):
        return f'{discriminator} = "{getattr(value, discriminator)}"'
    return "its defaults"


BOUNDS = ((annotated_types.Ge, "ge", ">="), (annotated_types.Gt, "gt", ">"), (annotated_types.Le, "le", "<="),
          (annotated_types.Lt, "lt", "<"), (annotated_types.MultipleOf, "multiple_of", "multiple of"),
          (annotated_types.MinLen, "min_length", "at least"), (annotated_types.MaxLen, "max_length", "at most"))


def bounds_text(info: FieldInfo) -> str:
    parts = []
    for meta in info.metadata:
        for kind, attribute, text in BOUNDS:
            if isinstance(meta, kind):
                value = getattr(meta, attribute)
                unit = ""
                if kind in (annotated_types.MinLen, annotated_types.MaxLen):  # a string's length, or a list's
                    unit = (" character" if info.annotation is str else " item") + ("" if value == 1 else "s")
                parts.append(f"{text} {value:g}{unit}" if isinstance(value, float) else f"{text} {value}{unit}")
        if getattr(meta, "pattern", None):
            parts.append(f"matches `{meta.pattern}`")
    return ", ".join(parts)


# ---- the page


MARKUP = re.compile(r"([\\*<>\[\]])")  # characters GitHub would read as markup in prose


def cell(text: str, code: bool = False) -> str:
    """A table cell: one code span, or prose whose markup characters outside code spans are
    escaped (a description's `<tag>` or `A * log pi` shows as written)."""
    if code:
        text = f"`{text}`" if text else ""
    else:
        parts = text.split("`")
        parts[::2] = [MARKUP.sub(r"\\\1", part) for part in parts[::2]]
        text = "`".join(parts)
    return text.replace("|", "\\|")


def render() -> str:
    """docs/configuration.md, as the schema gives it now."""
    lines = [HEADER]
    for table in Reference().build():
        lines += [f"{'#' * table.level} {table.heading}", "", *[f"{line}\n" for line in table.intro]]
        if table.rows:
            lines += ["| key | type | default | bounds | description |", "|---|---|---|---|---|"]
            lines += [f"| {cell(row.key, True)} | {cell(row.type, not row.type.startswith(('table', 'array')))} | "
                      f"{cell(row.default, row.default not in ('required', 'unset', 'its defaults'))} | "
                      f"{cell(row.bounds)} | {cell(row.description)} |" for row in table.rows]
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    print(render(), end="")


if __name__ == "__main__":
    main()
