"""Games: environments with seats, each played by a policy of its own.

A game is an environment whose episode has several seats (`seats`). The game says whose turn it
is (`to_move`), and each seat sees only its own conversation: its opening (`reset` returns one
per seat) and the messages the game addresses to it (`Move.messages`). Each seat is played by a
policy the run chooses (`task.opponents`, see `match.py`): the adapter being trained, another
adapter of the fleet, a frozen past version (`main@v12`), or one of the game's scripted players
(`players`). Every model seat keeps its own token-level trajectory, so a trained seat's tokens
train its adapter with their own versions and logprobs; rewards are per seat.

    class Nim(Game):
        seats = ("first", "second")
        players = {"random": random_move}          # scripted players, by name

        def reset(self) -> dict[str, list[Message]]:
            return {seat: [user(rules(seat))] for seat in self.seats}

        def to_move(self) -> str:
            return self.seats[self.moves % 2]

        def step(self, seat: str, reply: Reply) -> Move:
            ...                                     # play it, or end the game
            return Move({other: [user(f"They took {n} from {heap}. Your move.")]})

    def make(index: int, split: str) -> Nim:       # `env = "my_game:make"`, as for any environment
        ...

A scripted player is a function `(game, seat, rng) -> str`: the reply text the seat makes, read
from the game's own state; the game's `step` takes it as it takes a model's reply. A game may be
a plain or an `async` one, as an `Env` may. Tools are for single-seat environments.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, ClassVar, Protocol, Union

from .base import Message, Reply

Player = Callable[[Any, str, random.Random], str]  # a scripted player: (game, seat, rng) -> its reply


@dataclass
class Move:
    """The game's answer to one seat's reply."""

    messages: dict[str, list[Message]] = field(default_factory=dict)  # what each seat sees next
    done: bool = False
    rewards: dict[str, float] = field(default_factory=dict)  # each seat's reward, read when done (missing: 0)
    winner: str | None = None  # when done: the seat that won; None for a draw (or a game no one wins)
    info: dict[str, Any] = field(default_factory=dict)


class Game:
    """Base class of a game (subclassing is optional: any object with `seats`, `reset`,
    `to_move` and `step` fits)."""

    seats: ClassVar[tuple[str, ...]] = ("first", "second")
    players: ClassVar[dict[str, Player]] = {}

    def reset(self) -> Union[dict[str, list[Message]], Awaitable[dict[str, list[Message]]]]:
        """Each seat's opening messages (a system message here replaces the task's system prompt)."""
        raise NotImplementedError

    def to_move(self) -> str:
        """The seat whose turn it is."""
        raise NotImplementedError

    def step(self, seat: str, reply: Reply) -> Union[Move, Awaitable[Move]]:
        """Play `seat`'s reply, or end the game (`done=True`) with each seat's reward."""
        raise NotImplementedError


class GameLike(Protocol):
    seats: tuple[str, ...]

    def reset(self) -> Union[dict[str, list[Message]], Awaitable[dict[str, list[Message]]]]: ...

    def to_move(self) -> str: ...

    def step(self, seat: str, reply: Reply) -> Union[Move, Awaitable[Move]]: ...


def is_game(env: object) -> bool:
    """An environment with seats (a `Game`), not a single-seat `Env`."""
    return callable(getattr(env, "to_move", None)) and isinstance(getattr(env, "seats", None), (tuple, list))


def check_game(game: object, where: str) -> None:
    """Raise TypeError (one line, naming `where`) if `game` does not fit the interface."""
    missing = [name for name in ("reset", "to_move", "step") if not callable(getattr(game, name, None))]
    if missing:
        raise TypeError(f"{where} returned a {type(game).__name__}, which has no {' or '.join(missing)} method")
    seats = getattr(game, "seats", None)
    if not isinstance(seats, (tuple, list)) or len(seats) < 2 or len(set(seats)) != len(seats) \
            or not all(isinstance(s, str) and s for s in seats):
        raise TypeError(f"{where}: {type(game).__name__}.seats must name two or more different seats")
    players = getattr(game, "players", {})
    if not isinstance(players, dict) or not all(isinstance(k, str) and callable(v) for k, v in players.items()):
        raise TypeError(f"{where}: {type(game).__name__}.players must map names to functions (game, seat, rng) -> str")
    if getattr(game, "tools", None):
        raise TypeError(f"{where}: {type(game).__name__} has tools; a game's seats take no tools (yet)")
