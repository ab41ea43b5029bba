"""The Python API: `train` runs what `lora-async train` runs, in this process, and returns the summary.

    from lora_async import load_config, train

    summary = train(load_config("examples/arithmetic.toml", overrides={"run.max_steps": 2}))
    summary = train("examples/arithmetic.toml", resume=True)       # continue it from its checkpoint

The steps are the CLI's, in its order: the config's task files resolved, the preflight (devices,
vLLM, the task's data), the memory plan's gate, then the run. Each failure is the exception the
CLI turns into its exit code (`exit_code`): a `UserError` (`ConfigError`, `PreflightError`,
`PlanRefused`, `TaskDataError`, ...) for bad input a user can fix (2), a `RunError`
(`TrainingError` and the like) for a run that failed (1).

Ctrl-C stops after the current step with a checkpoint, as in the CLI, and `train` returns the
summary (`summary["ended"] == "requested"`); a second Ctrl-C aborts at once (KeyboardInterrupt).
In a notebook, whose event loop is already running in this thread, the run gets a thread of its
own; this thread waits for it and passes Ctrl-C on (`orchestrator.StopSwitch`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .config import TrainConfig, load_config
from .config.load import Overrides, resolve_task_paths, with_overrides
from .errors import RunError, TrainingError, UserError

if TYPE_CHECKING:
    from .orchestrator import StopSwitch

__all__ = ["exit_code", "load_config", "prepare", "run", "train", "warn"]

WAIT_POLL_S = 0.1  # how often the caller of a run in its own thread looks whether it ended
API_PLAN_HINT = "`lora-async plan` shows the table; train(..., force=True) starts anyway"


def train(config: TrainConfig | str | os.PathLike[str], *, overrides: Overrides = (), resume: bool = False,
          force: bool = False) -> dict[str, Any]:
    """Train as `lora-async train` does; returns the run's summary (also in OUT/summary.json).

    `config` is a `TrainConfig` (from `load_config`, or built in code) or a TOML path;
    `overrides` sets dotted keys (`{"run.max_steps": 2}`, as `--set`); `resume` continues the run
    in `run.output_dir` from its checkpoint; `force` starts a run the memory plan says will not fit.
    Relative task files of a config built in code are relative to the working directory."""
    if isinstance(config, TrainConfig):
        cfg = with_overrides(config, overrides) if overrides else config
        resolve_task_paths(cfg, Path.cwd(), "<TrainConfig>")
    else:
        cfg = load_config(config, overrides)
    prepare(cfg, force, warn=warn, hint=API_PLAN_HINT, forced_by="force=True")
    return run(cfg, resume)


def prepare(cfg: TrainConfig, force: bool, warn: Callable[[str], None], hint: str, forced_by: str = "--force") -> None:
    """Everything before a model loads: library chatter hidden, the preflight, the memory gate."""
    from .quiet import quiet_start

    quiet_start(cfg.run.engine_log)  # before the preflight imports torch: some settings are read at its import
    from .plan.gate import memory_gate
    from .preflight import preflight

    preflight(cfg)  # devices this machine lacks, another vLLM, the task's data: seconds, no model
    memory_gate(cfg, force, warn, hint, forced_by)  # `lora-async plan`'s check, still before anything loads


def run(cfg: TrainConfig, resume: bool = False) -> dict[str, Any]:
    """The run itself, to its end; raises `TrainingError` when it failed (after its summary and a
    checkpoint of what was learned are written)."""
    from .orchestrator import StopSwitch, train as run_train

    stop = StopSwitch()

    def body() -> dict[str, Any]:
        return asyncio.run(run_train(cfg, resume=resume, stop=stop))

    # Without a running loop here, signals reach the run's loop directly (the main thread), as in the CLI.
    summary = _in_own_thread(body, stop) if _loop_running() else body()
    if "error" in summary:
        raise TrainingError(summary["error"])
    return summary


def exit_code(exc: BaseException) -> int | None:
    """The CLI's exit code for an error `train` raised: 2 for bad input a user can fix
    (`UserError`), 1 for a run that failed (`RunError`), 130 for Ctrl-C; None for a bug (shown
    with its traceback)."""
    if isinstance(exc, KeyboardInterrupt):
        return 130
    if isinstance(exc, UserError):
        return 2
    if isinstance(exc, RunError):
        return 1
    return None


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _in_own_thread(body: Callable[[], dict[str, Any]], stop: StopSwitch) -> dict[str, Any]:
    """Run `body` in a thread of its own; Ctrl-C in this thread pulls `stop` (each one: the first
    stops after the step, a second aborts). Its result or exception comes back here."""
    result: dict[str, Any] = {}
    failure: list[BaseException] = []
    done = threading.Event()

    def target() -> None:
        try:
            result.update(body())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            failure.append(exc)
        finally:
            done.set()

    worker = threading.Thread(target=target, name="lora-async-run")
    worker.start()
    # While it runs, Ctrl-C is a KeyboardInterrupt here whatever the caller had installed
    # (asyncio.run's own handler would cancel the caller's task instead).
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler) if main else None
    try:
        while not done.is_set():
            # A short sleep, not `join()`: Ctrl-C inside `Thread.join` can leave the thread looking
            # finished while it runs (CPython 3.11); a sleep is interrupted cleanly.
            try:
                time.sleep(WAIT_POLL_S)
            except KeyboardInterrupt:
                stop.request()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    worker.join()
    if failure:
        raise failure[0]
    return result


def warn(line: str) -> None:
    """A warning line on stderr (the CLI's too)."""
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True).print(f"[yellow]warning:[/] {escape(line)}", highlight=False, soft_wrap=True)
