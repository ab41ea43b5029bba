"""The `code_tests` reward: a completion's last fenced Python block, run against the record's tests.

`reward = "code_tests"` scores each completion with the fraction of the record's `tests` column
that its program passes, run in the sandbox (`lora_async.sandbox.run_python`: namespaces by
default, as `task.sandbox` says). The column holds assert statements (`"assert add(2, 3) == 5"`;
they run after the program, in its namespace) or input/output cases (`{"input": "2 3\\n",
"output": "5"}`; the program runs once per case with that stdin). A completion without a
fenced block scores 0; so does one whose record has no tests (an error, counted and shown).

It runs as a per-sample function in the reward pool (`GuardedPool` workers), so a group's
completions run at once, each in its own sandbox.
"""

from __future__ import annotations

import re
from typing import Any

from ..sandbox import SandboxLimits, run_python

SPEC = "lora_async.rewards.code:code_tests"
FENCE_RE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
# A short function's tests take milliseconds; the wall limit stays under reward_timeout_s (5 s).
LIMITS = SandboxLimits(cpu_s=2, wall_s=4.0)


def last_python_block(completion: str) -> str | None:
    """The last fenced code block (```python, ```py or a bare ```), or None. An unclosed last
    fence (a completion cut at its token limit) still counts, up to the end."""
    blocks = FENCE_RE.findall(completion)
    return blocks[-1] if blocks else None


def code_tests(completion: Any, tests: Any = None, **_: Any) -> float:
    """The fraction of `tests` the completion's last Python block passes."""
    if tests is None:
        raise ValueError("code_tests needs a `tests` column in the record (assert statements or input/output cases)")
    text = completion if isinstance(completion, str) else str(completion)
    code = last_python_block(text)
    if code is None:
        return 0.0
    result = run_python(code, tests=tests, limits=LIMITS)
    assert result.tests is not None
    return result.tests.fraction
