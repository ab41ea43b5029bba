"""The parent's side of a TRL run: try TRL's generation modes in order (vLLM colocate, vLLM server,
plain transformers `generate`), each in its own trl_child.py process; a vLLM mode must score its
first batch within the probe time. The first mode that trains is the run's; why each other mode
was ruled out goes to the summary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from lora_async.bench.proc import STOP_GRACE_S, TreeMonitor, free_port, last_error, run_logged, start_logged, stop_group
from trl_child import FIRST_BATCH

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# A vLLM server gets this long to answer /health when no probe bounds it (CPU start-up with
# model load and compilation takes minutes).
SERVER_START_S = 600.0
SERVER_POLL_S = 1.0
# TRL's vLLM server takes this share of GPU memory: low, so a trainer on the same GPU has room.
SERVER_MEMORY_FRACTION = 0.2


class RunFailed(RuntimeError):
    """A run that did not finish; the message says which and why (and where its log is)."""


def trl_train(args: argparse.Namespace, run_dir: Path, log_stem: Path, sets: list[str],
              modes: tuple[str, ...], trl_args: list[str]) -> dict[str, Any]:
    """Train with the first of `modes` that works: the child's figures, the mode, and why each
    mode before it was ruled out."""
    ruled_out: dict[str, str] = {}
    for mode in modes:
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        log = log_stem.with_name(f"{log_stem.name}.{mode}.log")
        probe = args.probe_timeout if (mode != "transformers" and len(modes) > 1) else None
        print(f"[trl] trying generation mode {mode!r}"
              + (f" (must generate its first batch within {probe:.0f} s)" if probe else ""), flush=True)
        try:
            info = attempt(mode, args, run_dir, log, probe, sets, trl_args)
        except RunFailed as exc:
            if mode == modes[-1]:
                raise RunFailed(f"{run_dir.name}: no generation mode worked; last ({mode}): {exc}; "
                                f"ruled out before: {ruled_out}") from None
            ruled_out[mode] = str(exc)
            print(f"[trl] mode {mode!r} ruled out: {exc}", flush=True)
            continue
        return {**info, "trl_mode": mode, "trl_modes_ruled_out": ruled_out}
    raise AssertionError("unreachable")


class FirstBatchProbe:
    """`stop_when` for a TRL trainer: a reason to stop it when it has not scored its first batch
    within `timeout_s` of starting (None: no limit), or when the vLLM server it uses died."""

    def __init__(self, marker: Path, timeout_s: float | None, server: subprocess.Popen | None,
                 server_log: Path | None) -> None:
        self.marker, self.timeout_s, self.server, self.server_log = marker, timeout_s, server, server_log
        self.started = time.perf_counter()  # the probe clock starts with the trainer

    def __call__(self) -> str | None:
        if self.timeout_s is None or self.marker.exists():
            return None
        if self.server is not None and self.server.poll() is not None and self.server_log is not None:
            return f"vLLM server exited (code {self.server.returncode}): {last_error(self.server_log)}"
        if time.perf_counter() - self.started > self.timeout_s:
            return f"no batch generated and scored within {self.timeout_s:.0f} s"
        return None


def attempt(mode: str, args: argparse.Namespace, run_dir: Path, log: Path, probe: float | None,
            sets: list[str], trl_args: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, str(HERE / "trl_child.py"), "--run-dir", str(run_dir),
           "--config", str(args.config), "--budget", str(args.trl_budget), "--mode", mode,
           "--save-every", str(args.save_every)]
    cmd += [f"--set={s}" for s in sets] + [f"--trl-arg={s}" for s in trl_args + list(args.trl_arg)]
    server: subprocess.Popen | None = None
    server_log: Path | None = None
    notes: list[str] = []
    with TreeMonitor() as mon:
        try:
            if mode == "server":
                server, port, server_log, notes = start_vllm_server(args, sets, log, mon, probe)
                cmd += ["--trl-arg=vllm_server_host=\"127.0.0.1\"", f"--trl-arg=vllm_server_port={port}",
                        f"--trl-arg=vllm_group_port={free_port()}"]
            print(f"[trl] {' '.join(cmd)}", flush=True)
            done = run_logged(cmd, log, mon, cwd=REPO,
                              stop_when=FirstBatchProbe(run_dir / FIRST_BATCH, probe, server, server_log))
        finally:
            if server is not None:
                stop_group(server, STOP_GRACE_S)
    before = f" (after: {'; '.join(notes)})" if notes else ""
    if done.stopped is not None:
        raise RunFailed(f"{mode}: trainer {done.stopped} (log {log}){before}")
    if done.returncode != 0:
        raise RunFailed(f"{mode}: trainer exit {done.returncode}: {last_error(log)} (log {log}){before}")
    return {"peak_rss_mb": round(mon.peak_mb, 1), "process_wall_s": round(done.wall_s, 1), "log": str(log)}


def start_vllm_server(args: argparse.Namespace, sets: list[str], log: Path, mon: TreeMonitor,
                      probe: float | None) -> tuple[subprocess.Popen, int, Path, list[str]]:
    """The first of `server_commands` that answers /health: (process, port, its log, why the
    ones before it failed)."""
    port = free_port()
    notes: list[str] = []
    for label, cmd, env in server_commands(child_model_dir(args, sets), port):
        slog = log.with_name(log.name.replace(".log", f".{label}.log"))
        print(f"[trl] starting {label}: {' '.join(cmd)}", flush=True)
        try:
            server = start_logged(cmd, slog, env, cwd=REPO)
        except OSError as exc:  # e.g. no `trl` script: try the next command
            notes.append(f"{label} did not start: {exc}")
            continue
        mon.add(server.pid)
        try:
            wait_for_server(server, port, slog, probe or SERVER_START_S, label)
            return server, port, slog, notes
        except RunFailed as exc:
            notes.append(str(exc))
            print(f"[trl] {exc}", flush=True)
            stop_group(server, STOP_GRACE_S)
    raise RunFailed("server: " + "; ".join(notes))


def wait_for_server(server: subprocess.Popen, port: int, log: Path, timeout: float, label: str) -> None:
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if server.poll() is not None:
            raise RunFailed(f"{label} exited (code {server.returncode}): {last_error(log)} (log {log})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(SERVER_POLL_S)
    raise RunFailed(f"{label} not healthy within {timeout:.0f} s (log {log})")


def server_commands(model_dir: str, port: int) -> list[tuple[str, list[str], dict[str, str]]]:
    """(label, command, env): `trl vllm-serve`, then the vLLM command it builds, run through vLLM's
    api_server module (vLLM's CLI entry point reads the `vllm` distribution's metadata)."""
    trl_args = ["--model", model_dir, "--host", "127.0.0.1", "--port", str(port),
                "--gpu_memory_utilization", str(SERVER_MEMORY_FRACTION)]
    out = [("trl-vllm-serve", [str(Path(sys.executable).with_name("trl")), "vllm-serve"] + trl_args,
            dict(os.environ))]
    code = ("import json, sys; from trl.scripts.vllm_serve import ScriptArguments, build_command; "
            "print(json.dumps(build_command(ScriptArguments(model=sys.argv[1], host='127.0.0.1', "
            "port=int(sys.argv[2]), gpu_memory_utilization=float(sys.argv[3])))))")
    done = subprocess.run([sys.executable, "-c", code, model_dir, str(port), str(SERVER_MEMORY_FRACTION)],
                          capture_output=True, text=True)
    if done.returncode == 0:
        built = json.loads(done.stdout.strip().splitlines()[-1])
        at = built.index("serve")
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", built[at + 1]] + built[at + 2:]
        out.append(("vllm-api-server", cmd, {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}))
    return out


def child_model_dir(args: argparse.Namespace, sets: list[str]) -> str:
    """The base model's local directory, resolved in a child (this process stays light)."""
    code = ("import sys; from lora_async.config import load_config; from lora_async.models import resolve_model; "
            "print(resolve_model(load_config(sys.argv[1], sys.argv[2:]).model.name))")
    done = subprocess.run([sys.executable, "-c", code, str(args.config)] + list(sets), capture_output=True,
                          text=True, cwd=REPO)
    if done.returncode != 0:
        raise RunFailed(f"resolving the model failed: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout.strip().splitlines()[-1]

