"""textarena games as lora-async environments: `lora-async train examples/textarena.toml`.

textarena (`pip install textarena`) has text games behind a gym-like API: `reset(num_players,
seed)`, `get_observation() -> (player, [(sender, text, kind), ...])`, `step(action) -> (done,
info)` and, once done, `close() -> (rewards, game_info)`. `TextArenaGame` maps a single-player
game onto `reset() -> messages` and `step(reply) -> StepResult`; `TextArenaMatch` maps a
two-player one onto a `Game` (lora_async/envs/game.py), one seat per textarena player. Wrapping
another library takes the same three decisions, marked (1) to (3) below, and a fourth for games
of several players, (4):

(1) Seeding: a game is a pure function of (index, split), so that every episode of a group
    plays the same game; train and eval seeds never meet.
(2) Observations: only the text that is new this turn goes to the model; the conversation
    already holds the rest.
(3) Reward: the game's own, for player 0, on its own scale. textarena 0.7.4's single-player
    games give 1 for a win and otherwise the share of the puzzle solved, in [0, 1) (for
    GuessTheNumber: how close the last guess was). `success` is a win. An invalid move is
    the game's call: it warns once (the warning is the next message) and ends the game at the
    second in a row. Give `task.max_turns` room for the game's whole length: an episode the run
    cuts off first scores 0. Two-player games give each player 1 for a win, -1 for a loss and 0
    for a draw; the seat with the higher reward is the winner.

(4) Who sees what: textarena keeps one queue of observations per player and hands a player its
    queue only at its turn (`get_observation` drains the queue of the player to move, and names
    it). So each seat's messages arrive in one batch just before it replies: what the other
    player did, the board after it, and a warning if its own last move was invalid (textarena
    forgives one invalid move in a row, and the same player moves again; a second loses). Only
    the openings of the players who do not move first are read from their queues directly.

Another textarena game is one line, `my_game = game("FrozenLake-v0")` (`match("...")` for a
two-player one), then `env = "examples.textarena_env:my_game"`. Another library: keep the shape
of `TextArenaGame` and replace the calls into textarena.

Imported from the repository root as `examples.textarena_env` (run lora-async from there).
"""

from __future__ import annotations

import random
import threading
from typing import Any, Callable

try:
    import textarena
except ImportError:
    raise ImportError("examples/textarena_env.py needs textarena: pip install textarena") from None

from lora_async.envs import Env, Message, Reply, StepResult, user
from lora_async.envs.game import Game, Move

PLAYER = 0  # the model: the only player of a single-player game
# textarena's games draw from the process-wide `random` module (their reset seeds it), and the
# episodes of a group call reset and step at once, each on its own thread. So each game keeps
# its own generator state and swaps it in under this lock: a game depends on its seed alone.
GLOBAL_RANDOM = threading.Lock()


class OwnRandom:
    """(1) One game's own state of the process-wide `random` module."""

    def __init__(self, seed: int) -> None:
        self.state = random.Random(seed).getstate()

    def run(self, call: Callable[[], Any]) -> Any:
        """Run `call` on this game's state, leaving the process's as it was."""
        with GLOBAL_RANDOM:
            outer = random.getstate()
            random.setstate(self.state)
            try:
                return call()
            finally:
                self.state = random.getstate()
                random.setstate(outer)


def new_text(observations: list[tuple[int, str, Any]], player: int) -> str:
    """(2) The observations handed to `player`, as one message, less the echo of its own moves
    (already in its conversation). Another player's moves are shown as textarena's own
    observation wrappers show them: "[Player 1] [4]". Some games echo a move without naming
    its player (TowerOfHanoi-v0's sender is the game, -1): that echo could be `player`'s own, so
    it is left out too."""
    action = textarena.ObservationType.PLAYER_ACTION
    return "\n".join(f"[Player {sender}] {text}" if kind is action else text
                     for sender, text, kind in observations
                     if kind is not action or sender not in (player, textarena.core.GAME_ID))


