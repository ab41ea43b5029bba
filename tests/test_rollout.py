"""The rollout-source contract (`lora_async.rollout`): both kinds of source, driven as the
orchestrator drives them, against the fakes (tests/fakes.py); what a group came to counted by
the producers (`orchestrator.rollouts.record`); and `EpisodeStats`, its rows and checkpoints."""

from __future__ import annotations

import asyncio
import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from lora_async.config import TrainConfig
from lora_async.generator.types import GenRequest, GenResult, GenStatus, Sample, generate_async
from lora_async.orchestrator.rollouts import ROLLOUT_TAG, record
from lora_async.orchestrator.rows import episode_figures
from lora_async.orchestrator.state import AdapterRun, Counters
from lora_async.outcomes import EpisodeStats, Outcome
from lora_async.rollout import GroupRollout, RolloutContext
from lora_async.tasks import make_source

from .fakes import ByteTokenizer, FakeGenerator
from .helpers import wait_for_async

ENVS = '''
from lora_async.envs import Env, StepResult, user


class Echo(Env):
    """Ends when the model says "x...", after `max_turns` replies at most; reward 1 for an "x"."""

    def __init__(self, index):
        self.index = index

    def reset(self):
        return [user(f"problem {self.index}")]

    def step(self, reply):
        if reply.content.startswith("x"):
            return StepResult(reward=1.0, done=True)
        return StepResult([user("again")])


class Broken(Echo):
    def step(self, reply):
        raise RuntimeError("the environment exploded")


def make(index, split):
    return Echo(index)


def broken(index, split):
    return Broken(index)
'''


@pytest.fixture
def env_module(tmp_path, monkeypatch):
    (tmp_path / "contract_envs.py").write_text(ENVS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "contract_envs"
    sys.modules.pop("contract_envs", None)


def single_turn(tmp_path: Path, reward: str = "regex:^x") -> TrainConfig:
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"item {i}", "answer": "-"}) for i in range(10)))
    return TrainConfig.model_validate({
        "sampling": {"samples_per_prompt": 4, "max_new_tokens": 8}, "run": {"eval_max_tokens": 5},
        "task": {"type": "jsonl", "path": str(data), "reward": reward, "heldout": 3}})


def environment(factory: str) -> TrainConfig:
    return TrainConfig.model_validate({
        "sampling": {"samples_per_prompt": 4, "max_new_tokens": 8}, "generator": {"max_model_len": 512},
        "task": {"type": "env", "env": factory, "max_turns": 3, "heldout": 2, "env_timeout_s": 5.0}})


class Recorder:
    """The generator a source sees: the fake's, with every request kept (or a fixed status)."""

    def __init__(self, fake: FakeGenerator, status: GenStatus | None = None) -> None:
        self.generate = generate_async(fake)
        self.status = status
        self.requests: list[GenRequest] = []

    def __call__(self, request: GenRequest) -> asyncio.Future:
        self.requests.append(request)
        if self.status is None:
            return self.generate(request)
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        done.set_result(GenResult.failed(request, self.status, f"{self.status.value} here", 3))
        return done


def fake_generator(reply=None) -> FakeGenerator:
    fake = FakeGenerator(lambda: 0.0, [], reply=reply)
    fake.live["main"] = [0]
    return fake


def alternating(request, rng):
    """x, y, x, y ... per call: every group of 4 has two of each (a reward signal)."""
    alternating.calls = getattr(alternating, "calls", 0) + 1
    return "xabc" if alternating.calls % 2 else "yabc"


