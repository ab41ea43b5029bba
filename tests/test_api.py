"""The Python API: `from lora_async import train, load_config` runs what `lora-async train` runs.

Unit tier: overrides as a mapping, a config built in code, the errors and their exit codes, and
the stop switch a notebook's Ctrl-C pulls. Slow tier: two steps on the tiny model in-process,
resumed from inside a running event loop (a notebook), and a run interrupted by SIGINT to its
whole process group (as a terminal and Jupyter send it) that stops after a step with a
checkpoint and resumes.
"""

from __future__ import annotations

import asyncio
import json
import linecache
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import lora_async
from lora_async import ConfigError, TrainConfig, load_config, train
from lora_async.api import _in_own_thread, exit_code
from lora_async.config import JsonlTask
from lora_async.metrics import read_metrics
from lora_async.orchestrator import StopSwitch, TrainingError
from lora_async.preflight import PreflightError

from .helpers import RUN_TIMEOUT_S, wait_for, wait_for_async, wait_for_run
from .test_train import make_config


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # user reward modules and relative task files are found from here
    return tmp_path


# ---------------------------------------------------------------- unit tier


def test_the_package_exports_the_api() -> None:
    assert lora_async.train is train and lora_async.load_config is load_config
    assert {"train", "load_config", "TrainConfig", "ConfigError"} <= set(lora_async.__all__)


