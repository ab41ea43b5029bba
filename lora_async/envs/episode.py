"""One episode, token in and token out: the environment opens, the model replies (calling
tools), the environment answers, until it ends the episode, `max_turns` replies were made, or
the context is full.

The trajectory records every token after the opening prompt: the model's (trained, with the
behaviour logprob vLLM sampled it with and the version that sampled it) and the environment's
(context only). Each turn starts on the newest published version. With partial rollouts, a turn
that a learner step makes too stale comes back stopped (`GenStatus.STOPPED`) with the tokens it
has; they keep their version and logprobs, and the turn goes on from there on the newest
version (the context so far is prefilled again: `tokens_reprefilled`).

Faults end the episode, never the run: an environment that raises or hangs (`env_error`), a
context that would overflow `generator.max_model_len` (`truncated`). Tool faults go back to the
model as tool results.

Waits are concurrent and timed: the tool calls of one reply run at once (their results in call
order), the episodes of a group call their environments at once (`source.py`), and every
`reset`/`step` and tool call is recorded in the rollout's `timing.Waits`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..generator.types import GenRequest, GenResult, GenStatus
from ..guarded import call_guarded
from ..outcomes import Outcome
from ..rollout import Generate, sub_seed
from ..timing import NO_WAITS, Wait, Waits
from ..tokenizer import text_of
from .base import EnvLike, Message, Reply, StepResult, ToolCall, ToolResult
from .render import ChatRenderer
from .tools import ToolBox, parse_tool_calls, strip_tool_calls

if TYPE_CHECKING:
    from ..config import AdapterSpec, TrainConfig


class EpisodeError(Exception):
    """The environment failed (raised, hung, or broke the interface); the episode ends."""


class ContextFull(Exception):
    """The next turn would not fit in `generator.max_model_len`: the episode ends truncated."""


class EpisodeAborted(Exception):
    """Generation ended without a usable reply; `result` says how (stale, engine dead, ...)."""

    def __init__(self, result: GenResult) -> None:
        super().__init__(result.error or result.status.value)
        self.result = result


@dataclass
class Trajectory:
    prompt_ids: list[int]  # the opening, rendered once (the same for every episode of a group)
    ids: list[int] = field(default_factory=list)  # everything after it
    trained: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # sampling version (context tokens: -1)
    messages: list[Message] = field(default_factory=list)
    opened: int = 0  # how many of `messages` are the opening
    reward: float = 0.0
    outcome: Outcome = Outcome.RUNNING
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    resumed_turns: int = 0
    tokens_reprefilled: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def sampled(self, ids: list[int], logprobs: list[float], version: int, trained: bool = True) -> None:
        """The model's own tokens (`trained=False`: a frozen seat's, context for nothing to learn)."""
        self.ids += ids
        self.trained += [trained] * len(ids)
        self.logprobs += logprobs
        self.versions += [version] * len(ids)

    def context(self, ids: list[int]) -> None:
        self.ids += ids
        self.trained += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    @property
    def oldest_version(self) -> int | None:
        sampled = [v for v, t in zip(self.versions, self.trained) if t]
        return min(sampled) if sampled else None

    @property
    def version_span(self) -> int:
        """Newest minus oldest version among the sampled tokens (0 for one version)."""
        sampled = [v for v, t in zip(self.versions, self.trained) if t]
        return max(sampled) - min(sampled) if sampled else 0

    @property
    def success(self) -> bool:
        """`info["success"]` when the environment says; otherwise a finished episode with reward >= 1."""
        if "success" in self.info:
            return bool(self.info["success"])
        return self.outcome is Outcome.DONE and self.reward >= 1.0


@dataclass(frozen=True)
class EpisodeSettings:
    max_turns: int
    max_tokens: int  # per reply
    max_model_len: int  # the whole episode
    temperature: float
    top_p: float
    env_timeout_s: float
    partial: bool  # continue stopped turns on the newest version (else they end the episode)

    @classmethod
    def for_adapter(cls, config: "TrainConfig", spec: "AdapterSpec", greedy: bool = False) -> "EpisodeSettings":
        """Training episodes of one adapter, or its greedy held-out episodes (`run.eval_max_tokens`
        per reply, no partial rollouts). `spec.task` is an environment task."""
        sampling, task = spec.sampling, spec.task
        assert task.type == "env", f"{spec.name}: not an environment task"
        return cls(max_turns=task.max_turns, max_tokens=spec.eval_max_tokens if greedy else sampling.max_new_tokens,
                   max_model_len=config.generator.max_model_len,
                   temperature=0.0 if greedy else sampling.temperature, top_p=1.0 if greedy else sampling.top_p,
                   env_timeout_s=task.env_timeout_s, partial=config.buffer.partial_rollouts and not greedy)


async def call_env(fn: Callable[..., Any], *args: Any, timeout_s: float, what: str) -> Any:
    """Call a user's environment method (plain or async) with a time limit (`guarded.call_guarded`:
    a plain one on a thread of its own, left behind if it hangs); its fault is an EpisodeError."""
    result = await call_guarded(fn, *args, timeout_s=timeout_s, what=what)
    if result.timed_out:
        raise EpisodeError(f"{what} timed out after {timeout_s:g}s")
    if not result.ok:
        raise EpisodeError(f"{what} raised {result.message}") from result.exception
    return result.value


class Episode:
    """Plays one environment to its end on one adapter."""

    def __init__(self, env: EnvLike, renderer: ChatRenderer, toolbox: ToolBox | None, settings: EpisodeSettings,
                 generate: Generate, adapter: str | None,
                 tag: object, group: object = None, waits: Waits = NO_WAITS, seed: int | None = None) -> None:
        """`tag` goes on every request (the orchestrator's rollout tag: what `abort_older` stops);
        so does `group`, shared by the episodes of one group (a generator with replicas keeps
        them, turn after turn, on one replica). Environment and tool calls are timed in `waits`.
        `seed` seeds the episode's sampling, each request with its own (`rollout.sub_seed`)."""
        self.env, self.renderer, self.toolbox, self.settings = env, renderer, toolbox, settings
        self.generate, self.adapter, self.tag, self.group = generate, adapter, tag, group
        self.waits, self.seed = waits, seed
        self.requests = 0
        self.tokenizer = renderer.tokenizer

    async def play(self) -> Trajectory:
        """The whole episode. Raises EpisodeError if the environment fails before it opens and
        EpisodeAborted if generation cannot go on; anything later ends it with `outcome`."""
        with self.waits.timed(Wait.ENV):
            opening = await call_env(self.env.reset, timeout_s=self.settings.env_timeout_s, what="reset")
        check_messages(opening, "reset")
        messages = self.renderer.with_system(opening)
        traj = Trajectory(self.renderer.opening(opening), messages=messages, opened=len(messages))
        try:
            await self._turns(traj)
        except ContextFull:
            traj.outcome, traj.reward = Outcome.TRUNCATED, 0.0
        except EpisodeError as exc:
            traj.outcome, traj.error, traj.reward = Outcome.ENV_ERROR, str(exc), 0.0
        return traj

    async def _turns(self, traj: Trajectory) -> None:
        s = self.settings
        for turn in range(1, s.max_turns + 1):
            reply_ids, finish = await self._reply(traj)
            traj.turns = turn
            text = text_of(self.tokenizer.decode(reply_ids, skip_special_tokens=True))
            traj.messages.append({"role": "assistant", "content": text})
            reply, tool_messages = await self._use_tools(text, turn, finish == "length", traj)
            with self.waits.timed(Wait.ENV):
                result = await call_env(self.env.step, reply, timeout_s=s.env_timeout_s, what="step")
            if not isinstance(result, StepResult):
                raise EpisodeError(f"step returned {type(result).__name__}, not a StepResult")
            check_messages(result.messages, "step")
            traj.reward, traj.info = float(result.reward), dict(result.info)
            if result.done:
                traj.outcome = Outcome.DONE
                return
            if turn == s.max_turns:
                traj.outcome = Outcome.MAX_TURNS
                return
            new = tool_messages + list(result.messages)
            delta = self.renderer.delta(new, reply_ids)
            if traj.length + len(delta) >= s.max_model_len:
                raise ContextFull()
            traj.context(delta)
            traj.messages.extend(new)

    async def _reply(self, traj: Trajectory) -> tuple[list[int], str]:
        """One reply, on the newest version; a stopped turn continues where it was cut."""
        s = self.settings

        def request(prompt: list[int], room: int) -> GenRequest:
            self.requests += 1
            return GenRequest(prompt, self.adapter, n=1, max_tokens=room, temperature=s.temperature, top_p=s.top_p,
                              tag=self.tag, keep_partial=s.partial, group=self.group,
                              seed=sub_seed(self.seed, self.requests))

        return await sample_reply(traj, s, self.generate, request)

    async def _use_tools(self, text: str, turn: int, truncated: bool,
                         traj: Trajectory) -> tuple[Reply, list[Message]]:
        """Parse and run the reply's tool calls, all at once; their results, in call order, are
        the next messages."""
        toolbox = self.toolbox
        if toolbox is None:
            return Reply(text, text.strip(), [], [], turn, truncated), []
        calls, errors = parse_tool_calls(text)

        async def timed(call: ToolCall) -> ToolResult:
            with self.waits.timed(Wait.TOOL):
                return await toolbox.run(call)

        results = list(await asyncio.gather(*(timed(call) for call in calls)))
        results += [ToolResult(None, message, error=True) for message in errors]
        traj.tool_calls += len(calls)
        traj.tool_errors += sum(r.error for r in results)
        reply = Reply(text, strip_tool_calls(text), calls, results, turn, truncated)
        return reply, [{"role": "tool", "content": r.content} for r in results]


async def sample_reply(traj: Trajectory, settings: EpisodeSettings, generate: Generate,
                       request: Callable[[list[int], int], GenRequest], trained: bool = True) -> tuple[list[int], str]:
    """One reply on `traj`'s context: its token ids and finish reason. `request(prompt, room)`
    builds each request. A turn a learner step stopped (`GenStatus.STOPPED`) keeps its tokens and
    goes on from there on the newest version. Raises ContextFull when no token fits, and
    EpisodeAborted when generation cannot go on. `trained=False`: a frozen seat's reply."""
    reply: list[int] = []
    while True:
        room = min(settings.max_tokens - len(reply), settings.max_model_len - traj.length)
        if room < 1:
            if not reply:
                raise ContextFull()
            return reply, "length"
        result = await generate(request(traj.prompt_ids + traj.ids, room))
        sample = result.samples[0] if result.samples else None
        if result.status is GenStatus.STOPPED and sample is not None and result.version is not None:
            traj.sampled(sample.token_ids, sample.logprobs, result.version, trained)
            reply += sample.token_ids
            traj.resumed_turns += 1
            traj.tokens_reprefilled += traj.length
            continue
        if not result.ok or sample is None:
            raise EpisodeAborted(result)
        traj.sampled(sample.token_ids, sample.logprobs, result.version if result.version is not None else -1, trained)
        return reply + sample.token_ids, sample.finish_reason


def check_messages(messages: Any, what: str) -> None:
    ok = isinstance(messages, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                            and isinstance(m.get("content", ""), str) for m in messages)
    if not ok:
        raise EpisodeError(f"{what} must return a list of {{'role': str, 'content': str}} messages")