def test_a_single_turn_group_is_one_request_of_n_samples_scored_together(tmp_path):
    source = make_source(single_turn(tmp_path).adapter_specs[0], single_turn(tmp_path), seed=0)
    generate = Recorder(fake_generator(alternating))
    rollout = asyncio.run(source.rollout(7, RolloutContext(generate, ByteTokenizer(), ROLLOUT_TAG)))
    (request,) = generate.requests  # the shared prompt is sent (and prefilled) once
    assert request.n == 4 and request.max_tokens == 8 and request.tag == ROLLOUT_TAG and request.adapter == "main"
    group = rollout.group
    assert rollout.status is GenStatus.OK and group is not None and group.problem_index == 7
    assert sorted(s.reward for s in group.samples) == [0.0, 0.0, 1.0, 1.0] and group.informative
    assert all(s.prompt_ids == request.prompt_ids and s.version == 0 for s in group.samples)
    assert rollout.tokens == 16 and rollout.episodes == EpisodeStats() and rollout.fault is None
    source.close()


@pytest.mark.parametrize("status", [GenStatus.ABORTED_STALE, GenStatus.ENGINE_DEAD, GenStatus.EVICTED])
def test_a_group_that_did_not_complete_says_why(tmp_path, status):
    source = make_source(single_turn(tmp_path).adapter_specs[0], single_turn(tmp_path), seed=0)
    ctx = RolloutContext(Recorder(fake_generator(), status), ByteTokenizer(), ROLLOUT_TAG)
    rollout = asyncio.run(source.rollout(0, ctx))
    assert rollout.group is None and rollout.status is status and rollout.tokens == 0
    assert rollout.error == f"{status.value} here"
    source.close()


Piece = tuple[str, list[float], str]  # text (bytes are the token ids), behaviour logprobs, finish_reason


class Scripted:
    """A generator that answers from a script: what follows the group's prompt in a request's
    prompt (b"" for the group's own request, b"ab" for a completion continued after "ab") to the
    results it gets, in order. Records every request and how many were in flight at once."""

    def __init__(self, script: dict[bytes, list[tuple[GenStatus, int, list[Piece]]]]) -> None:
        self.script = {tail: list(results) for tail, results in script.items()}
        self.requests: list[GenRequest] = []
        self.running = self.most_running = 0

    async def __call__(self, request: GenRequest) -> GenResult:
        self.requests.append(request)
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        await asyncio.sleep(0.01)
        self.running -= 1
        status, version, pieces = self.script[bytes(request.prompt_ids[len(self.requests[0].prompt_ids):])].pop(0)
        samples = [Sample(list(text.encode()), logprobs, finish) for text, logprobs, finish in pieces]
        return GenResult(request, request.adapter, version, samples, status, None if status is GenStatus.OK else "!")


def partial_rollout(tmp_path: Path, generate, partial: bool = True) -> GroupRollout:
    config = single_turn(tmp_path, reward="regex:z$")  # scored on the completion's end: decoded whole
    source = make_source(config.adapter_specs[0], config, seed=0)
    try:
        return asyncio.run(source.rollout(5, RolloutContext(generate, ByteTokenizer(), ROLLOUT_TAG, partial=partial)))
    finally:
        source.close()


OK, STOPPED = GenStatus.OK, GenStatus.STOPPED


