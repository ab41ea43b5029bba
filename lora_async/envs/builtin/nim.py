"""Nim, normal play: two seats take turns taking objects from one heap; whoever takes the last
object wins. This module owns the rules, the move format (`take N from X`), the openings and
the scripted players ("random", "optimal", "expert").

The heaps are small on purpose (2 or 3 heaps of 1 to 4 objects): the embedded 135M model must
be able to get better at the game in minutes on CPU, against a scripted player or itself. An
invalid move (no move read, an empty or missing heap, a count the heap does not hold) loses at
once: a move the game cannot play must cost something, and a game that warns and waits would
reward stalling until the runner's reply cap calls a draw.

A task plays it as `env = "lora_async.envs.builtin.nim:make"`, each seat played by the policy
`task.opponents` names (see game.py).
"""

from __future__ import annotations

import random
import re
from typing import ClassVar

from ..base import Message, Reply, user
from ..game import Game, Move, Player

SEATS = ("first", "second")
HEAP_NAMES = "ABC"
MIN_HEAPS, MAX_HEAPS = 2, 3
MAX_HEAP = 4  # objects in a heap at most: a game of a few moves, learnable by a tiny model in minutes
EXPERT_SKILL = 0.7  # the share of the "expert" player's moves that are optimal; the rest are random
WIN, LOSS = 1.0, 0.0
# A move the game cannot play loses, and costs more than a game lost by play: a learner is pushed
# to legal moves first. (At 0, a policy that repeats one move until its heap is empty loses no
# more than one that plays on, and self-play settled there: bench/RESULTS.md section 24.)
INVALID = -1.0
INTEGER = re.compile(r"-?\d+")
# A heap letter standing alone ("B", "heap B", "B=2", "2B"), not inside a word ("Bob", "cab").
HEAP = re.compile(r"(?<![A-Za-z])([A-Ca-c])(?![A-Za-z])")
RULES = ("Let's play Nim. On your turn, take 1 or more objects from one heap. Whoever takes the last "
         "object wins. Reply with only your move, like: take 2 from B")


def nim_sum(heaps: list[int]) -> int:
    """The XOR of the heap sizes: the player to move can force a win exactly when it is not 0."""
    total = 0
    for size in heaps:
        total ^= size
    return total


def legal_moves(heaps: list[int]) -> list[tuple[int, int]]:
    """Every (heap index, count) the player to move may take."""
    return [(heap, count) for heap, size in enumerate(heaps) for count in range(1, size + 1)]


def format_move(heap: int, count: int) -> str:
    return f"take {count} from {HEAP_NAMES[heap]}"


def format_heaps(heaps: list[int]) -> str:
    return " ".join(f"{HEAP_NAMES[i]}={size}" for i, size in enumerate(heaps))


def your_move(heaps: list[int]) -> str:
    """The prompt to move, with the moves the heaps allow: a small model that reads its options
    plays legal moves in positions its own past versions never led it to (a random player's)."""
    options = " or ".join(f"1 from {HEAP_NAMES[i]}" if size == 1 else f"1 to {size} from {HEAP_NAMES[i]}"
                          for i, size in enumerate(heaps) if size)
    return f"Your move: take {options}."


# One finished game in every opening: without it the base model answers the rules with prose and
# never a move (no reward to learn from). Short, because every turn re-reads the whole context.
# Its moves vary the heap and the count, so that the base model does not learn one move from it.
EXAMPLE_GAME: tuple[Message, ...] = (
    user(f"{RULES}\nHeaps: A=1 B=3. {your_move([1, 3])}"), {"role": "assistant", "content": "take 2 from B"},
    user(f"Your opponent took 1 from A. Heaps: A=0 B=1. {your_move([0, 1])}"),
    {"role": "assistant", "content": "take 1 from B"},
    user("You took the last object. You win!"),
)


def parse_move(text: str) -> tuple[str, int] | None:
    """The (heap letter, count) a reply names, in either order, or None if it names no heap or
    no number. An upper-case letter is preferred: a lower-case "a" in a sentence is most often
    the article, not heap A."""
    number = INTEGER.search(text)
    letters = HEAP.findall(text)
    if number is None or not letters:
        return None
    letter = next((x for x in letters if x.isupper()), letters[0])
    return letter.upper(), int(number.group())


