"""The documentation cannot rot: README.md and docs/*.md are checked against the code.

- Every ```toml block validates against the config schema, read as `lora-async train` reads a
  file: merged into the defaults. A block right after `<!-- invalid -->` (or
  `<!-- invalid: TEXT -->`) shows a mistake: it must be refused (with TEXT in the error).
- Every `lora-async ...` command in a bash, sh or console block parses against the real CLI:
  the click tree is walked and each level parsed, nothing runs. A `lora-async ...` in inline
  code must name real commands and options (its placeholders may leave arguments out).
- Every relative link resolves to a file, and a `#anchor` to a heading of it; a repository
  path in inline code (`examples/x.toml`) exists.
- docs/configuration.md is what the schema generates now.

The checkers return the problems they find; the last tests feed them broken text, so a checker
that finds nothing cannot pass unnoticed.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer

from lora_async.cli.app import app
from lora_async.config import ConfigError, load_config
from lora_async.config.load import LOCAL_DATA_SUFFIXES
from lora_async.config.reference import COMMAND, anchor, render

from .conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELLS = ("bash", "sh", "shell", "console")
REPO_PATH = re.compile(r"(examples|bench|tests|lora_async|docs)/[\w./-]*")  # a path in inline code
SHELL_STOPS = {"|", "||", "&&", ";", "&", ">", ">>", "2>", "<"}


@dataclass(frozen=True)
class Block:
    """A fenced code block, with the HTML comment right before it (its marker), if any."""

    page: Path
    line: int
    lang: str
    body: str
    marker: str | None

    @property
    def where(self) -> str:
        return f"{label(self.page)}:{self.line}"


def label(page: Path) -> str:
    return str(page.relative_to(REPO)) if page.is_relative_to(REPO) else str(page)


def split_page(page: Path) -> tuple[list[Block], str]:
    """The page's fenced code blocks, and its prose (every line outside them)."""
    lines = page.read_text().splitlines()
    blocks, prose, i = [], [], 0
    while i < len(lines):
        fence = re.match(r"^\s*(`{3,})\s*([\w+-]*)", lines[i])
        if not fence:
            prose.append(lines[i])
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence.group(1))), len(lines))
        before = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
        marker = re.fullmatch(r"<!--\s*(.*?)\s*-->", before)
        blocks.append(Block(page, i + 1, fence.group(2).lower(), "\n".join(lines[i + 1:end]),
                            marker.group(1) if marker else None))
        prose.append("")
        i = end + 1
    return blocks, "\n".join(prose)


def all_blocks(lang: tuple[str, ...]) -> list[Block]:
    return [block for page in PAGES for block in split_page(page)[0] if block.lang in lang]


# ---------------------------------------------------------------- TOML blocks


def toml_problem(block: Block, folder: Path) -> str | None:
    """Load the block as a config file (task data files it names are stubbed beside it); None
    when it does what it shows: loads, or, after an `invalid` marker, is refused."""
    for data in re.findall(r'^\s*path\s*=\s*"([^"]+)"', block.body, re.M):
        if Path(data).suffix in LOCAL_DATA_SUFFIXES and not Path(data).is_absolute():
            (folder / data).parent.mkdir(parents=True, exist_ok=True)
            (folder / data).write_text('{"prompt": "p", "answer": "a"}\n')
    file = folder / "block.toml"
    file.write_text(block.body)
    try:
        load_config(file)
        error = None
    except ConfigError as exc:
        error = str(exc)
    marker = block.marker or ""
    if not marker.startswith("invalid"):
        return f"{block.where}: a config block that does not load: {error}" if error else None
    expected = marker.removeprefix("invalid").lstrip(":").strip()
    if error is None:
        return f"{block.where}: marked invalid, but it loads"
    if expected not in error:
        return f"{block.where}: refused, but not with {expected!r}: {error}"
    return None


@pytest.mark.parametrize("block", all_blocks(("toml",)), ids=lambda block: block.where)
def test_every_toml_block_is_a_config(block, tmp_path):
    assert toml_problem(block, tmp_path) is None, toml_problem(block, tmp_path)


# ---------------------------------------------------------------- commands


class MissingCommand(Exception):
    """A group named without one of its commands."""


LEFT_OUT = ("MissingParameter", "NoArgsIsHelpError", "MissingCommand")  # what inline mentions may leave out


def parse_command(argv: list[str]) -> None:
    """Parse `lora-async ARGV` as the CLI would, level by level, without running anything;
    raises what the CLI's parser raises. (A group's own options, only --help here, are parsed
    where they come before its command.)"""
    command: Any = typer.main.get_command(app)
    name, parent = "lora-async", None
    while isinstance(command, typer.core.TyperGroup):
        if not argv or argv[0].startswith("-"):
            command.make_context(name, list(argv), parent=parent)
            raise MissingCommand(f"missing command (one of: {', '.join(command.commands)})")
        ctx = command.make_context(name, [], parent=parent, resilient_parsing=True)
        sub = command.get_command(ctx, argv[0])
        if sub is None:
            raise ValueError(f"no such command {argv[0]!r} (one of: {', '.join(command.commands)})")
        name, command, argv, parent = argv[0], sub, argv[1:], ctx
    command.make_context(name, list(argv), parent=parent)