def test_overrides_as_a_mapping_set_dotted_keys_with_python_values(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[run]\nmax_steps = 50\n[learner]\nlr = 1e-4\n")
    cfg = load_config(path, overrides={"run.max_steps": 2, "sampling.temperature": 0.5, "buffer.mode": "sync"})
    assert (cfg.run.max_steps, cfg.sampling.temperature, cfg.buffer.mode, cfg.learner.lr) == (2, 0.5, "sync", 1e-4)
    # the --set form still works, and one string is one override (not its characters)
    assert load_config(path, overrides="run.max_steps=3").run.max_steps == 3
    assert load_config(path, overrides=["run.max_steps=4"]).run.max_steps == 4


@pytest.mark.parametrize("overrides, expected", [
    ({"run.max_stepz": 2}, "run.max_stepz: unknown key"),
    ({"run.max_steps": -1}, "run.max_steps: "),
    ({"run..x": 1}, "'run..x' is not a dotted key"),
    ({"run.max_steps.x": 1}, "run.max_steps is not a section"),
])
def test_a_bad_override_is_one_line_naming_it(tmp_path: Path, overrides: dict, expected: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[run]\nmax_steps = 5\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides=overrides)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_a_config_built_in_code_takes_overrides_and_resolves_task_files(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi", "answer": "1"}\n')
    cfg = TrainConfig(task=JsonlTask(path="p.jsonl"))
    from lora_async.config.load import resolve_task_paths, with_overrides

    changed = with_overrides(cfg, {"run.max_steps": 7})
    assert changed.run.max_steps == 7 and cfg.run.max_steps != 7  # a copy; the caller's config is left alone
    resolve_task_paths(changed, Path.cwd(), "<TrainConfig>")
    assert changed.task.path == str(tmp_path / "p.jsonl")  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match=r"task.path: file not found: missing.jsonl"):
        train(TrainConfig(task=JsonlTask(path="missing.jsonl")))
    with pytest.raises(ConfigError, match=r"run.max_steps: "):
        with_overrides(cfg, {"run.max_steps": 0})


@pytest.mark.parametrize("field, overrides", [
    ("reward", {"task.type": "jsonl", "task.path": "p.jsonl", "task.reward": "__main__:score"}),
    ("env", {"task.type": "env", "task.env": "__main__:make"}),
])
def test_a_function_defined_in_a_notebook_cell_is_refused_with_what_to_do(in_tmp, field: str, overrides: dict) -> None:
    (in_tmp / "p.jsonl").write_text('{"prompt": "hi", "answer": "1"}\n')
    with pytest.raises(ConfigError, match=rf"task.{field}: a function in __main__ .* put it in a .py file"):
        load_config(None, overrides=overrides)


def test_train_runs_the_cli_preflight_before_anything_loads(tmp_path: Path) -> None:
    cfg = load_config(None, overrides={"learner.device": "cuda:7", "run.output_dir": str(tmp_path / "out")})
    with pytest.raises(PreflightError, match="cuda:7") as info:
        train(cfg)
    assert exit_code(info.value) == 2
    assert not (tmp_path / "out").exists()  # nothing started


def test_exit_codes_match_the_cli() -> None:
    from lora_async.envs.source import EnvLoadError
    from lora_async.errors import RunError, UserError
    from lora_async.generator.ray.cluster import RayError
    from lora_async.generator.server.client import ServerError
    from lora_async.generator.types import GeneratorDead
    from lora_async.generator.vllm.release import VllmCompatError
    from lora_async.lag_cost import LagCostError
    from lora_async.models import ModelError
    from lora_async.placement import PlacementError
    from lora_async.plan.gate import PlanRefused
    from lora_async.sync.transports import TransportError
    from lora_async.tasks import RewardError, TaskDataError

    user_errors = (ConfigError, PreflightError, PlanRefused, TaskDataError, RewardError, LagCostError, PlacementError,
                   EnvLoadError)
    for error in user_errors:  # bad input a user can fix
        assert issubclass(error, UserError) and exit_code(error("x")) == 2, error
    for error in (TrainingError, ModelError, TransportError, GeneratorDead, ServerError, VllmCompatError, RayError):  # a run that failed
        assert issubclass(error, RunError) and exit_code(error("x")) == 1, error
    assert exit_code(KeyboardInterrupt()) == 130
    assert exit_code(RuntimeError("a bug")) is None  # shown with its traceback
    assert exit_code(ValueError("a bug")) is None


def test_a_stop_requested_before_the_run_starts_waits_for_it() -> None:
    calls: list[str] = []

    class FakeRun:
        def request_stop(self) -> None:
            calls.append(threading.current_thread().name)

    async def attach_later(switch: StopSwitch) -> None:
        switch.attach(FakeRun())  # type: ignore[arg-type]
        threading.Thread(target=switch.request, name="caller").start()  # a request from another thread ...
        await wait_for_async(lambda: len(calls) == 2, 60, "both stop requests to reach the run")

    switch = StopSwitch()
    switch.request()  # before the run exists
    assert calls == []
    asyncio.run(attach_later(switch))
    # ... both run on the run's own thread (the loop's), never the caller's
    assert calls == [threading.current_thread().name] * 2


def test_ctrl_c_while_the_run_has_its_own_thread_pulls_the_switch() -> None:
    """A notebook: the caller's thread waits; each Ctrl-C (a real SIGINT) becomes a stop request."""
    requests: list[float] = []

    class Switch:
        def request(self) -> None:
            requests.append(time.monotonic())

    def body() -> dict:
        wait_for(lambda: len(requests) == 2, 60, "two stop requests")
        return {"requests": len(requests)}

    def caller_waits() -> bool:
        """The caller's thread is in its wait for the run, where Ctrl-C becomes a stop request
        (not yet there, a Ctrl-C would interrupt the test itself)."""
        frame = sys._current_frames().get(threading.main_thread().ident)
        return frame is not None and frame.f_code is _in_own_thread.__code__ and \
            "time.sleep(" in linecache.getline(frame.f_code.co_filename, frame.f_lineno)

    def interrupt_twice() -> None:
        for pulled in (1, 2):
            wait_for(caller_waits, 60, "the caller's thread to wait for the run", poll_s=0.01)
            os.kill(os.getpid(), signal.SIGINT)
            wait_for(lambda: len(requests) == pulled, 60, f"Ctrl-C {pulled} to become a stop request")

    threading.Thread(target=interrupt_twice, daemon=True).start()
    assert _in_own_thread(body, Switch()) == {"requests": 2}


def test_an_error_in_the_run_thread_reaches_the_caller() -> None:
    def body() -> dict:
        raise TrainingError("the learner died")

    with pytest.raises(TrainingError, match="the learner died"):
        _in_own_thread(body, StopSwitch())


# ---------------------------------------------------------------- slow tier: real runs on the tiny model


def steps_in(out: Path) -> list[int]:
    return [row["step"] for row in read_metrics(out / "metrics.jsonl") if "kind" not in row]


@pytest.mark.slow
def test_api_trains_two_steps_then_resumes_from_inside_a_running_event_loop(in_tmp, tiny_model) -> None:
    config = make_config(in_tmp, tiny_model, "api", run={"max_steps": 50, "checkpoint_every": 1})
    out = in_tmp / "api"
    summary = train(load_config(config, overrides={"run.max_steps": 2}))
    assert summary["steps"] == 2 and summary["ended"] == "done" and summary["version"] == 2
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    assert steps_in(out) == [1, 2]

    async def notebook_cell() -> dict:  # Jupyter runs cells inside its own event loop
        return train(config, overrides={"run.max_steps": 4}, resume=True)

    resumed = asyncio.run(notebook_cell())
    assert resumed["steps"] == 4 and resumed["version"] == 4
    assert steps_in(out) == [1, 2, 3, 4]  # continued, never repeated


NOTEBOOK_SCRIPT = '''
import asyncio, json, signal, sys
from lora_async import load_config, train

# As ipykernel runs a cell: a plain callback of an event loop that is already running, with
# Ctrl-C raising KeyboardInterrupt. The run gets a thread of its own; this one passes Ctrl-C on.
loop = asyncio.new_event_loop()
signal.signal(signal.SIGINT, signal.default_int_handler)

def cell():
    try:
        print("SUMMARY " + json.dumps(train(load_config(sys.argv[1]))), flush=True)
    finally:
        loop.stop()

loop.call_soon(cell)
loop.run_forever()
'''


@pytest.mark.slow
@pytest.mark.parametrize("runner", ["notebook", "cli"])
def test_ctrl_c_to_the_process_group_stops_after_a_step_with_a_checkpoint(in_tmp, tiny_model, runner) -> None:
    """The API in a notebook, and the CLI, alike: the step finishes, a checkpoint follows, and the
    run resumes from it (here through the API)."""
    config = make_config(in_tmp, tiny_model, "stopped", run={"max_steps": 40, "canary_every": 0})
    out = in_tmp / "stopped"
    script = in_tmp / "cell.py"
    script.write_text(NOTEBOOK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(in_tmp), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(script), str(config)] if runner == "notebook" else \
        [sys.executable, "-m", "lora_async", "train", str(config)]
    proc = subprocess.Popen(cmd, env=env, cwd=in_tmp, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        wait_for_run(proc, lambda: (out / "metrics.jsonl").is_file() and steps_in(out), "its first step")
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal, or Jupyter's interrupt, sends
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-3000:]
    assert "stopping after this step" in stderr
    summary = json.loads(stdout.split("SUMMARY ", 1)[1]) if runner == "notebook" else \
        json.loads((out / "summary.json").read_text())
    stopped_at = summary["steps"]
    assert summary["ended"] == "requested" and 1 <= stopped_at < 40
    assert (out / "checkpoints" / "LATEST").read_text().strip() == f"step-{stopped_at:06d}"
    assert steps_in(out) == list(range(1, stopped_at + 1))

    resumed = train(config, overrides={"run.max_steps": stopped_at + 2}, resume=True)
    assert resumed["steps"] == stopped_at + 2 and resumed["version"] == stopped_at + 2
    assert steps_in(out) == list(range(1, stopped_at + 3))
