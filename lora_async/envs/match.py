"""One game, token in and token out for every model seat (`game.py` is the interface).

Who plays a seat is a `SeatPolicy`: the adapter being trained (its newest version; its tokens
train it), a frozen adapter version (another adapter of the fleet, or a pinned `main@v4` that
the engine keeps registered), the base model, or one of the game's scripted players.
`task.opponents` names them (`Opponent`), and `games.py` turns that into the policies of a game.

Each model seat has its own conversation and its own `Trajectory`: its opening, then its replies
and the messages the game addressed to it since its last reply (rendered as one delta just before
its next reply, so a seat's context holds only what it saw). Its first prompt is its opening and
whatever the game addressed to it before its first turn (the second player sees the first move).
A trained seat's tokens carry the version that sampled them and their logprobs; a frozen seat's
are context only, and its requests carry no rollout tag, so a learner step never stops them.

Faults end the game, never the run: a game that raises or hangs (`env_error`: nobody trains on
it), a context that would overflow (`truncated`), a game longer than `max_turns` replies per
seat (`max_turns`: a draw). A scripted player that raises is the game's fault.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field
from typing import Any

from ..adapter_version import SEPARATOR
from ..generator.types import GenRequest
from ..league import GameResult
from ..outcomes import Outcome
from ..rollout import Generate, sub_seed
from ..timing import NO_WAITS, Wait, Waits
from ..tokenizer import text_of
from .base import Message, Reply
from .episode import ContextFull, EpisodeError, EpisodeSettings, Trajectory, call_env, check_messages, sample_reply
from .game import GameLike, Move
from .render import ChatRenderer


class Kind(enum.Enum):
    SELF = "self"  # the adapter being trained: its newest version
    LEAGUE = "league"  # a past version drawn from its league
    BASE = "base"  # the base model
    SCRIPTED = "scripted"  # one of the game's scripted players
    ADAPTER = "adapter"  # an adapter version: another of the fleet's (its newest) or a pinned one


@dataclass(frozen=True)
class Opponent:
    """An entry of `task.opponents` / `task.eval_opponents`, parsed (the config checked its form)."""

    text: str
    kind: Kind
    adapter: str | None = None  # ADAPTER: the adapter (`self@v0` names the run's own)
    version: int | None = None  # ADAPTER: a pinned version (None: the newest)
    player: str | None = None  # SCRIPTED: the player's name

    @classmethod
    def parse(cls, text: str, own: str) -> "Opponent":
        if text in ("self", "league", "base"):
            return cls(text, Kind(text))
        if text.startswith("scripted:"):
            return cls(text, Kind.SCRIPTED, player=text.removeprefix("scripted:"))
        name, _, version = text.partition(SEPARATOR)
        return cls(text, Kind.ADAPTER, own if name == "self" else name, int(version) if version else None)

    @property
    def pinned(self) -> tuple[str, int] | None:
        """(adapter, version) the engine must keep registered for it, or None."""
        if self.kind is Kind.ADAPTER and self.adapter is not None and self.version is not None:
            return self.adapter, self.version
        return None

    @property
    def label(self) -> str:
        """Its name in metrics (`vs_<label>/win`): `random`, `self_v0`, `base`, ..."""
        return (self.player or self.text).replace(SEPARATOR, "_v").replace("@", "_")


@dataclass(frozen=True)
class SeatPolicy:
    """Who plays one seat of one game."""

    adapter: str | None = None  # the served adapter; None: the base model (or a scripted player)
    version: int | None = None  # a pinned version; None: the newest
    player: str | None = None  # a scripted player of the game
    trained: bool = False  # its tokens train `adapter` (the rollout's own adapter, newest version)


@dataclass
class SeatPlay:
    """One seat during a game: its conversation so far and what waits to be shown to it."""

    policy: SeatPolicy
    opening: list[Message]
    pending: list[Message] = field(default_factory=list)
    trajectory: Trajectory | None = None  # a model seat's, from its first reply
    last_reply: list[int] = field(default_factory=list)
    replies: int = 0


@dataclass
class MatchRecord:
    """A finished game: each model seat's trajectory (reward, outcome and `success` set), and
    each seat's result (none for a game that broke: `env_error`)."""

    trajectories: dict[str, Trajectory]
    results: dict[str, GameResult]
    outcome: Outcome
    rewards: dict[str, float]
    winner: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    replies: int = 0

    def success(self, seat: str) -> bool:
        """`seat` won; in a finished game no one wins (cooperative), what the game counts a
        success (`info["success"]`, else a reward of 1)."""
        if self.outcome is not Outcome.DONE:
            return False
        if self.winner is not None:
            return self.winner == seat
        return bool(self.info.get("success", self.rewards.get(seat, 0.0) >= 1.0))


