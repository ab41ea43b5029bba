"""Reward functions: builtin ones by name, and user functions run in a guarded subprocess.

A user function (`module:function`, called as `fn(prompt, completion, answer) -> float`) runs in
a child process: one that raises, returns junk or runs past its timeout scores 0, is counted,
and never takes the training run down with it (a hung child is killed and restarted).
"""

from __future__ import annotations

import json
import math
import os
import re
import selectors
import subprocess
import sys
import threading
from typing import Callable

from .base import RewardStats

NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")
RESTART_GRACE_S = 2.0  # how long a killed reward worker gets to exit before SIGKILL


class RewardError(ValueError):
    """A reward specification that cannot be used (unknown name, import failure)."""


def final_number(text: str) -> float | None:
    """The last number in the text, or None."""
    found = NUMBER_RE.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


def numeric_reward(completion: str, answer: str) -> float:
    got = final_number(completion)
    want = final_number(answer)
    return float(got is not None and want is not None and math.isclose(got, want, abs_tol=1e-9))


def exact_reward(completion: str, answer: str) -> float:
    return float(completion.strip() == answer.strip())


def regex_reward(pattern: str) -> Callable[[str, str], float]:
    compiled = re.compile(pattern)
    return lambda completion, answer: float(compiled.search(completion) is not None)


def builtin_reward(spec: str) -> Callable[[str, str], float] | None:
    if spec == "exact":
        return exact_reward
    if spec == "numeric":
        return numeric_reward
    if spec.startswith("regex:"):
        return regex_reward(spec[len("regex:"):])
    return None


class UserReward:
    """`module:function` in a worker subprocess, with a per-call timeout."""

    def __init__(self, spec: str, timeout_s: float, stats: RewardStats) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        self.stats = stats
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()  # producers score groups from several threads
        self._start()  # import errors surface now, as a RewardError

    def _start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
        self._proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "lora_async.tasks.reward_worker", self.spec],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        hello = self._read_line(timeout=60.0)
        if hello is None or not hello.get("ready"):
            error = (hello or {}).get("error") or self._stderr_tail()
            self._kill()
            raise RewardError(f"reward function {self.spec!r} could not be loaded: {error}")

    def _stderr_tail(self) -> str:
        if self._proc is None or self._proc.stderr is None:
            return ""
        try:
            return self._proc.stderr.read()[-300:].strip()
        except Exception:
            return ""

    def _read_line(self, timeout: float) -> dict | None:
        assert self._proc is not None and self._proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                return None
        line = self._proc.stdout.readline()
        return json.loads(line) if line else None

    def _kill(self) -> None:
        if self._proc is None:
            return
        self._proc.kill()
        try:
            self._proc.wait(timeout=RESTART_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        self._proc = None

    def __call__(self, prompt: str, completion: str, answer: str) -> float:
        with self._lock:
            return self._call(prompt, completion, answer)

    def _call(self, prompt: str, completion: str, answer: str) -> float:
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps({"p": prompt, "c": completion, "a": answer}) + "\n")
            self._proc.stdin.flush()
            reply = self._read_line(self.timeout_s)
        except (BrokenPipeError, OSError, json.JSONDecodeError) as exc:
            reply = {"error": f"worker died: {exc}"}
        if reply is None:
            self.stats.timeouts += 1
            self._fail(f"timed out after {self.timeout_s:g}s")
            self._kill()
            return 0.0
        if "error" in reply:
            self._fail(reply["error"])
            return 0.0
        return float(reply["r"])

    def _fail(self, message: str) -> None:
        self.stats.record_error(f"{self.spec}: {message}")

    def close(self) -> None:
        self._kill()


def make_reward(spec: str, timeout_s: float, stats: RewardStats) -> Callable[[str, str, str], float]:
    """A callable (prompt, completion, answer) -> float for a reward spec."""
    builtin = builtin_reward(spec)
    if builtin is not None:
        return lambda prompt, completion, answer: builtin(completion, answer)
    if ":" not in spec:
        raise RewardError(f"unknown reward {spec!r}: use exact, numeric, regex:<pattern> or module:function")
    return UserReward(spec, timeout_s, stats)


def safe_rewards(fn: Callable[[str, str, str], float], stats: RewardStats, prompt: str,
                 completions: list[str], answer: str) -> list[float]:
    """Score completions; an exception or a non-finite score gives 0 and is counted.

    A call is counted once it is scored (after its error, if any), so a reader on another
    thread never sees more calls than outcomes."""
    out = []
    for completion in completions:
        try:
            value = float(fn(prompt, completion, answer))
            if not math.isfinite(value):
                raise ValueError(f"reward is {value}")
        except Exception as exc:
            stats.record_error(f"{type(exc).__name__}: {exc}")
            value = 0.0
        stats.calls += 1
        out.append(value)
    return out
