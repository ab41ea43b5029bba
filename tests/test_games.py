"""Games with seats (lora_async/envs/game.py): the builtin Nim and Relay, and a two-player
textarena game (examples/textarena_env.py), driven through reset / to_move / step the way the
match runner drives them, with hand-written replies and with the games' scripted players.

Unit tier: no model, no engine."""

from __future__ import annotations

import random
from typing import Any, Callable

import pytest

from lora_async.envs.base import Message, Reply
from lora_async.envs.builtin import nim, relay
from lora_async.envs.builtin.nim import Nim, legal_moves, nim_sum, parse_move
from lora_async.envs.builtin.relay import Relay
from lora_async.envs.game import Move, check_game

Chooser = Callable[[str, list[Message]], str]  # (seat, its conversation so far) -> its reply text
REPLY_CAP = 60  # replies per game at most, as the runner caps them: every game here ends well before
SEEDED_GAMES = 200


def reply(text: str, turn: int = 1) -> Reply:
    return Reply(text, text.strip(), [], [], turn)


class Played:
    """One finished game: each seat's conversation and every (seat, move) in order."""

    def __init__(self, conversations: dict[str, list[Message]], history: list[tuple[str, str, Move]]) -> None:
        self.conversations = conversations
        self.history = history  # (seat, its reply, the game's answer)

    @property
    def end(self) -> Move:
        return self.history[-1][2]

    def seen(self, seat: str) -> str:
        """Everything `seat` was shown (its user messages), as one text."""
        return "\n".join(m["content"] for m in self.conversations[seat] if m["role"] == "user")


def drive(game: Any, choose: Chooser) -> Played:
    """Play `game` to its end as the runner does: each seat's conversation is its opening, then its
    own replies and the messages the game addresses to it."""
    conversations = {seat: list(messages) for seat, messages in game.reset().items()}
    assert set(conversations) == set(game.seats)
    turns = {seat: 0 for seat in game.seats}
    history: list[tuple[str, str, Move]] = []
    for _ in range(REPLY_CAP):
        seat = game.to_move()
        text = choose(seat, conversations[seat])
        turns[seat] += 1
        conversations[seat].append({"role": "assistant", "content": text})
        move = game.step(seat, reply(text, turns[seat]))
        for to, messages in move.messages.items():
            conversations[to].extend(messages)
        history.append((seat, text, move))
        if move.done:
            return Played(conversations, history)
    raise AssertionError(f"{type(game).__name__} did not end in {REPLY_CAP} replies")


def scripted(game: Any, by_seat: dict[str, str], rng: random.Random) -> Chooser:
    """Each seat played by the game's scripted player of that name."""
    return lambda seat, _: game.players[by_seat[seat]](game, seat, rng)


def scripted_nim(index: int, first: str, second: str) -> Played:
    game = nim.make(index, "train")
    return drive(game, scripted(game, {"first": first, "second": second}, random.Random(index)))


def other(seat: str) -> str:
    return "second" if seat == "first" else "first"


# --- Nim ---

def test_every_game_fits_the_interface():
    check_game(nim.make(0, "train"), "nim:make")
    check_game(relay.make(0, "train"), "relay:make")
    assert set(Nim.players) == {"random", "optimal", "expert"} and set(Relay.players) == {"copy"}


def test_nim_make_is_a_pure_function_of_index_and_split():
    train = [nim.make(i, "train").heaps for i in range(100)]
    assert train == [nim.make(i, "train").heaps for i in range(100)]
    assert train != [nim.make(i, "eval").heaps for i in range(100)]
    assert {len(h) for h in train} == {2, 3} and {x for h in train for x in h} == {1, 2, 3, 4}


