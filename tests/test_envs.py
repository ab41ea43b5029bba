"""Environment tasks in the training loop, against the fakes (tests/fakes.py): episodes token
by token, tools, per-token versions across publishes, partial rollouts, and every fault an
environment or a tool can throw (each ends an episode, counted, never the run)."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from lora_async.config import TrainConfig
from lora_async.envs.base import StepResult, ToolResult
from lora_async.envs.episode import Episode, EpisodeSettings
from lora_async.envs.render import ChatRenderer
from lora_async.envs.source import EnvLoadError
from lora_async.metrics import read_metrics
from lora_async.orchestrator import train
from lora_async.rollout import RolloutContext
from lora_async.tasks import make_source
from lora_async.timing import Wait, Waits

from .fakes import ByteTokenizer, FakeGenerator, FakeParts

ENVS = '''
import time
from lora_async.envs import Env, StepResult, user


def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: what to shout
    """
    return text.upper() + "!"


class Echo(Env):
    """Ends when the model says "x...", after `turns` replies at most; reward 1 for an "x"."""

    tools = [shout]

    def __init__(self, index, split):
        self.index = index

    def reset(self):
        return [user(f"problem {self.index}")]

    def step(self, reply):
        if reply.tool_calls:
            return StepResult()
        if reply.content.startswith("x"):
            return StepResult(reward=1.0, done=True, info={"success": True})
        return StepResult([user("again")])


class Broken(Echo):
    def step(self, reply):
        if self.index % 2:
            raise RuntimeError("the environment exploded")
        return super().step(reply)


class Hangs(Echo):
    def step(self, reply):
        if self.index % 2:
            time.sleep(30)
        return super().step(reply)


class NoStep:
    def reset(self):
        return []


def make(index, split):
    return Echo(index, split)


def broken(index, split):
    return Broken(index, split)


def hangs(index, split):
    return Hangs(index, split)


def no_step(index, split):
    return NoStep()


not_callable = 3


def needs_a_download(index, split):
    raise LookupError("\\n******\\n  Resource 'words' not found.\\n  Please use the NLTK Downloader\\n******")


def by_turns(turns, completion, **fields):
    """A user episode reward, called by keyword: 1/turns, and 0 unless the last reply was an "x"."""
    return 1.0 / turns if completion.startswith("x") else 0.0
