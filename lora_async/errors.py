"""Errors shown to a user as one line: another library's exception, cut to its first line."""

from __future__ import annotations

ERROR_CHARS = 300  # a line a terminal shows whole


def error_line(exc: BaseException, with_type: bool = True) -> str:
    """`Type: the first non-blank line of the message` (a multi-line message gets " ..."),
    at most ERROR_CHARS characters."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] + (" ..." if len(lines) > 1 else "") if lines else ""
    if with_type:
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS - 3] + "..."