def test_a_stopped_single_turn_group_continues_its_unfinished_completions_on_the_newest_version(tmp_path):
    generate = Scripted({
        b"": [(STOPPED, 3, [("xz", [-0.1, -0.2], "stop"), ("ab", [-0.3, -0.4], "abort"),
                            ("y", [-0.5], "stop"), ("cd", [-0.6, -0.7], "abort")])],
        b"ab": [(OK, 4, [("cz", [-1.1, -1.2], "stop")])],
        b"cd": [(OK, 4, [("e", [-1.3], "stop")])]})
    rollout = partial_rollout(tmp_path, generate)
    first, *continued = generate.requests
    prompt = first.prompt_ids
    assert first.n == 4 and first.keep_partial and first.max_tokens == 8
    # one request of one completion per unfinished one, all at once, from its tokens so far
    assert [bytes(r.prompt_ids[len(prompt):]) for r in continued] == [b"ab", b"cd"] and generate.most_running == 2
    assert all((r.n, r.max_tokens, r.keep_partial, r.tag, r.temperature, r.top_p, r.adapter) ==
               (1, 6, True, ROLLOUT_TAG, first.temperature, first.top_p, "main") for r in continued)
    group = rollout.group
    assert rollout.status is GenStatus.OK and group is not None and group.version == 3
    got = [(bytes(s.completion_ids), s.version, s.versions, s.logprobs, s.finish_reason) for s in group.samples]
    assert got == [(b"xz", 3, None, [-0.1, -0.2], "stop"),  # finished before the stop: as it was
                   (b"abcz", 3, [3, 3, 4, 4], [-0.3, -0.4, -1.1, -1.2], "stop"),
                   (b"y", 3, None, [-0.5], "stop"),
                   (b"cde", 3, [3, 3, 4], [-0.6, -0.7, -1.3], "stop")]
    assert all(s.prompt_ids == prompt for s in group.samples)
    assert [s.reward for s in group.samples] == [1.0, 1.0, 0.0, 0.0]  # "abcz" scored whole
    assert rollout.tokens == 10
    assert (rollout.episodes.resumed_turns, rollout.episodes.tokens_reprefilled) == (2, 2 * (len(prompt) + 2))
    assert rollout.episodes.episodes == 0 and group.episodes == rollout.episodes


def test_a_continuation_stopped_again_goes_on_and_a_completion_not_begun_starts_over(tmp_path):
    generate = Scripted({
        b"": [(STOPPED, 3, [("xz", [-0.1, -0.2], "stop"), ("q", [-0.3], "stop"), ("ab", [-0.4, -0.5], "abort")]),
              (OK, 4, [("wz", [-0.6, -0.7], "stop")])],  # the fourth completion, not begun when stopped
        b"ab": [(STOPPED, 4, [("c", [-0.8], "abort")])],
        b"abc": [(OK, 5, [("z", [-0.9], "stop")])]})
    rollout = partial_rollout(tmp_path, generate)
    prompt = generate.requests[0].prompt_ids
    assert [(bytes(r.prompt_ids[len(prompt):]), r.max_tokens) for r in generate.requests[1:]] == [
        (b"ab", 6), (b"", 8), (b"abc", 5)]
    group = rollout.group
    assert group is not None
    got = [(bytes(s.completion_ids), s.version, s.versions, s.logprobs) for s in group.samples]
    assert got == [(b"xz", 3, None, [-0.1, -0.2]), (b"q", 3, None, [-0.3]),
                   (b"abcz", 3, [3, 3, 4, 5], [-0.4, -0.5, -0.8, -0.9]), (b"wz", 4, None, [-0.6, -0.7])]
    assert (rollout.episodes.resumed_turns, rollout.episodes.tokens_reprefilled) == (
        3, (len(prompt) + 2) + len(prompt) + (len(prompt) + 3))


@pytest.mark.parametrize("status", [GenStatus.ENGINE_DEAD, GenStatus.EVICTED])
def test_a_continuation_that_fails_fails_the_group(tmp_path, status):
    generate = Scripted({
        b"": [(STOPPED, 3, [("xz", [-0.1, -0.2], "stop"), ("ab", [-0.3, -0.4], "abort"),
                            ("y", [-0.5], "stop"), ("cd", [-0.6, -0.7], "abort")])],
        b"ab": [(OK, 4, [("cz", [-1.1, -1.2], "stop")])],
        b"cd": [(status, 4, [])]})
    rollout = partial_rollout(tmp_path, generate)
    assert rollout.group is None and rollout.status is status and rollout.error == "!"
    assert rollout.episodes.resumed_turns == 2  # counted all the same


