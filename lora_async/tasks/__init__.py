"""Tasks: where prompts come from and how completions are scored.

A task yields training problems by index (deterministic for a seed, so a resumed run continues
exactly where it stopped), a fixed held-out split for evaluation, and a reward function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

from ..config import ArithmeticTask, EnvTask, JsonlTask
from .problems import Problem, RewardStats, Task, render_prompt
from .rewards import RewardError

__all__ = ["Problem", "RewardStats", "Task", "make_task", "render_prompt", "RewardError"]


if TYPE_CHECKING:
    from ..envs.source import EnvSource


def make_task(config: ArithmeticTask | JsonlTask | EnvTask, seed: int,
              where: str = "task") -> Union[Task, "EnvSource"]:
    """The task a `[task]` table describes; `where` names the table in errors."""
    if isinstance(config, EnvTask):
        from ..envs.source import EnvSource

        return EnvSource(config, seed, f"{where}.env")
    if isinstance(config, ArithmeticTask):
        from .arithmetic import ArithmeticProblems

        return ArithmeticProblems(config, seed)
    from .jsonl import JsonlProblems

    return JsonlProblems(config, seed)
