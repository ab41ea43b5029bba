"""Errors shown to a user as one line, and the two kinds they come in.

- `UserError`: something the user can fix and run again (a config, task data, a reward
  specification, a placement this machine cannot give); the CLI exits with code 2.
- `RunError`: a run that failed once it started (a dead engine, a failing transport, a model
  that cannot be built); the CLI exits with code 1. `TrainingError` is the run's own.

Every error of the package that the CLI reports in one line subclasses one of them
(`api.exit_code`); anything else is a bug, shown with its traceback. `error_line` cuts another
library's exception to its first line.
"""

from __future__ import annotations

ERROR_CHARS = 300  # a line a terminal shows whole


class UserError(Exception):
    """Bad input a user can fix: a config, task data, a reward specification (exit code 2)."""


class RunError(RuntimeError):
    """A run that failed (exit code 1); the message says why."""


class TrainingError(RunError):
    """A run that cannot continue (engine died, rewards never work, a learner rank died); the
    message says why."""


def error_line(exc: BaseException, with_type: bool = True) -> str:
    """`Type: the first non-blank line of the message` (a multi-line message gets " ..."),
    at most ERROR_CHARS characters."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] + (" ..." if len(lines) > 1 else "") if lines else ""
    if with_type:
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS - 3] + "..."