def test_without_partial_rollouts_a_stopped_group_is_dropped_as_before(tmp_path):
    generate = Scripted({b"": [(STOPPED, 3, [("ab", [-0.3, -0.4], "abort")] * 4)]})
    rollout = partial_rollout(tmp_path, generate, partial=False)
    (request,) = generate.requests  # nothing continued
    assert not request.keep_partial and request.group is None
    assert rollout.group is None and rollout.status is STOPPED and rollout.episodes == EpisodeStats()


@pytest.mark.parametrize("partial", [True, False])
def test_a_single_turn_group_cut_short_by_a_step(tmp_path, partial):
    """Against the fake engine: `abort_older` while the group generates. With partial rollouts it
    comes back stopped (the fake keeps one completion's first half; the others had not begun) and
    goes on on the newest version; without, the group is dropped as stale."""
    delays = iter([60.0])  # the group's request generates until the step stops it; the rest 0.1 s
    fake = FakeGenerator(lambda: next(delays, 0.1), [], reply=lambda request, rng: "xabc")
    fake.live["main"] = [0]
    config = single_turn(tmp_path)
    source = make_source(config.adapter_specs[0], config, seed=0)
    generate = Recorder(fake)

    async def scenario() -> GroupRollout:
        running = asyncio.create_task(source.rollout(0, RolloutContext(generate, ByteTokenizer(), ROLLOUT_TAG,
                                                                       partial=partial)))
        await wait_for_async(lambda: fake.in_flight("main"), 60, "the group's request to reach the generator")
        fake.live["main"].append(1)  # a step published v1 and stops what v1 leaves outside the window
        fake.abort_older("main", 1, ROLLOUT_TAG)
        return await running

    rollout = asyncio.run(scenario())
    source.close()
    if not partial:
        assert rollout.group is None and rollout.status is GenStatus.ABORTED_STALE and len(generate.requests) == 1
        return
    group = rollout.group
    assert group is not None and [r.n for r in generate.requests] == [4, 1, 1, 1, 1]
    spanning, *fresh = group.samples
    assert bytes(spanning.completion_ids) == b"xabcxabc" and spanning.versions == [0] * 4 + [1] * 4
    assert spanning.logprobs == [-2.0] * 4 + [-1.0] * 4 and spanning.version == 0
    assert all(bytes(s.completion_ids) == b"xabc" and s.version == 1 and s.versions is None for s in fresh)
    assert rollout.episodes.resumed_turns == 4


def test_single_turn_evaluation_is_greedy_one_request_per_held_out_problem(tmp_path):
    config = single_turn(tmp_path)
    source = make_source(config.adapter_specs[0], config, seed=0)
    generate = Recorder(fake_generator(lambda request, rng: "x42"))
    result = asyncio.run(source.evaluate(generate, ByteTokenizer(), "main", limit=2))
    assert [(r.n, r.temperature, r.max_tokens, r.tag) for r in generate.requests] == [(1, 0.0, 5, None)] * 2
    assert (result.n, result.accuracy, result.mean_reward, result.version, result.extra) == (2, 1.0, 1.0, 0, {})
    assert source.heldout_size == 3
    probe = asyncio.run(source.probe_prompt(ByteTokenizer()))
    assert bytes(probe).decode() == "item 7\n"  # the first held-out record (the last 3 of 10)
    source.close()


def test_an_environment_group_is_n_episodes_played_at_once(env_module):
    config = environment(f"{env_module}:make")
    source = make_source(config.adapter_specs[0], config, seed=0)
    generate = Recorder(fake_generator(alternating))
    rollout = asyncio.run(source.rollout(2, RolloutContext(generate, ByteTokenizer(), ROLLOUT_TAG)))
    group = rollout.group
    assert rollout.status is GenStatus.OK and group is not None and len(group.samples) == 4
    assert all(r.n == 1 and r.tag == ROLLOUT_TAG and r.group == ("main", 2) for r in generate.requests)
    stats = rollout.episodes
    assert stats.episodes == 4 and group.episodes == stats
    assert stats.turns == len(generate.requests) and rollout.tokens == sum(s.trained_tokens for s in group.samples)
    assert all(s.finish_reason in (Outcome.DONE, Outcome.MAX_TURNS) for s in group.samples)
    assert all(s.reward == (1.0 if s.finish_reason == Outcome.DONE else 0.0) for s in group.samples)
    source.close()


