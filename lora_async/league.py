"""The league: one trained adapter's frozen past versions, kept as its self-play opponents.

A trained adapter (say "main") publishes a version each learner step: v0 at the start, then v1,
v2, ... Every `every` steps (`due`) its current version is kept (`keep`) as a frozen opponent in
a pool of at most `size` members; once the pool is over `size`, the oldest member is let go and
the engine may drop that version. The first version ever kept (v0) is also the anchor: evaluation
plays against it, so it stays registered for the whole run (`kept_versions`) even after it has
left the pool, and it is never let go.

Each training game draws its opponent from the pool (`draw`, by `Pick`), and each finished game
is recorded (`record`) to move Elo ratings: the current adapter's one (`rating`) and the
member's. A member starts at the adapter's rating when it is kept, so it starts as strong as the
adapter was then, and the gap opens as the adapter improves.

The league owns its draws' determinism: a draw is a function of (seed, game key, pool state)
alone, never of a shared random stream, so games drawn concurrently, in any order, and a run
resumed from `state_dict` all draw the same opponents.
"""

from __future__ import annotations

import enum
import random
from dataclasses import asdict, dataclass
from typing import Any

ELO_START = 1000.0  # the usual Elo origin; only differences matter
# K = 16: the usual K for established players. A league plays many games per step, so a larger K
# would make ratings follow the last few games' noise; a smaller one would lag an adapter whose
# strength changes every step.
ELO_K = 16.0
ELO_SCALE = 400.0  # Elo's scale: a 400-point gap means the stronger side is expected to score 10:1
# The prior of LOSSES' not-win rate: Laplace's rule (a Beta(1, 1) prior, one imagined not-win
# and one imagined win), so a member not played yet is drawn at rate 1/2 and none ever reaches
# weight 0 (a member the adapter has always beaten is still drawn now and then).
NOT_WIN_PRIOR = 1.0


class Pick(str, enum.Enum):
    """How a game draws its opponent from the pool."""

    def __str__(self) -> str:
        return self.value

    LATEST = "latest"  # the newest member
    UNIFORM = "uniform"  # any member alike
    LOSSES = "losses"  # towards members the adapter does not beat (`not_win_weight`)


class GameResult(str, enum.Enum):
    """How one game ended, from the trained adapter's point of view."""

    def __str__(self) -> str:
        return self.value

    WIN = "win"
    DRAW = "draw"
    LOSS = "loss"

    @property
    def score(self) -> float:
        """The adapter's Elo score of the game."""
        return {GameResult.WIN: 1.0, GameResult.DRAW: 0.5, GameResult.LOSS: 0.0}[self]


@dataclass
class Member:
    """A kept version and the trained adapter's results against it (from the adapter's view)."""

    version: int
    kept_at: int  # the learner step after which it was kept
    elo: float
    games: int = 0
    wins: int = 0
    draws: int = 0
    losses: int = 0

    @property
    def not_win_weight(self) -> float:
        """The adapter's smoothed rate of not winning against this member (LOSSES' weight)."""
        not_wins = self.losses + self.draws / 2
        return (not_wins + NOT_WIN_PRIOR) / (self.games + 2 * NOT_WIN_PRIOR)


def expected_score(rating: float, opponent: float) -> float:
    """Elo's expected score of a player rated `rating` against one rated `opponent`."""
    return 1.0 / (1.0 + 10.0 ** ((opponent - rating) / ELO_SCALE))


