"""A two-seat game a random model plays with varied results (`tests/test_selfplay_run.py`): each
seat replies once; a reply's text decides the winner (the parity of its characters' sum), so a
tiny random model's games are won and lost alike, its groups carry signal, and every step makes
a version a league can keep. Imported as `tests.coin_game:make` from the repository root."""

from __future__ import annotations

from lora_async.envs import user
from lora_async.envs.game import Game, Move


class Coin(Game):
    seats = ("first", "second")

    def __init__(self, index: int) -> None:
        self.index, self.said = index, ""

    def reset(self) -> dict:
        return {seat: [user(f"Game {self.index}: call heads or tails. You are {seat}.")] for seat in self.seats}

    def to_move(self) -> str:
        return self.seats[1 if self.said else 0]

    def step(self, seat: str, reply) -> Move:
        if not self.said:
            self.said = reply.text
            return Move({"second": [user("They called. Your call.")]})
        winner = self.seats[sum(map(ord, self.said + reply.text)) % 2]
        return Move(done=True, rewards={winner: 1.0}, winner=winner)


def make(index: int, split: str) -> Coin:
    return Coin(index)