class Match:
    """Plays one game to its end."""

    def __init__(self, game: GameLike, renderer: ChatRenderer, settings: EpisodeSettings, generate: Generate,
                 policies: dict[str, SeatPolicy], tag: object, group: object = None, waits: Waits = NO_WAITS,
                 seed: int | None = None) -> None:
        """`tag` goes on the trained seats' requests (what `abort_older` stops), `group` on every
        request; `seed` seeds the sampling (each request with its own) and the scripted players."""
        self.game, self.renderer, self.settings, self.generate = game, renderer, settings, generate
        self.policies, self.tag, self.group, self.waits, self.seed = policies, tag, group, waits, seed
        self.rng = random.Random(f"match:{seed}")
        self.requests = 0

    async def play(self) -> MatchRecord:
        """The whole game; a fault ends it with its outcome (never raises for the game's faults;
        EpisodeAborted when generation cannot go on)."""
        seats: dict[str, SeatPlay] = {}
        outcome, move, error, replies = Outcome.MAX_TURNS, Move(), None, 0
        try:
            with self.waits.timed(Wait.ENV):
                openings = await call_env(self.game.reset, timeout_s=self.settings.env_timeout_s, what="reset")
            unplayed = [seat for seat in self.game.seats if seat not in self.policies]
            if unplayed:
                raise EpisodeError(f"the game has seats {list(self.game.seats)}, not the ones it was set up with "
                                   f"{list(self.policies)}: a game's seats must not change")
            seats = {seat: SeatPlay(self.policies[seat], self._opening(openings, seat)) for seat in self.game.seats}
            for replies in range(1, self.settings.max_turns * len(seats) + 1):
                seat = await call_env(self.game.to_move, timeout_s=self.settings.env_timeout_s, what="to_move")
                if seat not in seats:
                    raise EpisodeError(f"to_move returned {seat!r}, not one of the seats {list(seats)}")
                reply = await self._reply(seat, seats[seat])
                with self.waits.timed(Wait.ENV):
                    move = await call_env(self.game.step, seat, reply, timeout_s=self.settings.env_timeout_s,
                                          what="step")
                self._deliver(move, seats)
                if move.done:
                    outcome = Outcome.DONE
                    break
        except ContextFull:
            outcome = Outcome.TRUNCATED
        except EpisodeError as exc:
            outcome, error = Outcome.ENV_ERROR, str(exc)
        return self._record(seats, outcome, move if outcome is Outcome.DONE else Move(), error, replies)

    def _opening(self, openings: Any, seat: str) -> list[Message]:
        if not isinstance(openings, dict) or seat not in openings:
            raise EpisodeError(f"reset must return each seat's opening messages, {{seat: [message, ...]}}; "
                               f"it has none for {seat!r}")
        check_messages(openings[seat], f"reset[{seat!r}]")
        return list(openings[seat])

    def _deliver(self, move: Any, seats: dict[str, SeatPlay]) -> None:
        if not isinstance(move, Move):
            raise EpisodeError(f"step returned {type(move).__name__}, not a Move")
        for seat, messages in move.messages.items():
            if seat not in seats:
                raise EpisodeError(f"step addressed messages to {seat!r}, not one of the seats {list(seats)}")
            check_messages(messages, f"step's messages to {seat!r}")
            seats[seat].pending += messages

    async def _reply(self, seat: str, play: SeatPlay) -> Reply:
        """`seat`'s next reply: its scripted player's, or its model's on its own context."""
        play.replies += 1
        policy = play.policy
        if policy.player is not None:
            player = getattr(self.game, "players", {}).get(policy.player)
            if player is None:
                raise EpisodeError(f"the game has no scripted player {policy.player!r}")
            text = await call_env(player, self.game, seat, self.rng, timeout_s=self.settings.env_timeout_s,
                                  what=f"scripted player {policy.player!r}")
            if not isinstance(text, str):
                raise EpisodeError(f"scripted player {policy.player!r} returned {type(text).__name__}, not a str")
            play.pending = []
            return Reply(text, text.strip(), [], [], play.replies)
        traj = self._context(play)
        s = self.settings

        def request(prompt: list[int], room: int) -> GenRequest:
            self.requests += 1
            return GenRequest(prompt, policy.adapter, n=1, max_tokens=room, temperature=s.temperature, top_p=s.top_p,
                              tag=self.tag if policy.trained else None, keep_partial=s.partial and policy.trained,
                              version=policy.version, group=self.group, seed=sub_seed(self.seed, self.requests))

        ids, finish = await sample_reply(traj, s, self.generate, request, trained=policy.trained)
        text = text_of(self.renderer.tokenizer.decode(ids, skip_special_tokens=True))
        traj.messages.append({"role": "assistant", "content": text})
        traj.turns = play.replies
        play.last_reply = ids
        return Reply(text, text.strip(), [], [], play.replies, finish == "length")

    def _context(self, play: SeatPlay) -> Trajectory:
        """The seat's trajectory with what it has not seen yet added: its opening (and what came
        before its first turn), or the delta after its last reply."""
        shown, play.pending = play.pending, []
        if play.trajectory is None:
            messages = self.renderer.with_system(play.opening + shown)
            play.trajectory = Trajectory(self.renderer.opening(play.opening + shown), messages=messages,
                                         opened=len(messages))
            if play.trajectory.length >= self.settings.max_model_len:
                raise ContextFull()
            return play.trajectory
        traj = play.trajectory
        delta = self.renderer.delta(shown, play.last_reply)
        if traj.length + len(delta) >= self.settings.max_model_len:
            raise ContextFull()
        traj.context(delta)
        traj.messages.extend(shown)
        return traj

    def _record(self, seats: dict[str, SeatPlay], outcome: Outcome, move: Move, error: str | None,
                replies: int) -> MatchRecord:
        """Rewards, results and outcomes per seat. Only a finished game pays its rewards; a game cut
        short is a draw at reward 0, a broken one scores 0 and trains nobody."""
        winner = move.winner if outcome is Outcome.DONE else None
        rewards = {seat: float(move.rewards.get(seat, 0.0)) for seat in seats}
        results = {} if outcome is Outcome.ENV_ERROR else {  # a broken game is no one's result
            seat: GameResult.DRAW if winner is None else GameResult.WIN if seat == winner else GameResult.LOSS
            for seat in seats}
        record = MatchRecord({}, results, outcome, rewards, winner, dict(move.info), error, replies)
        for seat, play in seats.items():
            traj = play.trajectory
            if traj is not None:
                traj.reward, traj.outcome, traj.error = rewards[seat], outcome, error
                traj.info = {**move.info, "success": record.success(seat)}
                record.trajectories[seat] = traj
        return record