def command_problem(argv: list[str], where: str, strict: bool = True) -> str | None:
    """What is wrong with `lora-async ARGV`, or None. Not strict: the arguments and the command
    a mention in prose leaves out are not missed (unknown commands and options still fail)."""
    try:
        parse_command(argv)
    except Exception as exc:
        if getattr(exc, "exit_code", None) == 0 or (not strict and type(exc).__name__ in LEFT_OUT):
            return None  # --help parses (and would print the help)
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        return f"{where}: lora-async {shlex.join(argv)}: {message}"
    return None


def shell_commands(block: Block) -> list[list[str]]:
    """The `lora-async` commands of a shell block, as argument lists (after `lora-async`)."""
    commands = []
    for line in block.body.replace("\\\n", " ").splitlines():
        line = line.strip()
        if block.lang == "console":
            if not line.startswith("$ "):
                continue  # output
            line = line[2:]
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
            words = words[1:]  # VAR=value before the command
        stop = next((i for i, word in enumerate(words) if word in SHELL_STOPS), len(words))
        words = words[:stop]
        if words and Path(words[0]).name == "lora-async":
            commands.append(words[1:])
        elif words[1:3] == ["-m", "lora_async"]:
            commands.append(words[3:])
    return commands


SHELL_BLOCKS = all_blocks(SHELLS)


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=lambda block: block.where)
def test_every_shown_command_parses(block):
    problems = [command_problem(argv, block.where) for argv in shell_commands(block)]
    assert not any(problems), "\n".join(filter(None, problems))


def test_the_docs_show_commands():
    assert sum(len(shell_commands(block)) for block in SHELL_BLOCKS) >= 10


def inline_commands(prose: str) -> list[list[str]]:
    return [shlex.split(span) for span in re.findall(r"`lora-async ([^`]*)`", prose)]


@pytest.mark.parametrize("page", PAGES, ids=label)
def test_every_inline_command_names_real_commands_and_options(page):
    prose = split_page(page)[1]
    problems = [command_problem(argv, label(page), strict=False) for argv in inline_commands(prose)]
    assert not any(problems), "\n".join(filter(None, problems))


# ---------------------------------------------------------------- links and paths


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings (a repeated one gets -1, -2, ...), and any
    `<a id=...>` of its own."""
    seen: dict[str, int] = {}
    found = set(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", page.read_text()))
    for line in split_page(page)[1].splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = anchor(heading.group(1))
            found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return found


def link_problems(page: Path) -> list[str]:
    prose = split_page(page)[1]
    spans = re.findall(r"`([^`\n]+)`", prose)
    text = re.sub(r"`[^`\n]+`", "", prose)
    where, problems = label(page), []
    for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
        if re.match(r"^[a-z][\w+.-]*:", target):
            continue  # http:, https:, mailto:
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"{where}: link to a missing file: {target}")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            problems.append(f"{where}: link to a missing heading: {target}")
    for span in spans:
        if REPO_PATH.fullmatch(span) and not (REPO / span).exists():
            problems.append(f"{where}: names a path that does not exist: {span}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=label)
def test_every_link_and_path_resolves(page):
    problems = link_problems(page)
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- the generated reference


def test_the_configuration_reference_is_current():
    if (REPO / "docs" / "configuration.md").read_text() != render():
        pytest.fail(f"docs/configuration.md is not what the config schema gives: run `make docs` ({COMMAND})")


def test_the_readme_is_what_a_newcomer_reads_first():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    assert "make demo" in text and "make test" in text


# ---------------------------------------------------------------- the checkers can fail


def test_the_checkers_find_a_broken_key_flag_link_and_path(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](#nowhere) [missing](missing.md) `examples/missing.toml`\n\n"
                    "```toml\n[lora]\nrnak = 8\n```\n\n<!-- invalid: lora.rank -->\n```toml\n[lora]\nrank = 0\n```\n\n"
                    "<!-- invalid -->\n```toml\n[lora]\nrank = 8\n```\n\n"
                    "```bash\nlora-async train x.toml --bogus\nlora-async trian x.toml\nlora-async plot\n```\n")
    page_blocks = split_page(page)[0]
    toml_blocks = [block for block in page_blocks if block.lang == "toml"]
    results = [toml_problem(block, tmp_path) for block in toml_blocks]
    assert results[0] is not None and "lora.rnak" in results[0]
    assert results[1] is None  # refused, naming the field the marker expects
    assert results[2] is not None and "marked invalid, but it loads" in results[2]
    commands = shell_commands(page_blocks[-1])
    assert [command_problem(argv, "x") is not None for argv in commands] == [True, True, True]
    assert command_problem(["plot"], "x", strict=False) is None  # inline: arguments may be left out
    assert command_problem(["bench"], "x", strict=False) is None
    assert command_problem(["plot", "--bogus"], "x", strict=False) is not None
    assert command_problem(["bench", "snyc"], "x", strict=False) is not None
    assert command_problem(["bench", "sync", "--transport", "all", "--json"], "x") is None
    problems = link_problems(page)
    assert len(problems) == 3 and "#nowhere" in problems[0] and "missing.md" in problems[1], problems
