"""Experiment trackers (`trackers/`): the background thread, and each real tracker offline.

The thread's tests use the real TensorBoard backend with one call made to block or to raise.
The tracker tests send rows through `Trackers` to W&B (offline), Trackio and MLflow (local
SQLite stores) and read them back through each library's files or API (`tracker_stores.py`);
training runs that report to all three are in test_train.py."""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path

import pytest

from lora_async.config import RunConfig
from lora_async.trackers import Trackers, check_installed, figures
from lora_async.trackers.backends import RunInfo, TensorBoardBackend, TrackerMissing
from lora_async.trackers.thread import Marks, Tracker

from .helpers import wait_for
from .tracker_stores import mlflow_run, trackio_run, wandb_runs


def info(out: Path, project: str = "t", adapters: tuple[str, ...] = ("main",)) -> RunInfo:
    return RunInfo(out_dir=out, project=project, name=out.name, config={"run": {"seed": 3}, "lr": 1e-4},
                   adapters=list(adapters))


class BlockedBoard(TensorBoardBackend):
    """TensorBoard whose `log` waits until the test lets it go."""

    def __init__(self, info: RunInfo, gate: threading.Event) -> None:
        super().__init__(info)
        self.gate = gate
        self.logged: list[int] = []

    def log(self, prefix: str, values: dict[str, float], step: int) -> None:
        self.gate.wait()
        super().log(prefix, values, step)
        self.logged.append(step)


class BrokenBoard(TensorBoardBackend):
    def log(self, prefix: str, values: dict[str, float], step: int) -> None:
        raise ConnectionError("tracker unreachable\nsecond line")


def test_a_stalled_tracker_never_holds_a_step_and_gets_every_row_once_it_moves(tmp_path):
    gate = threading.Event()
    backend = BlockedBoard(info(tmp_path), gate)
    tracker = Tracker(backend, Marks(tmp_path / "trackers.json", resumed=False), print)
    for step in range(1, 51):  # returns at once while the tracker is stuck on the first row
        tracker.put("log", "main", {"reward_mean": step / 50}, step)
    assert backend.logged == [] and tracker.pending() >= 49
    gate.set()
    tracker.close(failed=False)
    assert backend.logged == list(range(1, 51))
    assert Marks(tmp_path / "trackers.json", resumed=True).last("tensorboard", "main") == 50


def test_a_failing_tracker_is_shown_once_at_once_then_counted_and_the_run_goes_on(tmp_path):
    said: list[str] = []
    tracker = Tracker(BrokenBoard(info(tmp_path)), Marks(tmp_path / "trackers.json", resumed=False), said.append)
    for step in range(1, 6):
        tracker.put("log", "main", {"loss": 1.0}, step)
    tracker.close(failed=False)
    assert len(said) == 2, said
    assert "log failed (ConnectionError: tracker unreachable ...)" in said[0]
    assert "5 of 6 calls failed" in said[1]  # 5 rows, then the close
    assert Marks(tmp_path / "trackers.json", resumed=True).last("tensorboard", "main") is None


def test_a_tracker_that_cannot_open_its_run_takes_nothing_more(tmp_path):
    class Unopenable(TensorBoardBackend):
        def start(self, kept):
            raise PermissionError("no such project")

    said: list[str] = []
    tracker = Tracker(Unopenable(info(tmp_path)), Marks(tmp_path / "trackers.json", resumed=False), said.append)
    tracker.put("log", "main", {"loss": 1.0}, 1)
    tracker.close(failed=False)
    assert tracker.dead and len(said) == 1 and "could not open the run (PermissionError: no such project)" in said[0]


def test_figures_are_the_numbers_of_a_row():
    assert figures({"step": 3, "adapter": "main", "loss": 0.5, "samples": 8, "flag": True, "lag": None}) == \
        {"loss": 0.5, "samples": 8}


def test_report_to_is_checked_in_the_config():
    assert RunConfig().report_to == ["tensorboard"]
    for bad in (["tensorboard", "tensorboard"], ["none", "wandb"], ["neptune"], []):
        with pytest.raises(ValueError):
            RunConfig(report_to=bad)


