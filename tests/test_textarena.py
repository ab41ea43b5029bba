"""examples/textarena_env.py: textarena's single-player games as environments.

Unit tier: scripted players play whole episodes through the real machinery (the factory loaded
as `task.env` names it in examples/textarena.toml, episodes played by `EnvSource` on a fake
generator and the byte tokenizer, so a player reads the conversation as plain text). Slow tier:
two training steps of the example on the tiny model, through the CLI."""

from __future__ import annotations

import asyncio
import json
import random
import re
import sys
from pathlib import Path
from typing import Callable

import pytest

from lora_async.config import load_config
from lora_async.envs import Reply
from lora_async.envs.episode import Trajectory
from lora_async.envs.source import EnvLoadError, EnvSource, load_object
from lora_async.generator.types import generate_async
from lora_async.outcomes import Outcome
from lora_async.tasks import make_source

from .fakes import ByteTokenizer, FakeGenerator

pytest.importorskip("textarena", reason="textarena is in the dev extra")
from examples import textarena_env  # noqa: E402 - after the skip: it imports textarena

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "examples" / "textarena.toml"
GAME_TURNS = 11  # GuessTheNumber-v0's guesses: its rules say 10, but textarena 0.7.4 checks the limit
# before it counts the turn
RULES = "You are Player 0. You are playing Guess The Number."
FEEDBACK = re.compile(r"assistant: \[(\d+)\]\nuser: The target number is (higher|lower)\.")
Player = Callable[[str], str]  # the conversation so far, as text -> the reply


@pytest.fixture
def source(monkeypatch: pytest.MonkeyPatch):
    """The example's task, as a run builds it; `source(env)` for another of the file's games."""
    monkeypatch.chdir(REPO)  # where `examples.textarena_env` is imported from
    built: list[EnvSource] = []

    def build(env: str = "examples.textarena_env:make") -> EnvSource:
        # bytes are tokens here: room for the rules and every turn
        cfg = load_config(CONFIG, [f"task.env={json.dumps(env)}", "generator.max_model_len=8192"])
        built.append(make_source(cfg.adapter_specs[0], cfg, 0))
        return built[-1]

    yield build
    for s in built:
        s.close()


def play(source: EnvSource, player: Player, index: int = 0, split: str = "train",
         episodes: int = 1) -> list[Trajectory]:
    """`episodes` episodes of game `index`, at once, as a group plays them."""
    generator = FakeGenerator(lambda: 0.0, [], reply=lambda request, rng: player(bytes(request.prompt_ids).decode()))
    generator.live["main"] = [0]
    generate = generate_async(generator)

    async def group() -> list[Trajectory]:
        return await asyncio.gather(*(source.play(index, split, ByteTokenizer(), source.settings, generate, "main",
                                                  "rollout") for _ in range(episodes)))

    return asyncio.run(group())


def binary_search(conversation: str) -> str:
    low, high = map(int, re.search(r"between (\d+) and (\d+)", conversation).groups())
    for guess, hint in FEEDBACK.findall(conversation):
        low, high = (int(guess) + 1, high) if hint == "higher" else (low, int(guess) - 1)
    return f"[{(low + high) // 2}]"


def counting(conversation: str) -> str:
    """Ignores the feedback: 1, 2, 3, ..."""
    return str(conversation.count("\nassistant: "))  # the action wrapper adds the brackets


def secret(index: int, split: str) -> int:
    env = textarena_env.make(index, split)
    env.reset()
    return env.game.game_number


def replies(t: Trajectory) -> list[str]:
    return [m["content"] for m in t.messages[t.opened:] if m["role"] == "assistant"]


def answers(t: Trajectory) -> list[str]:
    """What the environment said after each reply (the last reply's answer ends the episode)."""
    return [m["content"] for m in t.messages[t.opened:] if m["role"] == "user"]


@pytest.mark.parametrize("split", ["train", "eval"])
def test_a_binary_search_wins_with_reward_1(source, split):
    src = source()
    for index in range(4):
        (t,) = play(src, binary_search, index, split)
        assert t.outcome is Outcome.DONE and t.reward == 1.0 and t.info["success"] is True and t.success
        assert t.turns <= 5 < GAME_TURNS  # ceil(log2(20)) guesses
        assert replies(t)[-1] == f"[{secret(index, split)}]"
        assert "Congratulations" in t.info["reason"]


def test_the_model_is_sent_only_what_is_new_each_turn(source):
    (t,) = play(source(), binary_search, index=1)
    assert t.turns >= 3
    assert t.messages[t.opened - 1]["content"].startswith(RULES)
    # every answer is one line of feedback, never the rules or the history again
    assert all(a in ("The target number is higher.", "The target number is lower.") for a in answers(t))
    context = bytes(t.prompt_ids + t.ids).decode()
    assert context.count(RULES) == 1 and context.count("[Player 0]") == 0