'''


@pytest.fixture
def env_module(tmp_path, monkeypatch):
    (tmp_path / "fake_envs.py").write_text(ENVS)
    monkeypatch.chdir(tmp_path)  # user modules are imported from the working directory
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "fake_envs"
    sys.modules.pop("fake_envs", None)


def config(tmp_path: Path, env: str = "fake_envs:make", **sections: dict) -> TrainConfig:
    base = {
        "sampling": {"samples_per_prompt": 4, "max_new_tokens": 8},
        "generator": {"groups_in_flight": 4, "max_model_len": 512},
        "learner": {"groups_per_step": 2},
        "buffer": {"mode": "async", "max_staleness": 1},
        "run": {"max_steps": 6, "output_dir": str(tmp_path / "out"), "progress": False, "canary_every": 0,
                "chart_every": 0},
        "task": {"type": "env", "env": env, "max_turns": 4, "heldout": 4, "env_timeout_s": 1.0},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return TrainConfig.model_validate(base)


def run(cfg: TrainConfig, parts: FakeParts) -> dict:
    return asyncio.run(train(cfg, console=Console(stderr=True, width=200), parts=parts))


def steps(cfg: TrainConfig) -> list[dict]:
    return [r for r in read_metrics(Path(cfg.run.output_dir) / "metrics.jsonl") if "kind" not in r]


def numbered(request, rng):
    return ("x" if rng.random() < 0.3 else "y") + str(rng.randint(100000, 999999))  # 7 tokens, all distinct


def x_or_y(request, rng):
    return ("x" if rng.random() < 0.3 else "y") + "abc"


def test_episodes_record_every_token_with_its_version(tmp_path, env_module):
    """Multi-turn episodes across publishes: every trained token carries the version the
    generator sampled it with; environment tokens are context; the group shares its opening.
    (Without partial rollouts, so each reply is one request: continued turns are tested below.)"""
    cfg = config(tmp_path, buffer={"mode": "async", "max_staleness": 1, "partial_rollouts": False},
                 run={"max_steps": 8})
    parts = FakeParts(["main"], gen_delay=lambda: 0.08, step_s=0.1, reply=numbered)
    summary = run(cfg, parts)
    assert summary["steps"] == 8 and summary["episodes"] > 0 and summary["env_errors"] == 0
    served = {(tuple(prompt), tuple(ids)): version for prompt, version, ids, _ in parts.fake_generator.served}
    samples = [s for t in parts.fake_learner.trained for s in t.samples]
    multi = [s for s in samples if s.token_trained().count(False)]
    assert multi, "no episode took more than one turn"
    for s in samples:
        context = list(s.prompt_ids)
        turn: list[int] = []
        turn_versions: list[int] = []
        for token, trained, version in zip(s.completion_ids, s.token_trained(), s.token_versions()):
            if trained:
                turn.append(token)
                turn_versions.append(version)
                continue
            if turn:  # a finished reply: the generator served exactly these ids on this version
                assert served[(tuple(context), tuple(turn))] == turn_versions[0]
                assert set(turn_versions) == {turn_versions[0]}
                context += turn
                turn, turn_versions = [], []
            context.append(token)
        assert served[(tuple(context), tuple(turn))] == turn_versions[0]
        assert s.version == min(v for v, t in zip(s.token_versions(), s.token_trained()) if t)
        assert bytes(s.completion_ids).decode().count("user: again") == s.token_trained().count(False) // len(
            "\nuser: again\nassistant: ")
    # every group shares its opening prompt (one prompt tree in the learner)
    for t in parts.fake_learner.trained:
        by_problem = {}
        for s in t.samples:
            by_problem.setdefault(bytes(s.prompt_ids), []).append(s)
        assert all(len(v) == 4 for v in by_problem.values())
    rows = steps(cfg)
    assert all("success_rate" in r and "version_span_max" in r and "turns_mean" in r for r in rows)
    assert max(r["version_span_max"] for r in rows) >= 1  # some episodes moved to a newer version
    assert max(r["turns_max"] for r in rows) > 1


def test_partial_rollouts_continue_a_stale_turn_on_the_newest_version(tmp_path, env_module):
    """Turns that take far longer than a step: with partial rollouts they are stopped, keep the
    tokens they drew (on their version), and go on on the newest version."""
    rng = random.Random(0)
    # The run lasts ~14 x 0.3 s, long enough for groups whose turns were stopped (a slow turn is
    # 1 s) to finish and be trained on before it ends.
    cfg = config(tmp_path, buffer={"mode": "async", "max_staleness": 1, "stale_policy": "is-correct"}, run={"max_steps": 14})
    parts = FakeParts(["main"], gen_delay=lambda: 1.0 if rng.random() < 0.3 else 0.02, step_s=0.25,
                      reply=numbered)
    summary = run(cfg, parts)
    assert summary["resumed_turns"] > 0 and summary["tokens_reprefilled"] > 0
    assert summary["aborted_stale_groups"] == 0
    stopped = [(prompt, version, ids) for prompt, version, ids, how in parts.fake_generator.served if how == "stopped"]
    samples = [s for t in parts.fake_learner.trained for s in t.samples]
    resumed = moved_on = 0
    for prompt, version, ids in stopped:
        for s in samples:
            full = s.prompt_ids + s.completion_ids
            n = len(prompt)
            if full[:n] == prompt and full[n:n + len(ids)] == ids:
                # the tokens drawn before the switch kept their version; the rest came later
                versions = s.token_versions()
                offset = n - len(s.prompt_ids)
                assert versions[offset:offset + len(ids)] == [version] * len(ids)
                assert all(s.token_trained()[offset:offset + len(ids)])
                assert s.logprobs[offset:offset + len(ids)] == [-2.0] * len(ids)
                if offset + len(ids) < len(versions) and s.token_trained()[offset + len(ids)]:
                    # The rest is drawn on the newest version the generator *serves*: usually a
                    # newer one, but the same one while the newer version's hand-off is still in
                    # flight (seen under load in CI; the turn is then stopped again later).
                    assert versions[offset + len(ids)] >= version
                resumed += 1
                moved_on += versions[-1] > version
    assert resumed > 0 and moved_on > 0  # and continued turns do reach newer versions


def test_without_partial_rollouts_a_stale_turn_drops_its_group(tmp_path, env_module):
    rng = random.Random(0)
    # as above: the run outlasts a slow turn, so the groups it aborts are counted before it ends
    cfg = config(tmp_path, buffer={"mode": "async", "max_staleness": 1, "partial_rollouts": False}, run={"max_steps": 14})
    parts = FakeParts(["main"], gen_delay=lambda: 1.0 if rng.random() < 0.3 else 0.02, step_s=0.25,
                      reply=x_or_y)
    summary = run(cfg, parts)
    assert parts.fake_generator.aborted  # turns were cut short in the engine ...
    assert summary["aborted_stale_groups"] > 0 and summary["resumed_turns"] == 0  # ... and their groups dropped
    assert not any(how == "stopped" for *_, how in parts.fake_generator.served)


def tool_then_answer(request, rng):
    text = bytes(request.prompt_ids).decode()
    if "SHOUT" in text.upper() and "HI!" in text:
        return "x done"
    if rng.random() < 0.3:
        return '<tool_call>{"name": "shout", "arguments": {"text": "hi"}}</tool_call>'
    if rng.random() < 0.3:
        return '<tool_call>{"name": "shout", "arguments": {"text": "hi"}'  # malformed: never closed
    return '<tool_call>{"name": "whisper", "arguments": {}}</tool_call>'


def test_tool_calls_run_and_their_results_reach_the_model(tmp_path, env_module):
    cfg = config(tmp_path, sampling={"max_new_tokens": 96}, generator={"max_model_len": 2048})
    parts = FakeParts(["main"], gen_delay=lambda: 0.02, step_s=0.05, reply=tool_then_answer)
    summary = run(cfg, parts)
    assert summary["tool_calls"] > 0 and summary["tool_errors"] > 0
    prompts = [bytes(p).decode() for p, *_ in parts.fake_generator.served]
    assert any("tool: HI!" in p for p in prompts)  # the tool ran; its result is context
    assert any("unknown tool 'whisper'" in p for p in prompts)  # the model sees its mistake
    assert any("could not parse" in p or "error" in p for p in prompts)
    # the fallback tool prompt described the tool in the opening
    assert all("shout" in bytes(s.prompt_ids).decode() for t in parts.fake_learner.trained for s in t.samples)
    rows = steps(cfg)
    assert max(r["tool_call_rate"] for r in rows) > 0


@pytest.mark.parametrize("factory, message", [("fake_envs:broken", "exploded"), ("fake_envs:hangs", "timed out")])
def test_an_environment_that_raises_or_hangs_ends_its_episode_and_the_run_goes_on(
        tmp_path, env_module, capsys, factory, message):
    cfg = config(tmp_path, env=factory, run={"max_steps": 4})
    parts = FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.05, reply=x_or_y)
    summary = run(cfg, parts)
    assert summary["steps"] == 4
    assert summary["env_errors"] > 0
    samples = [s for t in parts.fake_learner.trained for s in t.samples]
    assert samples  # the healthy problems were trained on
    shown = [line for line in capsys.readouterr().err.splitlines() if "the environment failed" in line]
    assert len(shown) == 1 and message in shown[0]


def test_an_episode_that_fills_the_context_ends_truncated(tmp_path, env_module):
    cfg = config(tmp_path, generator={"max_model_len": 600}, task={"max_turns": 50}, run={"max_steps": 2})
    parts = FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.05, reply=lambda r, rng: "yabc")
    summary = run(cfg, parts)
    assert summary["truncated_episodes"] > 0
    assert all(len(p) + 1 <= 600 for p, *_ in parts.fake_generator.served)  # never past the context


@pytest.mark.parametrize("spec, message", [
    ("no_such_module:make", "cannot import 'no_such_module'"),
    ("fake_envs:nothing", "has no 'nothing'"),
    ("fake_envs:not_callable", "not a factory"),
    ("fake_envs:no_step", "no step method"),
    ("fake_envs:needs_a_download", r"raised LookupError: \*+ \.\.\.$"),  # another library's multi-line error
])
def test_an_unusable_environment_fails_at_startup_naming_the_field(tmp_path, env_module, spec, message):
    cfg = config(tmp_path, env=spec)
    with pytest.raises(EnvLoadError, match=message) as info:
        make_source(cfg.adapter_specs[0], cfg, 0)
    assert str(info.value).startswith("task.env") and "\n" not in str(info.value)


def segments(sample) -> int:
    """Replies in a trajectory: runs of trained tokens."""
    flags = sample.token_trained()
    return sum(1 for i, t in enumerate(flags) if t and (i == 0 or not flags[i - 1]))


def test_a_user_episode_reward_is_called_by_keyword(tmp_path, env_module, capsys):
    cfg = config(tmp_path, task={"reward": "fake_envs:by_turns"}, run={"max_steps": 3})
    parts = FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.05, reply=numbered)
    summary = run(cfg, parts)
    assert summary["reward_errors"] == 0
    samples = [s for t in parts.fake_learner.trained for s in t.samples]
    assert samples
    for s in samples:
        done = s.finish_reason == "done"
        assert s.reward == pytest.approx(1.0 / segments(s) if done else 0.0)
    line = next(line for line in capsys.readouterr().err.splitlines() if "reward fake_envs:by_turns" in line)
    assert "by_turns (16 at once) gets prompt, completion, answer, messages, turns, tool_calls, env_reward" in line


def test_the_cli_exits_2_on_an_unusable_environment(tmp_path, env_module):
    import subprocess

    path = tmp_path / "bad.toml"
    path.write_text('[task]\ntype = "env"\nenv = "no_such_module:make"\n[run]\n'
                    f'output_dir = "{tmp_path / "out"}"\n')
    proc = subprocess.run([sys.executable, "-m", "lora_async.cli.app", "train", str(path)], capture_output=True,
                          text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "task.env" in proc.stderr and "Traceback" not in proc.stderr


def test_plain_renderer_deltas_do_not_retokenise_the_context(env_module):
    from lora_async.envs.render import ChatRenderer

    r = ChatRenderer(ByteTokenizer(), [], None)
    opening = r.opening([{"role": "user", "content": "hi"}])
    assert bytes(opening).decode() == "user: hi\nassistant: "
    delta = r.delta([{"role": "user", "content": "again"}], list(b"yabc"))
    assert bytes(delta).decode() == "\nuser: again\nassistant: "


# ------------------------------------------------------------------ waits: concurrent and timed

SLOW_ENVS = '''
import asyncio
import threading
import time