class League:
    """One trained adapter's league: its kept versions, their ratings and the draw of opponents."""

    def __init__(self, adapter: str, size: int, every: int, pick: Pick, seed: int) -> None:
        if size < 1:
            raise ValueError(f"league size must be >= 1, got {size}")
        if every < 1:
            raise ValueError(f"league every must be >= 1, got {every}")
        self.adapter = adapter
        self.size = size
        self.every = every
        self.pick = Pick(pick)
        self.seed = seed
        self._rating = ELO_START
        self._history: list[Member] = []  # every member ever kept, oldest first (let go or not)
        self._pool: list[Member] = []  # oldest first
        self._anchor: Member | None = None
        self._games = 0  # every game recorded, against members let go included
        self._window_games = 0  # recorded since the last `figures()` (one step row's window)
        self._window_wins = 0

    # -- the pool ----------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """The version published after learner step `step` is to be kept (step 0 included)."""
        return step >= 0 and step % self.every == 0

    def keep(self, version: int, step: int) -> list[int]:
        """Keep `version` (published after learner step `step`), starting at the adapter's
        current rating; the first version ever kept is also the anchor. Returns the versions
        let go (the engine may drop them): the oldest over `size`, never the anchor."""
        if any(member.version == version for member in self._history):
            raise ValueError(f"league {self.adapter!r}: version {version} is already kept")
        if self._history and version < self._history[-1].version:
            raise ValueError(f"league {self.adapter!r}: versions must increase: {version} after "
                             f"{self._history[-1].version}")
        member = Member(version=version, kept_at=step, elo=self._rating)
        self._history.append(member)
        self._pool.append(member)
        if self._anchor is None:
            self._anchor = member
        let_go: list[int] = []
        while len(self._pool) > self.size:
            gone = self._pool.pop(0)
            if gone is not self._anchor:  # the anchor leaves the pool but stays registered
                let_go.append(gone.version)
        return let_go

    def drop(self, version: int) -> None:
        """A kept version that cannot be served any more (a resumed run's engine refused it): out
        of the pool, so no game draws it; its record stays in the history (an anchor stays the
        anchor: held-out games against it are left out)."""
        self._pool = [member for member in self._pool if member.version != version]

    @property
    def members(self) -> list[Member]:
        """The pool, oldest first (what training games draw from)."""
        return list(self._pool)

    @property
    def anchor(self) -> Member | None:
        """The first version kept, which evaluation plays against; None before any keep."""
        return self._anchor

    @property
    def rating(self) -> float:
        """The current adapter's Elo rating."""
        return self._rating

    def kept_versions(self) -> list[int]:
        """Every version the engine must keep registered: the pool and the anchor, sorted."""
        versions = {member.version for member in self._pool}
        if self._anchor is not None:
            versions.add(self._anchor.version)
        return sorted(versions)

    # -- games -------------------------------------------------------------------------------

    def draw(self, game_key: int) -> Member:
        """The opponent of game `game_key`: a function of (seed, game key, pool state) only, so
        concurrent draws and a resumed run draw the same. Raises LookupError on an empty pool."""
        if not self._pool:
            raise LookupError(f"league {self.adapter!r} has no member to draw yet: keep a version first")
        if self.pick is Pick.LATEST:
            return self._pool[-1]
        # Seeded per game from a string (hashed by sha512, not Python's salted hash): the same in
        # every process. The pool's versions are in the seed, so a changed pool draws afresh.
        pool = ",".join(str(member.version) for member in self._pool)
        rng = random.Random(f"{self.seed}:{game_key}:{pool}")
        if self.pick is Pick.UNIFORM:
            return rng.choice(self._pool)
        weights = [member.not_win_weight for member in self._pool]
        return rng.choices(self._pool, weights=weights)[0]

    def record(self, version: int, result: GameResult) -> None:
        """One finished game of the current adapter against kept version `version`. Against a
        member already let go only the adapter's rating moves (against that member's last
        rating); the member is not counted, since it no longer plays. The anchor is never let go:
        its games (evaluation's, or training's while it is in the pool) move its rating too."""
        member = self._member(version)
        let_go = member.version not in self.kept_versions()
        delta = ELO_K * (result.score - expected_score(self._rating, member.elo))
        self._rating += delta
        self._games += 1
        self._window_games += 1
        self._window_wins += int(result is GameResult.WIN)
        if let_go:
            return
        member.elo -= delta  # Elo is zero-sum: the member loses what the adapter gains
        member.games += 1
        member.wins += int(result is GameResult.WIN)
        member.draws += int(result is GameResult.DRAW)
        member.losses += int(result is GameResult.LOSS)

    def _member(self, version: int) -> Member:
        for member in self._history:
            if member.version == version:
                return member
        raise ValueError(f"league {self.adapter!r} never kept version {version} (kept: "
                         f"{[m.version for m in self._history]})")

    # -- reports -----------------------------------------------------------------------------

    def figures(self) -> dict[str, float]:
        """A step row's league figures. `league_win_rate` covers the games recorded since the
        last call (one row's window) and is left out when there were none."""
        figures = {"league_size": float(len(self._pool)), "league_elo": self._rating,
                   "league_games": float(self._games)}
        if self._window_games:
            figures["league_win_rate"] = self._window_wins / self._window_games
        kept_versions = self.kept_versions()
        kept = [member for member in self._history if member.version in kept_versions]
        if kept:
            figures["league_elo_best_kept"] = max(member.elo for member in kept)
        self._window_games = self._window_wins = 0
        return figures

    def summary(self) -> dict[str, Any]:
        """The league at the end of a run (JSON-able): the adapter's rating, the anchor and every
        member ever kept, with `in_pool` false for those let go."""
        pool = {member.version for member in self._pool}
        return {
            "adapter": self.adapter,
            "rating": self._rating,
            "games": self._games,
            "anchor": None if self._anchor is None else self._anchor.version,
            "members": [{**asdict(member), "in_pool": member.version in pool} for member in self._history],
        }

    # -- checkpoint --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs (JSON-able), its config included."""
        return {
            "adapter": self.adapter, "size": self.size, "every": self.every, "pick": self.pick.value,
            "seed": self.seed, "rating": self._rating, "games": self._games,
            "window_games": self._window_games, "window_wins": self._window_wins,
            "history": [asdict(member) for member in self._history],
            "pool": [member.version for member in self._pool],
            "anchor": None if self._anchor is None else self._anchor.version,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], adapter: str | None = None) -> "League":
        """The league `state_dict` saved. Given `adapter` (the run's own), a state of another
        adapter is refused."""
        if adapter is not None and state["adapter"] != adapter:
            raise ValueError(f"league state is of adapter {state['adapter']!r}, not {adapter!r}: "
                             "resume from this adapter's own league state")
        league = cls(state["adapter"], int(state["size"]), int(state["every"]), Pick(state["pick"]),
                     int(state["seed"]))
        league._rating = float(state["rating"])
        league._games = int(state["games"])
        league._window_games = int(state["window_games"])
        league._window_wins = int(state["window_wins"])
        league._history = [Member(**member) for member in state["history"]]
        league._pool = [league._member(version) for version in state["pool"]]
        league._anchor = None if state["anchor"] is None else league._member(state["anchor"])
        return league

    def restore(self, state: dict[str, Any]) -> None:
        """Take a resumed run's league (`state_dict`) in place: its pool, ratings and counts. Its
        settings must be this league's: the engine's slots were sized for them."""
        saved = League.from_state(state, self.adapter)
        mine = (self.size, self.every, str(self.pick), self.seed)
        theirs = (saved.size, saved.every, str(saved.pick), saved.seed)
        if mine != theirs:
            raise ValueError(f"league {self.adapter!r}: the checkpoint's league has size, every, pick and seed "
                             f"{theirs}, this run's config {mine}: a resumed run keeps its league's settings")
        self.__dict__.update(saved.__dict__)


def league_line(summary: dict[str, Any]) -> str:
    """A league's `summary()` in one line: the adapter's rating, then each kept version's."""
    members = ", ".join(f"v{m['version']} {m['elo']:.0f}" + ("" if m["in_pool"] else " (let go)")
                        for m in summary["members"])
    return f"Elo {summary['rating']:.0f} after {summary['games']} games; kept: {members or 'none'}"
