"""Training runs that report to W&B (offline), Trackio and MLflow (local SQLite) at once, read
back through each library's files or API: the same step figures as metrics.jsonl, the config,
the tags; and a SIGKILLed run resumed into the same tracker runs with no step twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import pytest

from lora_async.metrics import read_metrics

from .helpers import WHOLE_RUN_TIMEOUT_S, wait_for_run
from .test_train import make_config
from .tracker_stores import mlflow_run, trackio_run, wandb_runs

pytestmark = pytest.mark.slow

TRACKERS = ["tensorboard", "wandb", "trackio", "mlflow"]


def tracker_env(tmp_path, monkeypatch) -> dict[str, str]:
    """W&B offline, MLflow in a SQLite file of the test's, for the run and for the readers here
    (Trackio's store is the session's: conftest)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


def merged(series_list: list[dict]) -> dict[str, dict[int, list[float]]]:
    """Several W&B runs' series (one per attempt) as one: values at a step from every attempt."""
    out: dict[str, dict[int, list[float]]] = {}
    for series in series_list:
        for key, points in series.items():
            for step, values in points.items():
                out.setdefault(key, {}).setdefault(step, []).extend(values)
    return out


def step_series(rows: list[dict], adapter: str = "main") -> dict[str, dict[int, list[float]]]:
    """What metrics.jsonl's step rows say each tracker holds: `<adapter>/<key>` by step."""
    want: dict[str, dict[int, list[float]]] = {}
    for row in rows:
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                want.setdefault(f"{adapter}/{key}", {})[row["step"]] = [value]
    return want


def test_a_run_sends_every_step_figure_and_its_config_to_each_tracker(tmp_path, monkeypatch, tiny_model):
    env = tracker_env(tmp_path, monkeypatch)
    project = f"run-{uuid.uuid4().hex[:8]}"
    config = make_config(tmp_path, tiny_model, "tracked", run={"max_steps": 2, "report_to": TRACKERS,
                                                               "tracker_project": project, "eval_at_start": True})
    done = subprocess.run([sys.executable, "-m", "lora_async", "train", str(config)], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=WHOLE_RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "calls failed" not in done.stderr and "could not open" not in done.stderr, done.stderr[-3000:]
    out = tmp_path / "tracked"
    lines = read_metrics(out / "metrics.jsonl")
    steps = [r for r in lines if "kind" not in r]
    assert [r["step"] for r in steps] == [1, 2]
    want = step_series(steps)
    evals = [r for r in lines if r.get("kind") == "eval"]
    summary = json.loads((out / "summary.json").read_text())

    (wandb,) = wandb_runs(out)
    assert {k: v for k, v in wandb["series"].items() if k.startswith("main/")} == want
    assert wandb["series"]["eval/accuracy"] == {0: [evals[0]["accuracy"]]}
    assert wandb["config"]["learner"]["lr"] == 2e-3 and wandb["tags"] == ["main"]
    assert wandb["summary"]["steps"] == summary["steps"] == 2

    trackio = trackio_run(project)
    assert {k: v for k, v in trackio["series"].items() if k.startswith("main/")} == want
    assert trackio["config"]["learner"]["lr"] == 2e-3
    assert trackio["series"]["summary/steps"] == {2: [2]}

    mlflow = mlflow_run(project)
    assert {k: v for k, v in mlflow["series"].items() if k.startswith("main/")} == want
    assert mlflow["params"]["learner.lr"] == "0.002" and mlflow["tags"]["adapter.main"] == "true"
    assert mlflow["status"] == "FINISHED" and mlflow["series"]["eval/accuracy"] == {0: [evals[0]["accuracy"]]}
    assert list((out / "tb").glob("events.*"))
    assert json.loads((out / "trackers.json").read_text())["mlflow"]["run"] == {"run_id": mlflow["id"]}


def test_a_killed_run_resumes_into_the_same_tracker_runs_with_no_step_twice(tmp_path, monkeypatch, tiny_model):
    """Launched from a process with a W&B service of its own (as a notebook, or this test runner
    after the W&B tests, is): both attempts inherit its token, and the killed one's W&B run stays
    open in that service unless each run starts its own (`leave_inherited_wandb_service`)."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    wandb.init(project="parent", dir=str(tmp_path), reinit="create_new").finish()
    assert os.environ.get("WANDB_SERVICE")
    env = tracker_env(tmp_path, monkeypatch)
    project = f"resume-{uuid.uuid4().hex[:8]}"
    config = make_config(tmp_path, tiny_model, "killed", run={"max_steps": 6, "checkpoint_every": 2, "canary_every": 0,
                                                              "report_to": TRACKERS, "tracker_project": project})
    cmd = [sys.executable, "-m", "lora_async", "train", str(config)]
    out = tmp_path / "killed"
    marks = out / "trackers.json"

    def sent_past_the_checkpoint() -> bool:
        """Step 3 went to every tracker: past the checkpoint of step 2, so it will be trained again."""
        try:
            sent = json.loads(marks.read_text())
        except (OSError, ValueError):
            return False
        return all(sent.get(t, {}).get("sent", {}).get("main", 0) >= 3 for t in TRACKERS)

    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for_run(proc, sent_past_the_checkpoint, "step 3 in every tracker")
    finally:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = json.loads(marks.read_text())
    done = subprocess.run(cmd + ["--resume"], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=WHOLE_RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines()
            if any(line.startswith(f"{t}:") for t in TRACKERS)]  # a tracker's failure, or rows it left
    assert not said, said
    steps = [r for r in read_metrics(out / "metrics.jsonl") if "kind" not in r]
    assert [r["step"] for r in steps] == list(range(1, 7))
    after = json.loads(marks.read_text())
    assert all(after[t]["run"] == before[t]["run"] for t in TRACKERS)  # the same tracker runs, reopened

    def held(series: dict) -> dict[int, int]:
        """How many values each step of main's reward holds."""
        return {step: len(values) for step, values in series["main/reward_mean"].items()}

    wandb = wandb_runs(out)
    assert len(wandb) == 2 and wandb[0]["id"] == wandb[1]["id"]
    every_step_once = {step: 1 for step in range(1, 7)}
    assert held(merged([run["series"] for run in wandb])) == every_step_once
    assert held(trackio_run(project)["series"]) == every_step_once, (before, after, [
        line for line in done.stderr.splitlines() if "trackio" in line.lower()])
    flow = mlflow_run(project)
    assert held(flow["series"]) == every_step_once and flow["status"] == "FINISHED"
    # the steps the resumed attempt sent are its own figures (those before, the killed attempt's)
    last_before = before["mlflow"]["sent"]["main"]
    for row in steps[last_before:]:
        assert flow["series"]["main/reward_mean"][row["step"]] == [row["reward_mean"]]
