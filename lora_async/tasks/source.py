"""A single-turn task as a rollout source: a problem set (`problems.Task`) and its reward.

A training group is ONE request of `samples_per_prompt` completions of one problem, so the
shared prompt is prefilled once; the completions are scored together by the task's rewards,
all at once (`rewards.Rewards`: user functions run in worker pools and may take their time;
the event loop only awaits them). Held-out evaluation is one greedy completion per problem,
every problem scored at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..buffer import Group, TrainSample, group_advantages
from ..config import SamplingConfig
from ..generator.types import GenRequest
from ..rollout import EVAL_EXAMPLES, EvalResult, Generate, GroupRollout, RewardStats, RolloutContext
from .problems import Task, render_prompt

GREEDY = 0.0  # vLLM treats temperature 0 as greedy decoding


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
        result = await ctx.generate(GenRequest(prompt_ids, self.adapter, n=sampling.samples_per_prompt,
                                               max_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                               top_p=sampling.top_p, tag=ctx.tag))
        if not result.ok or result.version is None:
            return GroupRollout.failed(result)
        texts = ctx.tokenizer.batch_decode([s.token_ids for s in result.samples], skip_special_tokens=True)
        scores = await task.rewards.score(problem.batch(texts, [s.token_ids for s in result.samples]), ctx.waits)
        rewards = scores.rewards
        samples = [TrainSample(self.adapter, result.version, prompt_ids, s.token_ids, s.logprobs, r, a, s.finish_reason)
                   for s, r, a in zip(result.samples, rewards, group_advantages(rewards))]
        group = Group(self.adapter, result.version, index, samples, reward_parts=scores.parts)
        return GroupRollout(group, tokens=sum(len(s.token_ids) for s in result.samples),
                            fault=None if scores.fault is None else f"the reward failed: {scores.fault}")

    async def evaluate(self, generate: Generate, tokenizer: Any, adapter: str | None, limit: int = 0) -> EvalResult:
        task = self.task
        problems = task.heldout()[: limit or None]
        requests = [GenRequest(render_prompt(tokenizer, p.prompt, task.system_prompt), adapter, n=1,
                               max_tokens=self.eval_max_tokens, temperature=GREEDY) for p in problems]
        results = await asyncio.gather(*(generate(r) for r in requests))
        failed = next((r for r in results if not r.ok or not r.samples), None)
        if failed is not None:
            raise RuntimeError(f"evaluation request failed ({failed.status.value}): {failed.error}")
        texts = [tokenizer.decode(r.samples[0].token_ids, skip_special_tokens=True) for r in results]
        scored = await asyncio.gather(*(task.rewards.score(p.batch([t], [r.samples[0].token_ids]))
                                        for p, t, r in zip(problems, texts, results)))
        rewards = [s.rewards[0] for s in scored]
        n = len(rewards)
        return EvalResult(adapter=adapter, version=results[-1].version if results else None,
                          accuracy=sum(r >= 1.0 for r in rewards) / n if n else 0.0,
                          mean_reward=sum(rewards) / n if n else 0.0, n=n,
                          examples=[(p.text, t, p.answer) for p, t in zip(problems[:EVAL_EXAMPLES], texts)])

    async def probe_prompt(self, tokenizer: Any) -> list[int] | None:
        """The first held-out problem (or the first training one, without a held-out split)."""
        probe = self.task.heldout()[:1] or [self.task.train_problem(0)]
        return render_prompt(tokenizer, probe[0].prompt, self.task.system_prompt)

    def close(self) -> None:
        self.task.close()