def test_a_broken_environment_scores_nothing_and_shows_its_fault(env_module):
    config = environment(f"{env_module}:broken")
    source = make_source(config.adapter_specs[0], config, seed=0)
    rollout = asyncio.run(source.rollout(0, RolloutContext(Recorder(fake_generator()), ByteTokenizer(), ROLLOUT_TAG)))
    assert rollout.group is None and rollout.status is GenStatus.FAILED  # fewer than two scored episodes
    assert rollout.episodes.env_errors == 4 and source.stats.errors == 4
    assert rollout.fault is not None and "the environment failed" in rollout.fault and "exploded" in rollout.fault
    source.close()


def test_an_environment_group_aborted_as_stale_is_dropped(env_module):
    config = environment(f"{env_module}:make")
    source = make_source(config.adapter_specs[0], config, seed=0)
    ctx = RolloutContext(Recorder(fake_generator(), GenStatus.ABORTED_STALE), ByteTokenizer(), ROLLOUT_TAG)
    rollout = asyncio.run(source.rollout(0, ctx))
    assert rollout.group is None and rollout.status is GenStatus.ABORTED_STALE and rollout.tokens == 0
    source.close()


def test_environment_evaluation_plays_greedy_held_out_episodes(env_module):
    config = environment(f"{env_module}:make")
    source = make_source(config.adapter_specs[0], config, seed=0)
    generate = Recorder(fake_generator(lambda request, rng: "x"))
    result = asyncio.run(source.evaluate(generate, ByteTokenizer(), "main"))
    assert result.n == 2 and result.accuracy == 1.0 and all(r.temperature == 0.0 for r in generate.requests)
    assert result.extra == {"turns_mean": 1.0, "tool_calls_mean": 0.0, "tool_call_rate": 0.0, "env_errors": 0,
                            "truncated_episodes": 0}
    assert result.examples[0] == ("problem 0", "[assistant] x", "done, reward 1")
    assert bytes(asyncio.run(source.probe_prompt(ByteTokenizer()))).decode() == "user: problem 0\nassistant: "
    source.close()


def producer(tmp_path: Path) -> tuple[AdapterRun, SimpleNamespace, io.StringIO]:
    config = single_turn(tmp_path)
    out = io.StringIO()
    run = SimpleNamespace(console=Console(file=out, width=200), errors=[])
    run.fail = run.errors.append
    adapter = AdapterRun(config.adapter_specs[0], SimpleNamespace(), SimpleNamespace())
    return adapter, run, out


def test_the_producer_counts_what_each_group_came_to(tmp_path):
    adapter, run, out = producer(tmp_path)
    episodes = EpisodeStats(episodes=2, env_errors=1)
    fault = "the reward failed: boom"
    assert record(run, adapter, GroupRollout(None, GenStatus.ABORTED_STALE)) is None
    assert record(run, adapter, GroupRollout(None, GenStatus.FAILED, tokens=5, episodes=episodes, fault=fault)) is None
    assert record(run, adapter, GroupRollout(None, GenStatus.REFUSED, fault=fault)) is None
    c = adapter.counters
    assert (c.aborted_stale, c.groups_failed, c.tokens_generated, c.episode_stats.episodes) == (1, 2, 5, 2)
    assert out.getvalue().count("main: the reward failed: boom") == 1  # the first fault once, at once
    assert run.errors == []
    record(run, adapter, GroupRollout(None, GenStatus.ENGINE_DEAD, "engine died"))
    assert "the vLLM engine died: engine died" in str(run.errors[0]) and c.groups_failed == 2


