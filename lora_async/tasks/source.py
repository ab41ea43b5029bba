"""A single-turn task as a rollout source: a problem set (`problems.Task`) and its reward.

A training group is ONE request of `samples_per_prompt` completions of one problem, so the
shared prompt is prefilled once; the completions are scored together by the task's rewards,
all at once (`rewards.Rewards`: user functions run in worker pools and may take their time;
the event loop only awaits them). Held-out evaluation is one greedy completion per problem,
every problem scored at once.

With partial rollouts (`RolloutContext.partial`), a group that a learner step stops comes back
with what it drew (`GenStatus.STOPPED`): the completions that had finished are kept as they are,
and each unfinished one goes on from its last token on the newest version (one request of one
completion, the prompt and the tokens so far prefilled again; stopped again, it goes on again),
all at once. Every token keeps the version and the behaviour logprob it was drawn with
(`TrainSample.versions`). Each continuation counts as a resumed turn (`EpisodeStats.resumed_turns`,
`tokens_reprefilled`: the keys environments report their continued turns under).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from ..buffer import Group, TrainSample, group_advantages
from ..config import SamplingConfig
from ..generator.types import GenRequest, GenResult, GenStatus, Sample
from ..league import League
from ..outcomes import EpisodeStats
from ..rollout import EVAL_EXAMPLES, EvalResult, Generate, GroupRollout, RewardStats, RolloutContext, sub_seed
from ..tokenizer import Tokenizer, text_of
from .problems import Problem, Task, render_prompt

GREEDY = 0.0  # vLLM treats temperature 0 as greedy decoding
UNFINISHED = "abort"  # the finish_reason of a completion a stopped request had not finished


@dataclass
class Drawn:
    """One completion as drawn so far, possibly over several versions: each token's behaviour
    logprob and version, and how it ended (`UNFINISHED`: not yet)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = UNFINISHED
    last_version: int = 0  # the version of its latest piece (an empty completion's only one)

    def add(self, sample: Sample, version: int) -> None:
        self.token_ids += sample.token_ids
        self.logprobs += sample.logprobs
        self.versions += [version] * len(sample.token_ids)
        self.finish_reason, self.last_version = sample.finish_reason, version

    @property
    def finished(self) -> bool:
        return self.finish_reason != UNFINISHED

    def train_sample(self, adapter: str, prompt_ids: list[int], reward: float, advantage: float) -> TrainSample:
        """As trained: its version is the oldest token's; per-token versions only where they differ."""
        spans = len(set(self.versions)) > 1
        return TrainSample(adapter, min(self.versions, default=self.last_version), prompt_ids, self.token_ids,
                           self.logprobs, reward, advantage, self.finish_reason,
                           versions=list(self.versions) if spans else None)


