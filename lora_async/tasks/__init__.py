"""Tasks: where prompts come from and how completions are scored.

A task yields training problems by index (deterministic for a seed, so a resumed run continues
exactly where it stopped), a fixed held-out split for evaluation, and a reward function.
"""

from __future__ import annotations

from ..config import ArithmeticTask, JsonlTask
from .base import Problem, RewardStats, Task, render_prompt
from .rewards import RewardError

__all__ = ["Problem", "RewardStats", "Task", "make_task", "render_prompt", "RewardError"]


def make_task(config: ArithmeticTask | JsonlTask, seed: int) -> Task:
    if isinstance(config, ArithmeticTask):
        from .arithmetic import ArithmeticProblems

        return ArithmeticProblems(config, seed)
    from .jsonl import JsonlProblems

    return JsonlProblems(config, seed)
