"""Relay: a cooperative game for two adapters of a fleet that share one reward. The sender is
told a secret number and tells its partner; the receiver sees only what the sender said and
answers with the number. This module owns the two openings, the one exchange and the scripted
"copy" player.

Both seats get 1 when the receiver's answer is the secret and 0 otherwise, so neither can do
well alone: the sender learns to say the number plainly, the receiver to read it off what it is
told. One reply per seat: the game is over in two turns.

A task plays it as `env = "lora_async.envs.builtin.relay:make"`, each seat played by the policy
`task.opponents` names (see game.py).
"""

from __future__ import annotations

import random
import re
from typing import ClassVar

from ..base import Message, Reply, user
from ..game import Game, Move, Player

SEATS = ("sender", "receiver")
LOW, HIGH = 1, 9  # one digit: the number survives any sentence the sender wraps it in
SHARED_WIN, SHARED_LOSS = 1.0, 0.0
INTEGER = re.compile(r"-?\d+")
SENDER_RULES = "You know a secret number. Tell your partner the number in one short sentence."
RECEIVER_RULES = (f"Your partner knows a secret number from {LOW} to {HIGH} and will tell it to you. "
                  "Reply with only the number.")
# A finished round in each opening: without it the base model answers the rules with prose, and
# the receiver never with a bare number (no reward to learn from). Short: every turn re-reads it.
SENDER_EXAMPLE: tuple[Message, ...] = (
    user(f"{SENDER_RULES}\nThe secret number is 4."), {"role": "assistant", "content": "The number is 4."},
    user("Your partner got it."),
)
RECEIVER_EXAMPLE: tuple[Message, ...] = (
    user(f"{RECEIVER_RULES}\nYour partner says: The number is 6."), {"role": "assistant", "content": "6"},
    user("Correct!"),
)


def first_integer(text: str) -> int | None:
    found = INTEGER.search(text)
    return None if found is None else int(found.group())


def copy_player(game: Relay, seat: str, rng: random.Random) -> str:
    """The sender states the secret; the receiver repeats the first number it was told."""
    if seat == "sender":
        return f"The number is {game.secret}."
    heard = first_integer(game.told or "")
    return "I don't know." if heard is None else str(heard)


class Relay(Game):
    seats: ClassVar[tuple[str, ...]] = SEATS
    players: ClassVar[dict[str, Player]] = {"copy": copy_player}

    def __init__(self, secret: int) -> None:
        self.secret = secret
        self.told: str | None = None  # what the sender said, once it has
        self.done = False

    def reset(self) -> dict[str, list[Message]]:
        sender = f"New round. {SENDER_RULES}\nThe secret number is {self.secret}."
        # copies: a runner may extend a seat's messages in place, and the examples are shared
        return {"sender": [dict(m) for m in SENDER_EXAMPLE] + [user(sender)],
                "receiver": [dict(m) for m in RECEIVER_EXAMPLE] + [user(f"New round. {RECEIVER_RULES}")]}

    def to_move(self) -> str:
        return "sender" if self.told is None else "receiver"

    def step(self, seat: str, reply: Reply) -> Move:
        if self.done:
            raise ValueError("this game of Relay is over")
        if seat != self.to_move():
            raise ValueError(f"it is {self.to_move()!r}'s turn, not {seat!r}'s")
        if seat == "sender":
            self.told = reply.content
            return Move({"receiver": [user(f"Your partner says: {reply.content}\nReply with only the number.")]})
        self.done = True
        success = first_integer(reply.content) == self.secret
        reward = SHARED_WIN if success else SHARED_LOSS
        return Move(done=True, rewards={s: reward for s in self.seats}, winner=None,
                    info={"success": success, "secret": self.secret})


def make(index: int, split: str) -> Relay:
    """Game `index`: a pure function of its arguments (held-out games differ by seed)."""
    return Relay(random.Random(f"relay:{split}:{index}").randint(LOW, HIGH))