class SingleTurnSource:
    """`rollout.RolloutSource` over a problem set, for one adapter."""

    def __init__(self, task: Task, adapter: str, sampling: SamplingConfig, eval_max_tokens: int) -> None:
        self.task, self.adapter, self.sampling, self.eval_max_tokens = task, adapter, sampling, eval_max_tokens

    @property
    def stats(self) -> RewardStats:
        return self.task.stats

    @property
    def heldout_size(self) -> int:
        return len(self.task.heldout())

    def describe(self) -> str:
        return self.task.describe()

    async def rollout(self, index: int, ctx: RolloutContext) -> GroupRollout:
        task, sampling = self.task, self.sampling
        problem = task.train_problem(index)
        prompt_ids = render_prompt(ctx.tokenizer, problem.prompt, task.system_prompt)
        group_key = (self.adapter, index) if ctx.partial else None  # continuations stay on its replica
        result = await ctx.generate(GenRequest(prompt_ids, self.adapter, n=sampling.samples_per_prompt,
                                               max_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                               top_p=sampling.top_p, tag=ctx.tag, keep_partial=ctx.partial,
                                               group=group_key, seed=ctx.seed))
        resumed = EpisodeStats()
        if result.version is None or not (result.ok or (ctx.partial and result.status is GenStatus.STOPPED)):
            return GroupRollout.failed(result)
        stopped = result.status is GenStatus.STOPPED  # its completions not begun yet are not in it
        drawn = [Drawn() for _ in range(sampling.samples_per_prompt if stopped else len(result.samples))]
        for d, s in zip(drawn, result.samples):
            d.add(s, result.version)
        failures = await asyncio.gather(*(self._finish(i, d, prompt_ids, group_key, ctx, resumed)
                                          for i, d in enumerate(drawn) if not d.finished))
        failed = next((f for f in failures if f is not None), None)
        if failed is not None:
            return GroupRollout.failed(failed, episodes=resumed)
        completion_ids = [d.token_ids for d in drawn]
        texts = ctx.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        scores = await task.rewards.score(problem.batch(texts, completion_ids), ctx.waits)
        rewards = scores.rewards
        samples = [d.train_sample(self.adapter, prompt_ids, r, a)
                   for d, r, a in zip(drawn, rewards, group_advantages(rewards))]
        reported = resumed if resumed.resumed_turns else None
        group = Group(self.adapter, min(s.version for s in samples), index, samples, episodes=reported,
                      reward_parts=scores.parts)
        return GroupRollout(group, tokens=sum(len(ids) for ids in completion_ids), episodes=resumed,
                            fault=None if scores.fault is None else f"the reward failed: {scores.fault}")

    async def _finish(self, which: int, drawn: Drawn, prompt_ids: list[int], group_key: object,
                      ctx: RolloutContext, resumed: EpisodeStats) -> GenResult | None:
        """Draw the rest of the group's stopped completion `which` on the newest version, as often
        as it is stopped again; each continuation is counted in `resumed`. The result that failed
        it, or None."""
        sampling = self.sampling
        continuations = 0
        while not drawn.finished:
            left = sampling.max_new_tokens - len(drawn.token_ids)
            if left < 1:  # stopped right as it reached the limit
                drawn.finish_reason = "length"
                return None
            prompt = prompt_ids + drawn.token_ids
            resumed.resumed_turns += 1
            resumed.tokens_reprefilled += len(prompt)
            continuations += 1
            result = await ctx.generate(GenRequest(prompt, self.adapter, n=1, max_tokens=left,
                                                   temperature=sampling.temperature, top_p=sampling.top_p,
                                                   tag=ctx.tag, keep_partial=True, group=group_key,
                                                   seed=sub_seed(ctx.seed, which, continuations)))
            stopped = result.status is GenStatus.STOPPED
            if not (result.ok or stopped) or (result.ok and len(result.samples) != 1):
                return result
            if result.samples:  # a continuation stopped before its first token has none
                if result.version is None:
                    return result
                drawn.add(result.samples[0], result.version)
        return None

    async def evaluate(self, generate: Generate, tokenizer: Tokenizer, adapter: str | None, limit: int = 0,
                       done: Callable[[], None] | None = None) -> EvalResult:
        task = self.task
        problems = task.heldout()[: limit or None]

        async def one(problem: Problem) -> tuple[GenResult, str, float]:
            """Generate greedily and score (each problem as soon as its answer is in)."""
            result = await generate(GenRequest(render_prompt(tokenizer, problem.prompt, task.system_prompt), adapter,
                                               n=1, max_tokens=self.eval_max_tokens, temperature=GREEDY))
            if not result.ok or not result.samples:
                raise RuntimeError(f"evaluation request failed ({result.status.value}): {result.error}")
            text = text_of(tokenizer.decode(result.samples[0].token_ids, skip_special_tokens=True))
            scored = await task.rewards.score(problem.batch([text], [result.samples[0].token_ids]))
            if done is not None:
                done()
            return result, text, scored.rewards[0]

        answered = await asyncio.gather(*(one(p) for p in problems))
        results, texts, rewards = [a[0] for a in answered], [a[1] for a in answered], [a[2] for a in answered]
        n = len(rewards)
        return EvalResult(adapter=adapter, version=results[-1].version if results else None,
                          accuracy=sum(r >= 1.0 for r in rewards) / n if n else 0.0,
                          mean_reward=sum(rewards) / n if n else 0.0, n=n,
                          examples=[(p.text, t, p.answer) for p, t in zip(problems[:EVAL_EXAMPLES], texts)])

    league: League | None = None  # only a game against past versions has one (`envs.games`)

    def pinned(self) -> list[tuple[str, int]]:
        return []

    async def probe_prompt(self, tokenizer: Tokenizer) -> list[int] | None:
        """The first held-out problem (or the first training one, without a held-out split)."""
        probe = self.task.heldout()[:1] or [self.task.train_problem(0)]
        return render_prompt(tokenizer, probe[0].prompt, self.task.system_prompt)

    def close(self) -> None:
        self.task.close()
