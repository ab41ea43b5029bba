"""The calculator environment with its tool run in the code sandbox, for tests/test_env_train.py:
the scripted tool-caller model's `calculate("6*7")` becomes a program, `print(6*7)`, run under
the run's `task.sandbox`. Module-level, so the tool's worker process imports it."""

from __future__ import annotations

from lora_async.envs.builtin.calculator import Multiply, draw
from lora_async.sandbox import run_python, sandboxed


@sandboxed
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: digits and + - * / ( ), e.g. "12 * (3 + 4)"
    """
    result = run_python(f"print({expression})")
    if not result.ok:
        raise RuntimeError(result.text())
    return f"{result.stdout.strip()} ({result.isolation})"


class SandboxedMultiply(Multiply):
    tools = [calculate]


def make(index: int, split: str) -> Multiply:
    return draw(SandboxedMultiply, "calculator", index, split)