from lora_async.envs import Env, StepResult, user

CALLS = []  # (method, start, end) of every reset and step
BEGUN = {"reset": 0, "step": 0}
LOCK = threading.Lock()
GROUP, PATIENCE_S = 4, 20.0  # the group's episodes; how long a call waits for the others (under env_timeout_s)


def begin(method):
    with LOCK:
        BEGUN[method] += 1


def all_begun(method):
    return BEGUN[method] >= GROUP


class Slow(Env):
    """Each call takes until every episode of the group has begun the same call (a simulator, a
    user that answers them together): calls that run at once all end together; one after
    another, the first would wait out its patience alone and end before the others begin."""

    def __init__(self, index, split):
        pass

    def reset(self):
        start = time.monotonic()
        self.meet("reset")
        CALLS.append(("reset", start, time.monotonic()))
        return [user("go")]

    def step(self, reply):
        start = time.monotonic()
        self.meet("step")
        CALLS.append(("step", start, time.monotonic()))
        return StepResult(reward=float(reply.content.startswith("x")), done=True)

    def meet(self, method):
        begin(method)
        deadline = time.monotonic() + PATIENCE_S
        while not all_begun(method) and time.monotonic() < deadline:
            time.sleep(0.01)


class SlowAsync(Slow):
    async def reset(self):
        start = time.monotonic()
        await self.ameet("reset")
        CALLS.append(("reset", start, time.monotonic()))
        return [user("go")]

    async def step(self, reply):
        start = time.monotonic()
        await self.ameet("step")
        CALLS.append(("step", start, time.monotonic()))
        return StepResult(reward=float(reply.content.startswith("x")), done=True)

    async def ameet(self, method):
        begin(method)
        deadline = time.monotonic() + PATIENCE_S
        while not all_begun(method) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)