def test_the_seat_that_takes_the_last_object_wins():
    game = Nim([1, 2])
    assert game.to_move() == "first"
    move = game.step("first", reply("take 2 from B"))
    assert not move.done and game.heaps == [1, 0]
    assert move.messages == {"second": [{"role": "user", "content":
                                         "Your opponent took 2 from B. Heaps: A=1 B=0. Your move: take 1 from A."}]}
    assert game.to_move() == "second"
    end = game.step("second", reply("take 1 from A", 1))
    assert end.done and end.winner == "second" and end.rewards == {"second": 1.0, "first": 0.0}
    assert end.info == {"moves": 2, "invalid": None}


@pytest.mark.parametrize("text, expected", [
    ("take 2 from B", ("B", 2)),
    ("B 2", ("B", 2)),
    ("From heap c I take 3.", ("C", 3)),
    ("I take a 1 from C", ("C", 1)),  # the article "a" is not heap A when a capital letter is there
    ("take 1 from heap a", ("A", 1)),
    ("2B", ("B", 2)),
    ("Bob takes 2", None),  # no heap letter standing alone
    ("take two from B", None),  # no number
    ("", None),
])
def test_a_move_is_read_in_either_order(text, expected):
    assert parse_move(text) == expected


def test_a_move_in_the_other_order_is_played():
    game = Nim([3, 3])
    move = game.step("first", reply("Heap B: 2"))
    assert not move.done and game.heaps == [3, 1]


@pytest.mark.parametrize("heaps, before, text, reason", [
    ([2, 3], [], "take 3 from A", "holds 2"),
    ([2, 3], [], "take 0 from A", "cannot take 0"),
    ([2, 3], [], "take -1 from A", "cannot take -1"),
    ([2, 3], [], "take 1 from C", "no heap C"),
    ([2, 3], [], "I think I will pass.", "no move read"),
    ([2, 3, 1], ["take 1 from C"], "take 1 from C", "heap C is empty"),
])
def test_an_invalid_move_loses_at_once(heaps, before, text, reason):
    game = Nim(heaps)
    for made in before:
        assert not game.step(game.to_move(), reply(made)).done
    mover = game.to_move()
    left = list(game.heaps)
    end = game.step(mover, reply(text))
    assert end.done and end.winner == other(mover) and end.messages == {}
    assert end.rewards == {mover: -1.0, other(mover): 1.0}  # costs more than a game lost by play
    assert end.info["invalid"] == mover and reason in end.info["reason"] and end.info["moves"] == len(before)
    assert game.heaps == left
    with pytest.raises(ValueError, match="over"):
        game.step(other(mover), reply("take 1 from A"))


def test_a_seat_cannot_move_out_of_turn():
    game = Nim([2, 2])
    with pytest.raises(ValueError, match="'first'"):
        game.step("second", reply("take 1 from A"))


def test_each_seat_opens_with_the_example_and_its_own_situation():
    game = Nim([3, 1, 2])
    openings = game.reset()
    assert set(openings) == {"first", "second"}
    for messages in openings.values():
        assert [m["role"] for m in messages[:5]] == ["user", "assistant", "user", "assistant", "user"]
        assert all(parse_move(m["content"]) for m in messages if m["role"] == "assistant")
    first, second = openings["first"][-1]["content"], openings["second"][-1]["content"]
    assert "Heaps: A=3 B=1 C=2." in first and first.endswith("Your move: take 1 to 3 from A or 1 from B or 1 to 2 from C.")
    assert "Heaps: A=3 B=1 C=2." in second and "opponent moves first" in second and "Your move" not in second
    openings["first"][0]["content"] = "changed"  # a runner that edits its copy leaves the next game alone
    assert Nim([1, 1]).reset()["first"][0]["content"] != "changed"


def test_messages_go_only_to_the_seat_to_move_next():
    for index in range(50):
        played = scripted_nim(index, "random", "random")
        for seat, _, move in played.history[:-1]:
            assert list(move.messages) == [other(seat)]
        assert played.history[-1][2].messages == {}
        # each seat was told each of the other's moves, and none of its own
        for seat in ("first", "second"):
            opening = len(nim.make(index, "train").reset()[seat])
            told = sum("Your opponent took" in m["content"] for m in played.conversations[seat][opening:])
            assert told == sum(s == other(seat) for s, _, m in played.history if not m.done)


