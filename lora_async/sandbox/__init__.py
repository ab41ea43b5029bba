"""Model-written Python, run where it can do no harm: `run_python(code, tests=..., limits=...)`.

    limits.py      SandboxLimits (what a run may use), SandboxResult (how it ended), TestReport
    runner.py      run_python: a fresh interpreter per run, under namespaces or as a plain process;
                   cage(): the cage, probed once with a no-op
    namespaces.py  the bwrap cage's layout (user, PID, net, IPC, UTS, cgroup namespaces)
    prelude.py     the interpreter's first code: the rlimits, the audit hook, the tests' harness

Tools that run model-written code say so with `@sandboxed`: a run whose tools are marked (or
that uses the `code_tests` reward) probes the namespaces before any model loads.
Kept free of torch imports: it runs inside tool and reward workers.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from .limits import CUT_MARKER, KB, MB, SandboxLimits, SandboxResult, TestReport
from .namespaces import SETTING, Cage, SandboxUnavailable
from .runner import ISOLATION_ENV, ISOLATIONS, Isolation, InvalidTests, cage, resolve_isolation, run_python

F = TypeVar("F", bound=Callable[..., Any])
MARK = "__lora_async_sandboxed__"


def sandboxed(tool: F) -> F:
    """Mark a tool that runs model-written code: the run then probes the sandbox at start-up."""
    setattr(tool, MARK, True)
    return tool


def is_sandboxed(tool: object) -> bool:
    return bool(getattr(tool, MARK, False))


def describe(isolation: str) -> str:
    """The start line's words for an isolation (probing the namespaces, if that is the one)."""
    if isolation == "namespaces":
        return cage().describe()
    return f"a process with rlimits and an audit hook, no namespaces ({SETTING})"


__all__ = ["CUT_MARKER", "ISOLATIONS", "ISOLATION_ENV", "KB", "MB", "SETTING", "Cage", "Isolation", "SandboxLimits",
           "SandboxResult", "SandboxUnavailable", "TestReport", "InvalidTests", "cage", "describe", "is_sandboxed",
           "resolve_isolation", "run_python", "sandboxed"]