def test_a_tracker_not_installed_is_one_line_with_the_pip_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(TrackerMissing, match=r"^run\.report_to: mlflow is not installed: "
                                             r"pip install 'lora-async\[mlflow\]'$"):
        check_installed(["tensorboard", "mlflow"])


@pytest.fixture
def stores(tmp_path, monkeypatch):
    """W&B offline, MLflow in a SQLite file; Trackio's store is the session's (conftest)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    return tmp_path


def send(out: Path, project: str, steps: range, resumed: bool, adapters=("main",)) -> None:
    # a long drain: on a busy machine MLflow's first import and store take most of a minute
    trackers = Trackers(["wandb", "trackio", "mlflow"], info(out, project, adapters), resumed, print, drain_s=600)
    for step in steps:
        for adapter in adapters:
            trackers.step({"step": step, "adapter": adapter, "reward_mean": step / 10, "mode": "async"})
        if step % 2 == 0:
            trackers.event({"kind": "eval", "adapter": adapters[0], "step": step, "accuracy": step / 20})
    trackers.summary({"steps": steps[-1], "mode": "async"}, steps[-1])
    trackers.close(failed=False)


def test_each_tracker_holds_the_rows_config_and_tags_and_a_resume_adds_no_step_twice(stores):
    out, project = stores / "run-a", f"p-{uuid.uuid4().hex[:8]}"
    out.mkdir()
    send(out, project, range(1, 6), resumed=False, adapters=("main", "side"))
    # killed after step 5, resumed from a checkpoint at step 3: steps 4 and 5 come again
    send(out, project, range(4, 9), resumed=True, adapters=("main", "side"))

    want = {f"{a}/reward_mean": {s: [s / 10] for s in range(1, 9)} for a in ("main", "side")}
    want["eval/main/accuracy"] = {s: [s / 20] for s in (2, 4, 6, 8)}

    first, second = wandb_runs(out)
    assert first["id"] == second["id"]
    merged: dict[str, dict[int, list[float]]] = {}
    for run in (first, second):
        for key, series in run["series"].items():
            for step, values in series.items():
                merged.setdefault(key, {}).setdefault(step, []).extend(values)
    assert merged == want
    assert first["config"]["run"] == {"seed": 3} and first["tags"] == ["main", "side"]
    assert second["summary"]["steps"] == 8

    tracked = trackio_run(project)
    assert {k: v for k, v in tracked["series"].items() if not k.startswith("summary/")} == want
    assert tracked["series"]["summary/steps"] == {8: [8], 5: [5]}
    assert tracked["config"]["lr"] == 1e-4 and tracked["config"]["lora_async_adapters"] == ["main", "side"]

    flow = mlflow_run(project)
    assert {k: v for k, v in flow["series"].items() if not k.startswith("summary/")} == want
    assert flow["params"]["run.seed"] == "3" and flow["tags"]["lora_async.adapters"] == "main,side"
    assert flow["status"] == "FINISHED"


def test_mlflow_takes_every_metrics_name_with_the_characters_it_refuses_as_underscores(stores):
    """A step row at lag 3 or more has `lag3+/tokens`: MLflow refuses `+`, and would refuse the
    whole row (found by the kill-and-resume run, where auto chose k4)."""
    out, project = stores / "run-m", f"p-{uuid.uuid4().hex[:8]}"
    out.mkdir()
    trackers = Trackers(["mlflow"], info(out, project), False, print, drain_s=600)
    trackers.step({"step": 1, "adapter": "main", "reward_mean": 0.5, "lag3+/tokens": 12})
    trackers.close(failed=False)
    assert trackers.trackers[0].failures == 0
    series = mlflow_run(project)["series"]
    assert series["main/reward_mean"] == {1: [0.5]} and series["main/lag3_/tokens"] == {1: [12]}


def test_the_trackio_internals_the_backend_writes_each_row_through_are_there(tmp_path):
    """TrackioBackend writes each row before it counts it sent, as trackio's own thread does;
    this fails loudly when a trackio release moves what it calls."""
    from trackio.run import Run

    assert callable(getattr(Run, "_flush_queues_inline", None))
    trackers = Trackers(["trackio"], info(tmp_path, f"p-{uuid.uuid4().hex[:8]}"), False, print)
    trackers.step({"step": 1, "adapter": "main", "loss": 0.5})
    trackers.close(failed=False)
    assert trackers.trackers[0].failures == 0 and not trackers.trackers[0].dead
    assert hasattr(trackers.trackers[0].backend.run, "_client_lock")


def test_the_wandb_setting_that_bounds_what_a_kill_loses_is_there():
    """WandbBackend has W&B write the run's file every half second; fails loudly when a W&B
    release drops or renames the setting."""
    import wandb

    from lora_async.trackers.backends import WANDB_FLUSH_S

    assert wandb.Settings(x_transaction_log_flush_interval=WANDB_FLUSH_S).x_transaction_log_flush_interval == 0.5


def test_a_run_starts_its_own_wandb_service_not_one_a_parent_process_started(monkeypatch):
    """W&B's service token names the process that started the service; one a parent started is
    left (a killed run would leave its W&B run open in it), one this process started is kept.
    Fails loudly when W&B renames the variable or changes the token's form."""
    import wandb
    from wandb.sdk.lib.service.service_token import UnixServiceToken

    from lora_async.trackers.backends import WANDB_SERVICE, leave_inherited_wandb_service

    assert wandb.env.SERVICE == WANDB_SERVICE
    for pid, kept in ((os.getppid(), False), (os.getpid(), True)):
        token = UnixServiceToken(parent_pid=pid, path="/tmp/wandb-service.sock").env_value
        monkeypatch.setenv(WANDB_SERVICE, token)
        leave_inherited_wandb_service()
        assert (os.environ.get(WANDB_SERVICE) == token) is kept