def test_every_scripted_move_is_legal():
    for index in range(SEEDED_GAMES):
        game = nim.make(index, "train")
        rng = random.Random(index)
        names = list(Nim.players)
        by_seat = {"first": names[index % 3], "second": names[(index // 3) % 3]}
        chose: list[tuple[list[int], str]] = []

        def choose(seat: str, _: list[Message]) -> str:
            text = Nim.players[by_seat[seat]](game, seat, rng)
            chose.append((list(game.heaps), text))
            return text

        played = drive(game, choose)
        assert played.end.info["invalid"] is None and played.end.winner is not None
        for heaps, text in chose:
            move = parse_move(text)
            assert move is not None and ("ABC".index(move[0]), move[1]) in legal_moves(heaps)


def test_optimal_play_wins_every_winning_start_against_random():
    winning = [i for i in range(2 * SEEDED_GAMES) if nim_sum(nim.make(i, "train").heaps) != 0][:SEEDED_GAMES]
    assert len(winning) == SEEDED_GAMES
    assert all(scripted_nim(i, "optimal", "random").end.winner == "first" for i in winning)


def test_optimal_play_wins_every_losing_start_as_the_second_seat():
    losing = [i for i in range(2 * SEEDED_GAMES) if nim_sum(nim.make(i, "train").heaps) == 0]
    assert len(losing) > 20
    assert all(scripted_nim(i, "optimal", "optimal").end.winner == "second" for i in losing)
    assert all(scripted_nim(i, "random", "optimal").end.winner == "second" for i in losing)


def test_the_expert_beats_random_more_often_than_random_does():
    def wins(first: str) -> int:
        return sum(scripted_nim(i, first, "random").end.winner == "first" for i in range(SEEDED_GAMES))

    random_wins, expert_wins, optimal_wins = wins("random"), wins("expert"), wins("optimal")
    assert random_wins + 0.1 * SEEDED_GAMES < expert_wins < optimal_wins


# --- Relay ---

def test_relay_make_is_a_pure_function_of_index_and_split():
    train = [relay.make(i, "train").secret for i in range(50)]
    assert train == [relay.make(i, "train").secret for i in range(50)]
    assert train != [relay.make(i, "eval").secret for i in range(50)]
    assert set(train) == set(range(1, 10))


def test_the_receiver_sees_the_senders_words_and_both_share_the_reward():
    game = Relay(7)
    openings = game.reset()
    assert "The secret number is 7." in openings["sender"][-1]["content"]
    assert all("7" not in m["content"] for m in openings["receiver"])  # the receiver must be told
    assert game.to_move() == "sender"
    told = game.step("sender", reply("  My number is seven, that is 7!  "))
    assert not told.done and list(told.messages) == ["receiver"]
    assert "Your partner says: My number is seven, that is 7!" in told.messages["receiver"][0]["content"]
    assert game.to_move() == "receiver"
    end = game.step("receiver", reply("7"))
    assert end.done and end.winner is None and end.rewards == {"sender": 1.0, "receiver": 1.0}
    assert end.info == {"success": True, "secret": 7}


@pytest.mark.parametrize("said, answer", [("It is 3.", "3"), ("The number is 7.", "I don't know"),
                                          ("The number is 7.", "17")])
def test_a_wrong_answer_costs_both_seats(said, answer):
    game = Relay(7)
    game.step("sender", reply(said))
    end = game.step("receiver", reply(answer))
    assert end.done and end.rewards == {"sender": 0.0, "receiver": 0.0} and end.info["success"] is False


def test_relay_turns_are_sender_then_receiver():
    game = Relay(4)
    with pytest.raises(ValueError, match="'sender'"):
        game.step("receiver", reply("4"))
    game.step("sender", reply("4"))
    game.step("receiver", reply("4"))
    with pytest.raises(ValueError, match="over"):
        game.step("receiver", reply("4"))


def test_the_copy_players_relay_every_secret():
    for index in range(30):
        game = relay.make(index, "eval")
        played = drive(game, scripted(game, {"sender": "copy", "receiver": "copy"}, random.Random(index)))
        assert [s for s, _, _ in played.history] == ["sender", "receiver"]
        assert played.end.info == {"success": True, "secret": game.secret}
        assert f"Your partner says: The number is {game.secret}." in played.seen("receiver")
    # the receiver repeats what it was told, right or wrong
    game = Relay(2)
    game.step("sender", reply("I was told 8, sorry"))
    assert Relay.players["copy"](game, "receiver", random.Random(0)) == "8"


# --- a two-player textarena game ---

@pytest.fixture
def textarena_env() -> Any:
    pytest.importorskip("textarena", reason="textarena is in the dev extra")
    from examples import textarena_env

    return textarena_env


def first_free_cell(seat: str, conversation: list[Message]) -> str:
    """A legal move read off the last board the seat was shown ("Available Moves: '[0]', ...")."""
    board = next(m["content"] for m in reversed(conversation) if "Available Moves:" in m["content"])
    return board.rsplit("Available Moves:", 1)[1].split(",")[0].strip().strip("'")


def test_a_textarena_match_is_played_to_its_end_each_seat_seeing_its_own_observations(textarena_env):
    game = textarena_env.two_player(0, "train")
    check_game(game, "textarena_env:two_player")
    played = drive(game, first_free_cell)
    # cells 0, 1, 2, ... in turn: player0 (O) takes 0, 2, 4, 6 and wins on the diagonal
    assert [text for _, text, _ in played.history] == ["[0]", "[1]", "[2]", "[3]", "[4]", "[5]", "[6]"]
    assert [seat for seat, _, _ in played.history] == ["player0", "player1"] * 3 + ["player0"]
    assert played.end.done and played.end.winner == "player0"
    assert played.end.rewards == {"player0": 1.0, "player1": -1.0} and played.end.info["invalid"] is None
    for me, them, their_first in (("0", "1", "[1]"), ("1", "0", "[0]")):
        seen = played.seen(f"player{me}")
        assert seen.count(f"You are Player {me}") == 1 and f"You are Player {them}" not in seen
        assert f"[Player {me}]" not in seen  # its own moves are already in its conversation
        assert f"[Player {them}] {their_first}" in seen
    # between the seat's replies, one message: what happened since its last turn
    for seat, _, move in played.history[:-1]:
        assert list(move.messages) == [("player1" if seat == "player0" else "player0")]


def test_an_invalid_textarena_move_is_warned_to_its_seat_alone_then_loses(textarena_env):
    game = textarena_env.two_player(3, "eval")
    openings = game.reset()
    assert "Player 0" in openings["player0"][0]["content"] and "Player 1" in openings["player1"][0]["content"]
    assert not game.step("player0", reply("[4]")).done
    warned = game.step("player1", reply("4"))  # occupied: forgiven once, the same seat moves again
    assert list(warned.messages) == ["player1"] and "invalid move" in warned.messages["player1"][0]["content"]
    assert game.to_move() == "player1"
    end = game.step("player1", reply("[4]"))
    assert end.done and end.winner == "player0" and end.info["invalid"] == "player1"
    assert end.rewards == {"player0": 1.0, "player1": -1.0}


def test_a_textarena_match_leaves_the_process_random_state_alone(textarena_env):
    random.seed(99)
    before = random.getstate()
    game = textarena_env.two_player(1, "train")
    game.reset()
    game.step("player0", reply("[0]"))
    assert random.getstate() == before
