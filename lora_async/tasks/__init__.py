"""Tasks: where prompts come from and how completions are scored.

A single-turn task is a problem set (`problems.Task`): training problems by index
(deterministic for a seed, so a resumed run continues exactly where it stopped), a fixed
held-out split for evaluation, and its rewards (`rewards.Rewards`). `make_source` wraps an
adapter's task, of either kind (a problem set, or an environment from `envs`), in the one
contract the orchestrator and `evaluate` use (`rollout.RolloutSource`).
"""

from __future__ import annotations

from ..config import (AdapterSpec, ArithmeticTask, DatasetTask, EnvTask, JsonlTask, ProblemTask,
                      ReasoningGymTask, TrainConfig, auto_workers)
from ..rewards import RewardError
from ..rollout import RolloutSource
from .problems import Problem, RewardStats, Task, TaskDataError, render_prompt

__all__ = ["Problem", "RewardStats", "Task", "TaskDataError", "check_task", "make_source", "make_task",
           "render_prompt", "RewardError"]


def make_task(config: ProblemTask | EnvTask, seed: int, in_flight: int = 1, where: str = "task") -> Task:
    """The problem set of a single-turn `[task]` table; `in_flight` completions at once size its
    reward pools unless `reward_workers` says. Errors name the table `where` ("adapters.2.task")."""
    match config:
        case ArithmeticTask():
            from .arithmetic import ArithmeticProblems

            return ArithmeticProblems(config, seed)
        case JsonlTask():
            from .jsonl import JsonlProblems

            return JsonlProblems(config, seed, auto_workers(config.reward_workers, in_flight))
        case DatasetTask():
            from .dataset import DatasetProblems

            return DatasetProblems(config, seed, auto_workers(config.reward_workers, in_flight), where)
        case ReasoningGymTask():
            from .reasoning_gym import ReasoningGymProblems

            return ReasoningGymProblems(config, seed, where)
        case EnvTask():
            raise ValueError(f"an environment task ({config.env}) has no problem set; use make_source")
    raise TypeError(f"no task for {type(config).__name__}")


def check_task(config: ProblemTask | EnvTask, where: str) -> None:
    """What can be checked of a task's data before any model loads: the extra it needs is
    installed, its dataset has the configured splits and columns, its generators take their
    settings. Raises `TaskDataError`, one line naming the field (`where` is the table:
    "task", "adapters.2.task")."""
    match config:
        case DatasetTask():
            from .dataset import check_dataset

            check_dataset(config, where)
        case ReasoningGymTask():
            from .reasoning_gym import check_reasoning_gym

            check_reasoning_gym(config, where)
        case ArithmeticTask() | JsonlTask() | EnvTask():
            pass  # nothing to check before the run: generated, or read (and checked) when the task is made


def make_source(spec: AdapterSpec, config: TrainConfig, seed: int) -> RolloutSource:
    """The rollout source of one adapter: its task with the adapter's sampling, eval length and
    (environments) episode settings. Errors name the task's table (`spec.task_path`).

    Rewards and tools keep as many calls going as completions or episodes can be in flight:
    `generator.groups_in_flight` groups of `samples_per_prompt` (unless the task says)."""
    in_flight = config.generator.groups_in_flight * spec.sampling.samples_per_prompt
    task = spec.task
    match task:
        case EnvTask():
            from ..envs.episode import EpisodeSettings
            from ..envs.games import GameSource, is_game_task
            from ..envs.source import EnvSource

            where = f"{spec.task_path}.env"
            source = GameSource if is_game_task(task, where) else EnvSource
            return source(task, seed, where, spec.name, EpisodeSettings.for_adapter(config, spec),
                          EpisodeSettings.for_adapter(config, spec, greedy=True), spec.sampling.samples_per_prompt,
                          in_flight)
        case _:
            from .source import SingleTurnSource

            return SingleTurnSource(make_task(task, seed, in_flight, spec.task_path), spec.name, spec.sampling,
                                    spec.eval_max_tokens)
