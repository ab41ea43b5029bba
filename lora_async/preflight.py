"""Checks a run must pass before any model loads. Each failure is one line, and the CLI exits with code 2.

`lora-async train` runs them first, so a setting that cannot work fails in seconds. Without
them it would fail after a multi-minute model load with a traceback. The checks are:
- the model name names a model (nothing is built or downloaded);
- the experiment trackers `run.report_to` names are installed (their extras);
- placement: the devices and cores exist;
- Ray, for a `generator.type = "ray"` run (the `ray` extra);
- the installed vLLM release;
- `generator.quantization`;
- the learner's bitsandbytes quantisation, probed with one small tensor;
- each task's data: a dataset's splits and columns, reasoning-gym and its generators' settings
  (`tasks.check_task`; reading a local dataset takes a second, a hub dataset downloads once);
- the code sandbox, for a task that runs model-written code (tools marked `@sandboxed`, the
  `code_tests` reward) with `task.sandbox = "namespaces"`: one bwrap run of a no-op. Where
  namespaces are refused the run stops here; it never falls back to the weaker isolation.

None of them loads weights. vLLM is imported only to check a `generator.quantization` on a GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import UserError

if TYPE_CHECKING:
    from .config import TrainConfig
    from .placement import Placement


class PreflightError(UserError):
    """A run that cannot start as configured (one line, exit code 2)."""


def check_vllm(config: "TrainConfig", generator: "Placement") -> None:
    """The installed vLLM is the release the extension was checked against, and it can serve
    `generator.quantization` on the generator's device."""
    from .generator.vllm.compat import check_serving_quantization
    from .generator.vllm.release import VllmCompatError, check_vllm_version

    engine = config.engine_settings
    if engine is None:  # running servers: their vLLM is theirs
        return
    try:
        check_vllm_version()
        check_serving_quantization(engine.quantization, generator.device)
    except VllmCompatError as exc:
        raise PreflightError(str(exc)) from None


def check_ray(config: "TrainConfig") -> None:
    """A Ray run has Ray (the `ray` extra), importable."""
    if config.generator.engine_home != "ray":
        return
    from .generator.ray import RayError, require_ray

    try:
        require_ray()
    except RayError as exc:
        raise PreflightError(str(exc)) from None


def check_learner_quantization(config: "TrainConfig", rank0: "Placement") -> None:
    from .learner.frozen_base import QuantizationError, check_quantization

    try:
        check_quantization(config.model.quantization, rank0.device)
    except QuantizationError as exc:
        raise PreflightError(str(exc)) from None


def check_model(config: "TrainConfig") -> None:
    from .models import ModelNameError, check_model_name

    try:
        check_model_name(config.model.name)
    except ModelNameError as exc:
        raise PreflightError(str(exc)) from None


def check_tasks(config: "TrainConfig") -> None:
    from .tasks import TaskDataError, check_task

    for spec in config.adapter_specs:
        try:
            check_task(spec.task, spec.task_path)
        except TaskDataError as exc:
            raise PreflightError(str(exc)) from None


def runs_code(task: object) -> bool:
    """Whether a task runs model-written code: the code_tests reward, or a tool marked `@sandboxed`."""
    from .config import EnvTask
    from .sandbox import is_sandboxed

    reward_list = getattr(task, "reward_list", None)
    if reward_list is not None and "code_tests" in reward_list():
        return True
    if not isinstance(task, EnvTask):
        return False
    from .envs.source import env_tools

    return any(is_sandboxed(tool) for tool in env_tools(task.env))


def check_sandbox(config: "TrainConfig") -> None:
    """The namespaces work here, for every task that runs code under them."""
    from .sandbox import SandboxUnavailable, cage

    for spec in config.adapter_specs:
        if getattr(spec.task, "sandbox", None) == "namespaces" and runs_code(spec.task):
            try:
                cage()
            except SandboxUnavailable as exc:
                raise PreflightError(str(exc)) from None


def check_trackers(config: "TrainConfig") -> None:
    """Each tracker `run.report_to` names is installed (found, not imported: seconds saved)."""
    from .trackers import check_installed

    check_installed(config.run.report_to)


def preflight(config: "TrainConfig") -> None:
    """Every check that needs no model: raises PreflightError on the first that fails."""
    from .placement import PlacementError, place_run

    check_model(config)
    check_trackers(config)
    try:
        generator, ranks = place_run(config)
    except PlacementError as exc:
        raise PreflightError(str(exc)) from None
    check_ray(config)
    check_vllm(config, generator)
    check_learner_quantization(config, ranks[0])
    check_tasks(config)
    check_sandbox(config)