def test_single_turn_continuations_reach_the_rows_under_the_episodes_keys(tmp_path):
    adapter, run, _ = producer(tmp_path)
    assert episode_figures(adapter) == {}  # a single-turn task without continuations: nothing
    resumed = EpisodeStats(resumed_turns=2, tokens_reprefilled=30)
    record(run, adapter, GroupRollout(None, GenStatus.ENGINE_DEAD, episodes=resumed))
    record(run, adapter, GroupRollout(None, GenStatus.ENGINE_DEAD, episodes=resumed))
    adapter.pulled_episodes = EpisodeStats(resumed_turns=2, tokens_reprefilled=30)  # the step's groups
    assert episode_figures(adapter) == {"resumed_turns": 2, "tokens_reprefilled": 30,
                                        "resumed_turns_total": 4, "tokens_reprefilled_total": 60}


def test_episode_stats_merge_and_rows():
    a = EpisodeStats(episodes=2, successes=1, turns=5, turns_max=3, tool_calls=2, tool_users=1, tokens=40,
                     tokens_max=30, version_span=1, version_span_max=1, resumed_turns=1, tokens_reprefilled=12,
                     env_errors=0, truncated_episodes=1, tool_errors=1)
    b = EpisodeStats(episodes=2, successes=2, turns=2, turns_max=1, tokens=10, tokens_max=6, env_errors=1)
    total = EpisodeStats()
    total.merge(a)
    total.merge(None)  # a single-turn group has no episodes
    total.merge(b)
    assert (total.episodes, total.turns, total.turns_max, total.tokens_max, total.env_errors) == (4, 7, 3, 30, 1)
    assert total.step_figures() == {
        "episodes": 4, "success_rate": 0.75, "turns_mean": 1.75, "turns_max": 3, "tool_calls_mean": 0.5,
        "tool_call_rate": 0.25, "episode_tokens_mean": 12.5, "episode_tokens_max": 30, "version_span_mean": 0.25,
        "version_span_max": 1, "resumed_turns": 1, "tokens_reprefilled": 12}
    assert total.total_figures() == {"env_errors": 1, "tool_errors": 1, "truncated_episodes": 1,
                                     "resumed_turns_total": 1, "tokens_reprefilled_total": 12}
    assert total.summary_figures() == {"episodes": 4, "env_errors": 1, "truncated_episodes": 1, "tool_calls": 2,
                                       "tool_errors": 1, "resumed_turns": 1, "tokens_reprefilled": 12}
    assert total.eval_figures() == {"turns_mean": 1.75, "tool_calls_mean": 0.5, "tool_call_rate": 0.25,
                                    "env_errors": 1, "truncated_episodes": 1}
    assert EpisodeStats().eval_figures()["turns_mean"] == 0.0  # no episodes: no division by zero


def test_episode_stats_of_trajectories():
    from lora_async.envs.episode import Trajectory

    done = Trajectory([1], ids=[5, 6, 7, 8], trained=[True, False, True, True], versions=[2, -1, 3, 4],
                      reward=1.0, outcome=Outcome.DONE, turns=2, tool_calls=1, resumed_turns=1, tokens_reprefilled=9)
    broken = Trajectory([], outcome=Outcome.ENV_ERROR, error="boom")
    stats = EpisodeStats.of([done, broken])
    assert stats == EpisodeStats(episodes=2, successes=1, turns=2, turns_max=2, tool_calls=1, tool_users=1, tokens=4,
                                 tokens_max=4, version_span=2, version_span_max=2, resumed_turns=1,
                                 tokens_reprefilled=9, env_errors=1)
    assert f"{Outcome.ENV_ERROR}" == "env_error" and json.dumps(Outcome.DONE) == '"done"'


