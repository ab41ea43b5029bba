"""The builtin rewards, by name: `exact`, `numeric` and `regex:<pattern>`. They only compare a
completion with the answer (or a pattern), so they run in-process: no worker, no wait.
(`code_tests` runs programs, so it runs in the reward pool like a user function: `code.py`.)"""

from __future__ import annotations

import math
import re
from typing import Callable

NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


def final_number(text: str) -> float | None:
    """The last number in the text, or None."""
    found = NUMBER_RE.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


def numeric_reward(completion: str, answer: str) -> float:
    got = final_number(completion)
    want = final_number(answer)
    return float(got is not None and want is not None and math.isclose(got, want, abs_tol=1e-9))


def exact_reward(completion: str, answer: str) -> float:
    return float(completion.strip() == answer.strip())


def regex_reward(pattern: str) -> Callable[[str, str], float]:
    compiled = re.compile(pattern)
    return lambda completion, answer: float(compiled.search(completion) is not None)


def builtin_reward(spec: str) -> Callable[[str, str], float] | None:
    """The builtin a spec names, or None (a user `module:function`)."""
    if spec == "exact":
        return exact_reward
    if spec == "numeric":
        return numeric_reward
    if spec.startswith("regex:"):
        return regex_reward(spec[len("regex:"):])
    return None