def optimal_move(heaps: list[int]) -> tuple[int, int]:
    """The move that leaves a nim-sum of 0 when there is one; otherwise 1 from the largest heap
    (a lost position: take as little as possible and hope for a mistake)."""
    total = nim_sum(heaps)
    if total:
        heap = next(i for i, size in enumerate(heaps) if size ^ total < size)
        return heap, heaps[heap] - (heaps[heap] ^ total)
    return heaps.index(max(heaps)), 1


def random_player(game: Nim, seat: str, rng: random.Random) -> str:
    return format_move(*rng.choice(legal_moves(game.heaps)))


def optimal_player(game: Nim, seat: str, rng: random.Random) -> str:
    return format_move(*optimal_move(game.heaps))


def expert_player(game: Nim, seat: str, rng: random.Random) -> str:
    """Plays optimally some of the time (EXPERT_SKILL): beatable, so a learner sees both outcomes."""
    if rng.random() < EXPERT_SKILL:
        return optimal_player(game, seat, rng)
    return random_player(game, seat, rng)


class Nim(Game):
    seats: ClassVar[tuple[str, ...]] = SEATS
    players: ClassVar[dict[str, Player]] = {"random": random_player, "optimal": optimal_player,
                                            "expert": expert_player}

    def __init__(self, heaps: list[int]) -> None:
        if not MIN_HEAPS <= len(heaps) <= len(HEAP_NAMES) or min(heaps) < 1:
            raise ValueError(f"Nim needs {MIN_HEAPS} to {len(HEAP_NAMES)} heaps of 1 or more objects, got {heaps}")
        self.start = list(heaps)
        self.heaps = list(heaps)
        self.moves = 0  # valid moves made
        self.done = False

    def reset(self) -> dict[str, list[Message]]:
        heaps = f"Heaps: {format_heaps(self.heaps)}."
        situation = {"first": f"New game. {heaps} You move first. {your_move(self.heaps)}",
                     "second": f"New game. {heaps} Your opponent moves first."}
        # copies: a runner may extend a seat's messages in place, and the example is shared
        return {seat: [dict(m) for m in EXAMPLE_GAME] + [user(situation[seat])] for seat in self.seats}

    def to_move(self) -> str:
        return self.seats[self.moves % 2]

    def step(self, seat: str, reply: Reply) -> Move:
        if self.done:
            raise ValueError("this game of Nim is over")
        if seat != self.to_move():
            raise ValueError(f"it is {self.to_move()!r}'s move, not {seat!r}'s")
        other = self.seats[1 - self.seats.index(seat)]
        move = parse_move(reply.content)
        reason = self._invalid(move)
        if reason is not None or move is None:
            self.done = True
            return Move(done=True, rewards={seat: INVALID, other: WIN}, winner=other,
                        info={"moves": self.moves, "invalid": seat, "reason": reason})
        letter, count = move
        self.heaps[HEAP_NAMES.index(letter)] -= count
        self.moves += 1
        if not any(self.heaps):
            self.done = True
            return Move(done=True, rewards={seat: WIN, other: LOSS}, winner=seat,
                        info={"moves": self.moves, "invalid": None})
        told = f"Your opponent took {count} from {letter}. Heaps: {format_heaps(self.heaps)}. {your_move(self.heaps)}"
        return Move({other: [user(told)]})

    def _invalid(self, move: tuple[str, int] | None) -> str | None:
        """Why `move` cannot be played now, or None if it can."""
        if move is None:
            return "no move read: reply like 'take 2 from B'"
        letter, count = move
        if HEAP_NAMES.index(letter) >= len(self.heaps):
            return f"there is no heap {letter}"
        size = self.heaps[HEAP_NAMES.index(letter)]
        if size == 0:
            return f"heap {letter} is empty"
        if not 1 <= count <= size:
            return f"cannot take {count} from heap {letter}, which holds {size}"
        return None


def make(index: int, split: str) -> Nim:
    """Game `index`: a pure function of its arguments (every seat of a group plays the same heaps;
    held-out games differ by seed)."""
    rng = random.Random(f"nim:{split}:{index}")
    return Nim([rng.randint(1, MAX_HEAP) for _ in range(rng.randint(MIN_HEAPS, MAX_HEAPS))])
