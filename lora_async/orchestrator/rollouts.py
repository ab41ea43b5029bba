"""Rollouts: producers that keep the generator busy, and the admission rule that bounds lag.

Each adapter has its own producers (its weight's share of `generator.groups_in_flight`). A
producer starts a group when admitted, waits for vLLM, scores the completions with the task's
reward (or plays the group's episodes, `episodes.py`), and puts the group in the rollout
buffer, until the run stops.
"""

from __future__ import annotations

import asyncio

from ..buffer import Group, TrainSample, group_advantages
from ..envs.source import EnvSource
from ..generator.types import GenRequest, GenStatus
from ..tasks import render_prompt
from .episodes import make_env_group
from .state import AdapterRun, Run, TrainingError

ADMISSION_POLL_S = 0.25  # producers re-check admission at least this often (stale drops notify no one)
ROLLOUT_TAG = "rollout"  # GenRequest.tag of training rollouts (the only requests cut short as stale)


def may_start(learner_busy: bool, queued_groups: int, groups_per_step: int, max_staleness: int,
              unpublished: int = 0) -> bool:
    """Admission of a new group on the newest *served* version.

    A group started now is sampled on the newest version the generator serves, which is
    `unpublished` versions behind the learner while a hand-off is on its way, and it will be
    trained about `busy + queued // groups_per_step` steps from now: start it only if that lag
    stays within max_staleness (a group started on a version about to be superseded would only
    be dropped as stale). With max_staleness = 0 producers run only while the learner waits for
    data and the generator serves its newest version: synchronous training from the same loop.
    """
    return int(learner_busy) + unpublished + queued_groups // groups_per_step <= max_staleness


def producer_quota(weights: dict[str, float], groups_in_flight: int) -> dict[str, int]:
    """Producers per adapter: groups in flight shared by weight, at least one each."""
    total = sum(weights.values())
    return {name: max(1, round(groups_in_flight * w / total)) for name, w in weights.items()}


def start_producers(run: Run) -> list[asyncio.Task]:
    quota = producer_quota({n: a.spec.weight for n, a in run.adapters.items()},
                           run.config.generator.groups_in_flight)
    return [asyncio.create_task(produce(run, a)) for a in run.adapters.values() for _ in range(quota[a.name])]


async def produce(run: Run, adapter: AdapterRun) -> None:
    """One producer of one adapter. An unexpected error fails the run (a silently dead producer
    would hang it)."""
    try:
        while run.running:
            await admitted(run, adapter)
            if not run.running:
                return
            index = adapter.next_problem
            adapter.next_problem += 1
            adapter.in_flight += 1
            adapter.counters.groups_started += 1
            try:
                group = await make_group(run, adapter, index)
                if group is not None:
                    await run.buffer.put(group)
            finally:
                adapter.in_flight -= 1
                await run.notify()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        run.console.print_exception(show_locals=False)
        run.fail(TrainingError(f"a rollout producer of {adapter.name} failed: {type(exc).__name__}: {exc}"))


async def admitted(run: Run, adapter: AdapterRun) -> None:
    """Wait until a new group of `adapter` may start (or the run stops)."""
    cfg = run.config
    async with run.admission:
        while run.running and not may_start(
                adapter.busy,
                adapter.in_flight + run.buffer.groups(adapter.name) + len(adapter.carry) + adapter.collected,
                adapter.groups_consumed_per_step(cfg.learner.groups_per_step), cfg.buffer.max_staleness,
                unpublished(run, adapter)):
            try:
                await asyncio.wait_for(run.admission.wait(), ADMISSION_POLL_S)
            except asyncio.TimeoutError:
                pass


def unpublished(run: Run, adapter: AdapterRun) -> int:
    """Versions the learner made that the generator does not serve yet (a hand-off on its way;
    a refused version counts until the next one lands, as the generator keeps serving the old)."""
    return max(0, run.learner.version(adapter.name) - adapter.published)


async def make_group(run: Run, adapter: AdapterRun, index: int) -> Group | None:
    """Generate, score and package one group (None when it did not complete): one request of
    `samples_per_prompt` completions for a single-turn task, as many episodes for an environment."""
    if isinstance(adapter.task, EnvSource):
        return await make_env_group(run, adapter, index, ROLLOUT_TAG)
    sampling, task = adapter.spec.sampling, adapter.task
    problem = task.train_problem(index)
    prompt_ids = render_prompt(run.tokenizer, problem.prompt, task.system_prompt)
    request = GenRequest(prompt_ids, adapter.name, n=sampling.samples_per_prompt, max_tokens=sampling.max_new_tokens,
                         temperature=sampling.temperature, top_p=sampling.top_p, tag=ROLLOUT_TAG)
    result = await run.generate(request)
    if result.status is GenStatus.ABORTED_STALE:
        adapter.counters.aborted_stale += 1
        return None
    if result.status is GenStatus.ENGINE_DEAD:
        run.fail(TrainingError(f"the vLLM engine died: {result.error}"))
    if not result.ok:
        adapter.counters.groups_failed += 1
        return None
    texts = run.tokenizer.batch_decode([s.token_ids for s in result.samples], skip_special_tokens=True)
    errors_before = task.stats.errors
    rewards = await asyncio.to_thread(task.rewards, problem, texts)
    if task.stats.errors > errors_before and not adapter.reported_reward_error:
        adapter.reported_reward_error = True  # the first one at once; the count is in the metrics
        run.console.print(f"[red]{adapter.name}: the reward failed: {task.stats.last_error}[/]", highlight=False)
    adapter.counters.tokens_generated += sum(len(s.token_ids) for s in result.samples)
    samples = [TrainSample(adapter.name, result.version, prompt_ids, s.token_ids, s.logprobs, r, a, s.finish_reason)
               for s, r, a in zip(result.samples, rewards, group_advantages(rewards))]
    return Group(adapter.name, result.version, index, samples)  # type: ignore[arg-type]
