"""`lora-async bench e2e` without an engine: what a rerun keeps, read from hand-written runs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from lora_async.bench import e2e
from lora_async.config import TrainConfig, dump_config

from .helpers import wait_for


def finished_run(config: TrainConfig, mode: str, out: Path, scored: bool) -> Path:
    """A run directory as a finished `bench e2e` run of 60 s leaves it (scored or not yet)."""
    run_dir = out / f"{mode}-s0"
    run_dir.mkdir(parents=True)
    write_run(e2e.mode_config(config, mode, 0, 60.0, 1, run_dir))
    if scored:
        (run_dir / "eval.json").write_text(json.dumps({"snapshots": 2}))
    return run_dir


def write_run(cfg: TrainConfig) -> None:
    """What the CLI leaves in the run's directory: its config, summary and rows."""
    run_dir = Path(cfg.run.output_dir)
    (run_dir / "config.json").write_text(dump_config(cfg))
    (run_dir / "summary.json").write_text(json.dumps({"ended": "done", "mode": cfg.buffer.mode}))
    rows = [{"step": s, "wall_s": 10.0 * s, "reward_mean": 0.5, "tokens_trained": 100,
             "tokens_generated_total": 200 * s} for s in (1, 2)]
    rows.append({"kind": "eval", "step": 2, "wall_s": 20.0, "accuracy": 0.9})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_rerun_keeps_finished_runs_and_scores_only_the_unscored(tmp_path, monkeypatch):
    config = TrainConfig.model_validate({"run": {"output_dir": str(tmp_path)}})
    finished_run(config, "sync", tmp_path, scored=True)
    unscored = finished_run(config, "auto", tmp_path, scored=False)
    calls: list[list[str]] = []

    def run_logged(cmd: list[str], log: Path) -> subprocess.CompletedProcess:
        calls.append(cmd)
        if cmd[2] == "lora_async.bench.run_json":  # the run, as the CLI would leave it
            write_run(TrainConfig.model_validate(json.loads(Path(cmd[3]).read_text())))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(e2e, "run_logged", run_logged)
    report = e2e.run_e2e_bench(config, 60.0, tmp_path, ["sync", "auto"], [0], target=0.8, log=lambda _: None)
    assert [c[2] for c in calls] == ["lora_async.bench.snapshots"]  # no training, one scoring
    assert calls[0][-1:] == [str(unscored)]
    assert report["sync"]["time_to_target_s"] == 20.0 and report["auto"]["steps"] == 2

    # A run of another config (here a longer budget) is trained again.
    calls.clear()
    e2e.run_e2e_bench(config, 90.0, tmp_path, ["sync"], [0], target=0.8, log=lambda _: None)
    assert [c[2] for c in calls] == ["lora_async.bench.run_json", "lora_async.bench.snapshots"]


CHILD_THEN_WAIT = """
import sys
from pathlib import Path
from lora_async.bench.proc import run_logged
child = [sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(600)"]
run_logged(child, Path(sys.argv[1]))
"""


def test_a_bench_sent_sigterm_stops_its_child_run(tmp_path):
    """A child run sits in its own session; SIGTERM to the bench must not leave it running (it
    would go on training beside the next run and spoil both runs' timings)."""
    log = tmp_path / "child.log"
    bench = subprocess.Popen([sys.executable, "-c", CHILD_THEN_WAIT, str(log)])
    try:
        child = int(wait_for(lambda: log.is_file() and log.read_text().strip(), 60, "the child's pid"))
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
        wait_for(lambda: not alive(child), 60, "the child to stop")
    finally:
        bench.kill()


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def test_the_steps_auto_spent_in_a_mode_it_left():
    def decision(kind: str, step: int, mode: str, staleness: int = 0) -> dict:
        return {"mode_kind": kind, "mode_decided_at_step": step, "mode": mode, "mode_staleness": staleness}

    # 1 sync step, then async at 2, confirmed (no change), kept; later 2 sync steps re-measuring
    decisions = [decision("measured", 1, "async", 2), decision("confirmed", 2, "async", 2),
                 decision("kept", 9, "async", 2), decision("re-measure", 14, "sync"),
                 decision("re-decided", 16, "async", 2)]
    # spans its deciding left: sync 0-1 (1) and sync 14-16 (2); async 1-14 was right until its steps
    # drifted from the prediction (re-measure), and does not count
    assert e2e.steps_in_left_modes(decisions) == 2
    assert e2e.steps_in_left_modes(decisions[:3]) == 1
    # a confirming step that goes back to sync: 1 async step in a mode it left
    assert e2e.steps_in_left_modes([decision("measured", 1, "async", 1), decision("reverted", 2, "sync")]) == 1
    assert e2e.steps_in_left_modes([decision("pinned", 0, "sync")]) is None