def held_steps(tracker: str, out: Path, project: str) -> dict[int, int]:
    """How many values of main's reward each step holds in the tracker's own store."""
    if tracker == "trackio":
        runs = [trackio_run(project)]
    elif tracker == "mlflow":
        runs = [mlflow_run(project)]
    else:
        runs = wandb_runs(out)
    held: dict[int, int] = {}
    for run in runs:
        for step, values in run["series"]["main/reward_mean"].items():
            held[step] = held.get(step, 0) + len(values)
    return held


@pytest.mark.parametrize("tracker", ["wandb", "trackio", "mlflow"])
@pytest.mark.parametrize("marked", [5, 2])
def test_a_resumed_run_sends_the_rows_the_tracker_lacks_whatever_the_marks_say(stores, tracker, marked):
    """A kill can take rows the tracker never stored while the marks count them sent (W&B's
    service writes its file every half second), or the mark of a row it did store: the resumed
    run reads the tracker's own store, and sends exactly the steps it lacks."""
    import json

    out, project = stores / f"run-{tracker}", f"p-{uuid.uuid4().hex[:8]}"
    out.mkdir()
    trackers = Trackers([tracker], info(out, project), False, print, drain_s=600)
    for step in (1, 2, 3):
        trackers.step({"step": step, "adapter": "main", "reward_mean": step / 10})
    trackers.close(failed=False)
    marks = json.loads((out / "trackers.json").read_text())
    marks[tracker]["sent"]["main"] = marked  # as if 4 and 5 were lost to the kill, or 3's mark was
    (out / "trackers.json").write_text(json.dumps(marks))
    # W&B names an attempt's directory by the second it began (`offline-run-<time>-<id>`): a
    # resume within the same second would share the first attempt's (a real one takes seconds)
    began = int(time.time())
    wait_for(lambda: int(time.time()) > began, 5, "the next second")
    resumed = Trackers([tracker], info(out, project), True, print, drain_s=600)
    for step in (2, 3, 4, 5, 6):  # a checkpoint at step 1: 2 and 3 come again
        resumed.step({"step": step, "adapter": "main", "reward_mean": step / 10})
    resumed.close(failed=False)
    assert resumed.trackers[0].held == {"main": 3}
    # W&B's service may still be writing the file when `finish` returns
    wait_for(lambda: 6 in held_steps(tracker, out, project), 30, f"{tracker} to hold step 6")
    assert held_steps(tracker, out, project) == {1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 6: 1}