OLD_CHECKPOINT_COUNTERS = {  # `Counters.as_dict` before episode counters were one EpisodeStats
    "groups_started": 40, "groups_failed": 1, "zero_adv_groups": 3, "tokens_generated": 900, "skipped_nonfinite": 0,
    "canary_warnings": 0, "rejected_versions": 2, "aborted_stale": 4, "episodes": 120, "env_errors": 2,
    "truncated_episodes": 5, "tool_calls": 60, "tool_errors": 7, "resumed_turns": 9, "tokens_reprefilled": 800}


def test_checkpointed_counters_keep_their_keys_and_old_checkpoints_resume():
    counters = Counters.from_dict(OLD_CHECKPOINT_COUNTERS)
    assert counters.tokens_generated == 900 and counters.aborted_stale == 4
    assert counters.episode_stats.summary_figures() == {k: OLD_CHECKPOINT_COUNTERS[k] for k in (
        "episodes", "env_errors", "truncated_episodes", "tool_calls", "tool_errors", "resumed_turns",
        "tokens_reprefilled")}
    saved = counters.as_dict()
    assert all(saved[k] == v for k, v in OLD_CHECKPOINT_COUNTERS.items())  # every old key, flat, as before
    assert Counters.from_dict(saved) == counters
    assert Counters.from_dict({"unknown_counter": 1}) == Counters()  # a newer release's key is left out


def test_a_groups_requests_are_seeded_from_the_run_seed_and_its_index(tmp_path, env_module):
    """Two runs of one seed sample alike (the staleness benchmark pairs its arms so): every request
    of a group carries a seed from (run seed, group index), each episode and turn its own."""
    from lora_async.rollout import sub_seed

    def requests(config: TrainConfig, seed: int | None, index: int) -> list[GenRequest]:
        source = make_source(config.adapter_specs[0], config, seed=0)
        generate = Recorder(fake_generator(alternating))
        asyncio.run(source.rollout(index, RolloutContext(generate, ByteTokenizer(), ROLLOUT_TAG, seed=seed)))
        source.close()
        return generate.requests

    single = single_turn(tmp_path)
    (request,) = requests(single, sub_seed(0, 5), 5)
    assert request.seed == sub_seed(0, 5) and requests(single, sub_seed(0, 5), 5)[0].seed == request.seed
    assert len({sub_seed(0, 5), sub_seed(0, 6), sub_seed(1, 5)}) == 3  # another index or run seed: another seed
    assert requests(single, None, 5)[0].seed is None  # no seed: sampled as vLLM pleases
    played = requests(environment(f"{env_module}:make"), sub_seed(0, 2), 2)
    seeds = [r.seed for r in played]
    assert None not in seeds and len(set(seeds)) == len(seeds) > 4  # every episode and turn its own
    first_turns = {sub_seed(sub_seed(sub_seed(0, 2), episode), 1) for episode in range(4)}
    assert first_turns <= set(seeds)  # episode i's first request, in any run of this seed


def test_the_producers_seed_each_group_from_the_run_seed(tmp_path):
    from lora_async.orchestrator import train
    from lora_async.rollout import sub_seed

    from .fakes import FakeParts

    cfg = single_turn(tmp_path).model_copy(deep=True)
    cfg.run.max_steps, cfg.run.output_dir, cfg.run.progress = 2, str(tmp_path / "out"), False
    cfg.learner.groups_per_step = 1
    seen: list[GenRequest] = []
    parts = FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.01)
    submit = parts.fake_generator.submit

    def recording(request, on_done):
        seen.append(request)
        submit(request, on_done)

    parts.fake_generator.submit = recording  # type: ignore[method-assign]
    asyncio.run(train(cfg, console=Console(file=io.StringIO()), parts=parts))
    rollouts = [r for r in seen if r.tag == ROLLOUT_TAG]
    assert rollouts and all(r.seed is not None for r in rollouts)
    assert {r.seed for r in rollouts} <= {sub_seed(cfg.run.seed, i) for i in range(len(rollouts) + 8)}