class TextArenaGame(Env):
    """One game of `game_id` (a textarena id, e.g. "Mastermind-v0"), seeded by `seed`."""

    def __init__(self, game_id: str, seed: int) -> None:
        # (2) "-raw" is the game without textarena's observation wrappers, which re-send the whole
        # history every turn. The action wrapper adds the [brackets] a move needs, if left out.
        self.game = textarena.wrappers.ActionFormattingWrapper(textarena.make(f"{game_id}-raw"))
        self.seed = seed
        self.random = OwnRandom(seed)

    def reset(self) -> list[Message]:
        self.random.run(lambda: self.game.reset(num_players=1, seed=self.seed))  # (1)
        return [user(self._new_text())]

    def step(self, reply: Reply) -> StepResult:
        done, _ = self.random.run(lambda: self.game.step(reply.content))
        if not done:  # the game's answer: feedback, a new board, or a warning about an invalid move
            return StepResult([user(self._new_text())])
        rewards, game_info = self.game.close()  # (3)
        reward = float(rewards[PLAYER])
        return StepResult(reward=reward, done=True,
                          info={"success": reward >= 1.0, "reason": game_info[PLAYER].get("reason", "")})

    def _new_text(self) -> str:
        """(2) What the game said since the last call (textarena hands each message out once)."""
        _, observations = self.game.get_observation()
        return new_text(observations, PLAYER)


class TextArenaMatch(Game):
    """One match of the two-player game `game_id` (e.g. "TicTacToe-v0"), seeded by `seed`: seat
    "player<k>" is textarena's player k."""

    seats = ("player0", "player1")

    def __init__(self, game_id: str, seed: int) -> None:
        self.game = textarena.wrappers.ActionFormattingWrapper(textarena.make(f"{game_id}-raw"))  # (2)
        self.seed = seed
        self.random = OwnRandom(seed)
        self.player = 0  # textarena's player to move

    def reset(self) -> dict[str, list[Message]]:
        self.random.run(lambda: self.game.reset(num_players=len(self.seats), seed=self.seed))  # (1)
        self.player, observations = self.game.get_observation()
        openings = {self.seats[self.player]: [user(new_text(observations, self.player))]}
        # (4) The players who do not move first get their queued rules and board now: textarena
        # would hand them out only at their first turn, and a seat's opening is its rules.
        for player, seat in enumerate(self.seats):
            if player != self.player:
                queue = self.game.state.observations[player]
                openings[seat] = [user(new_text(queue, player))]
                queue.clear()
        return {seat: openings[seat] for seat in self.seats}

    def to_move(self) -> str:
        return self.seats[self.player]

    def step(self, seat: str, reply: Reply) -> Move:
        if seat != self.to_move():
            raise ValueError(f"it is {self.to_move()!r}'s turn, not {seat!r}'s")
        done, _ = self.random.run(lambda: self.game.step(reply.content))
        if not done:
            # (4) the player to move next (the other, or the same after a forgiven invalid move)
            # and what textarena has queued for it since its last turn
            self.player, observations = self.game.get_observation()
            return Move({self.seats[self.player]: [user(new_text(observations, self.player))]})
        rewards, game_info = self.game.close()  # (3)
        by_seat = {s: float(rewards[player]) for player, s in enumerate(self.seats)}
        best = max(by_seat.values())
        leaders = [s for s, r in by_seat.items() if r == best]
        invalid = [s for player, s in enumerate(self.seats) if game_info[player].get("invalid_move")]
        return Move(done=True, rewards=by_seat, winner=leaders[0] if len(leaders) == 1 else None,
                    info={"invalid": invalid[0] if invalid else None, "reason": game_info[0].get("reason", "")})


def game(game_id: str) -> Callable[[int, str], TextArenaGame]:
    """The factory of one textarena game, for `env = "examples.textarena_env:<name>"`."""

    def factory(index: int, split: str) -> TextArenaGame:
        return TextArenaGame(game_id, seed_of(index, split))

    return factory


def match(game_id: str) -> Callable[[int, str], TextArenaMatch]:
    """The factory of one two-player textarena game, for `env = "examples.textarena_env:<name>"`."""

    def factory(index: int, split: str) -> TextArenaMatch:
        return TextArenaMatch(game_id, seed_of(index, split))

    return factory


def seed_of(index: int, split: str) -> int:
    """(1) train games have even seeds, held-out games odd ones: the splits never share a game."""
    return 2 * index + int(split == "eval")


make = game("GuessTheNumber-v0")  # 1 to 20 in 10 guesses, told "higher" or "lower"
tower_of_hanoi = game("TowerOfHanoi-v0")  # 3 disks in 14 moves
mastermind = game("Mastermind-v0")  # a 4-digit code in 20 guesses, told black and white pegs
# 9 moves at most, a board of digits. Nothing in it is random: its train and eval games are one game.
two_player = match("TicTacToe-v0")