def test_a_player_that_never_finds_it_gets_the_games_partial_credit_at_its_turn_limit(source):
    """textarena's reward is kept: at the game's turn limit, how close the last guess came."""
    index = next(i for i in range(50) if secret(i, "train") > GAME_TURNS)  # never reached by 1, 2, ..., 11
    (t,) = play(source(), counting, index)
    assert replies(t) == [str(n) for n in range(1, GAME_TURNS + 1)]
    assert t.outcome is Outcome.DONE and t.info["success"] is False and not t.success
    assert t.reward == pytest.approx(1 - (secret(index, "train") - GAME_TURNS) / 19) and t.reward < 1
    assert "turn limit" in t.info["reason"]


def test_out_of_range_guesses_get_the_games_warning_then_end_it_with_reward_0(source):
    (t,) = play(source(), lambda conversation: "[99]")
    assert t.turns == 2 and t.outcome is Outcome.DONE
    assert t.reward == 0.0 and t.info["success"] is False and t.info["reason"].startswith("Invalid Move")
    (warning,) = answers(t)
    assert "outside the range" in warning and "resubmit" in warning  # the model was told, and went on


def test_a_player_that_runs_out_of_the_configs_turns_scores_0(source):
    """Every other reply is an invalid move the game forgives: the run's max_turns (12) ends the
    episode before the game's 11 guesses are spent, with the reward of an unfinished game: 0."""
    index = next(i for i in range(50) if secret(i, "train") > GAME_TURNS)
    src = source()

    def dawdling(conversation: str) -> str:  # "hmm", 1, "hmm", 2, ...
        turn = conversation.count("\nassistant: ")
        return str(turn // 2) if turn % 2 == 0 else "hmm"

    (t,) = play(src, dawdling, index)
    assert t.turns == src.config.max_turns < 2 * GAME_TURNS
    assert sum("invalid move" in a for a in answers(t)) == t.turns // 2  # each forgiven, as the game says
    assert t.outcome is Outcome.MAX_TURNS and t.reward == 0.0 and not t.success


def test_a_game_is_a_pure_function_of_index_and_split(source):
    train = [secret(i, "train") for i in range(16)]
    assert train == [secret(i, "train") for i in range(16)]
    assert train != [secret(i, "eval") for i in range(16)]
    assert len(set(train)) > 4
    # a group's episodes play at once (their reset and step on threads): all play the same game
    group = play(source(), binary_search, index=5, episodes=8)
    assert len({tuple(replies(t)) for t in group}) == 1 and {t.reward for t in group} == {1.0}
    assert replies(group[0])[-1] == f"[{secret(5, 'train')}]"


def test_a_game_leaves_the_process_random_state_alone():
    random.seed(1234)
    before = random.getstate()
    env = textarena_env.make(0, "train")
    env.reset()  # textarena seeds the global `random` module: the adapter swaps its own state in
    env.step(Reply("[10]", "[10]", [], [], 1))
    assert random.getstate() == before


def test_another_game_the_tower_of_hanoi_is_won_move_by_move(source):
    moves = ["[A C]", "[A B]", "[C B]", "[A C]", "[B A]", "[B C]", "[A C]"]
    (t,) = play(source("examples.textarena_env:tower_of_hanoi"),
                lambda conversation: moves[conversation.count("\nassistant: ") - 1])
    assert t.outcome is Outcome.DONE and t.reward == 1.0 and t.success and replies(t) == moves
    # the opening shows the board once; each answer is the move made and the board after it
    assert t.messages[t.opened - 1]["content"].count("Current Board") == 1
    assert all(a.startswith("You moved disk") and a.count("Current Board") == 1 for a in answers(t))


@pytest.mark.parametrize("factory", ["make", "tower_of_hanoi", "mastermind"])
def test_every_shipped_game_opens_and_warns_about_an_invalid_move(factory):
    env = getattr(textarena_env, factory)(0, "eval")
    (opening,) = env.reset()
    assert opening["role"] == "user" and len(opening["content"]) > 100
    result = env.step(Reply("no idea", "no idea", [], [], 1))
    assert not result.done and "invalid move" in result.messages[0]["content"]


def test_without_textarena_the_env_fails_to_load_in_one_line(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setitem(sys.modules, "textarena", None)  # `import textarena` raises ImportError
    monkeypatch.delitem(sys.modules, "examples.textarena_env")
    with pytest.raises(EnvLoadError, match="needs textarena: pip install textarena") as info:
        load_object("examples.textarena_env:make", "task.env")
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_the_example_trains_two_steps_on_the_tiny_model(tmp_path, tiny_model, monkeypatch):
    from .test_env_train import two_steps_of

    monkeypatch.chdir(REPO)  # the config names `examples.textarena_env`, imported from the working directory
    steps, _, _ = two_steps_of(CONFIG, tiny_model, tmp_path / "textarena")
    assert all("success_rate" in r for r in steps)