def plain(index, split):
    return Slow(index, split)


def coroutines(index, split):
    return SlowAsync(index, split)
'''


@pytest.fixture
def slow_envs(tmp_path, monkeypatch):
    (tmp_path / "slow_envs.py").write_text(SLOW_ENVS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "slow_envs"
    sys.modules.pop("slow_envs", None)


def fake_generate(reply) -> tuple[Any, FakeGenerator]:
    from lora_async.generator.types import generate_async

    generator = FakeGenerator(lambda: 0.01, [], reply=reply)
    generator.live["main"] = [0]
    return generate_async(generator), generator


def overlap(spans: list[tuple[float, float]]) -> bool:
    """All of them were running at one moment: the last to start began before the first to end ended."""
    return max(start for start, _ in spans) < min(end for _, end in spans)


@pytest.mark.parametrize("factory", ["slow_envs:plain", "slow_envs:coroutines"])
def test_the_environment_calls_of_a_group_run_at_once_and_are_timed(tmp_path, slow_envs, factory):
    cfg = config(tmp_path, env=factory, task={"max_turns": 1, "env_timeout_s": 30.0})
    source = make_source(cfg.adapter_specs[0], cfg, 0)
    generate, _ = fake_generate(x_or_y)
    waits = Waits()
    try:
        asyncio.run(source.rollout(0, RolloutContext(generate, ByteTokenizer(), "rollout", waits)))
    finally:
        source.close()
    calls = sys.modules["slow_envs"].CALLS
    for method in ("reset", "step"):
        spans = [(start, end) for what, start, end in calls if what == method]
        assert len(spans) == 4 and overlap(spans), spans  # the group's 4 episodes, side by side
    recorded = waits.take()[Wait.ENV]
    assert len(recorded) == 8  # one wait per reset and step
    assert min(recorded) >= min(end - start for _, start, end in calls)  # each wait covers its call


class SlowTools:
    """A toolbox whose calls take `seconds`; it records when each ran."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []

    async def run(self, call):
        start = time.monotonic()
        await asyncio.sleep(call.arguments["seconds"])
        self.spans.append((start, time.monotonic()))
        return ToolResult(call, f"{call.name} {call.arguments['n']}")


class Replies:
    """An environment that keeps the replies it was given and ends after one."""

    def __init__(self) -> None:
        self.replies = []

    def reset(self):
        return [{"role": "user", "content": "go"}]

    def step(self, reply):
        self.replies.append(reply)
        return StepResult(done=True)


def test_the_tool_calls_of_one_reply_run_at_once_and_keep_their_order():
    # the first call takes longest: its result still comes first
    text = "".join(f'<tool_call>{{"name": "nap", "arguments": {{"seconds": {s}, "n": {n}}}}}</tool_call>'
                   for n, s in enumerate((0.3, 0.2, 0.1)))
    generate, _ = fake_generate(lambda request, rng: text)
    env, tools, waits = Replies(), SlowTools(), Waits()
    settings = EpisodeSettings(max_turns=1, max_tokens=len(text) + 1, max_model_len=4096, temperature=1.0, top_p=1.0,
                               env_timeout_s=30.0, partial=False)
    episode = Episode(env, ChatRenderer(ByteTokenizer(), [], None), tools, settings, generate, "main", "rollout",
                      waits=waits)
    trajectory = asyncio.run(episode.play())
    assert trajectory.tool_calls == 3 and trajectory.outcome.value == "done"
    (reply,) = env.replies
    assert [r.content for r in reply.tool_results] == ["nap 0", "nap 1", "nap 2"]
    assert len(tools.spans) == 3 and overlap(tools.spans), tools.spans
    recorded = waits.take()
    assert len(recorded[Wait.TOOL]) == 3 and len(recorded[Wait.ENV]) == 2  # the tools; reset and step


def test_a_step_row_reports_its_tool_and_environment_waits(tmp_path, env_module):
    cfg = config(tmp_path, sampling={"max_new_tokens": 96}, generator={"max_model_len": 2048})
    parts = FakeParts(["main"], gen_delay=lambda: 0.02, step_s=0.05, reply=tool_then_answer)
    summary = run(cfg, parts)
    rows = steps(cfg)
    for kind in ("tool", "env"):
        timed = [r for r in rows if f"{kind}_wait_s_p50" in r]
        assert timed, f"no step row has {kind} waits"
        assert all(0 <= r[f"{kind}_wait_s_p50"] <= r[f"{kind}_wait_s_p95"] for r in timed)
        assert summary[f"{kind}_wait_calls"] > 0
        assert 0 <= summary[f"{kind}_wait_s_p50"] <= summary[f"{kind}_wait_s_p95"]
    # every step of an environment run has reset and step calls, none of them eval's
    assert all("env_wait_s_p50" in r for r in rows)
