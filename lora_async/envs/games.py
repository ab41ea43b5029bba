"""A game task as a rollout source: the adapter plays its seat, `task.opponents` the others.

A training group is `samples_per_prompt` games of one problem, played concurrently against the
same opponent: the adapter in the same seat (`task.seat`, or seat `index mod seats` with
"alternate"), so the group-normalised advantage compares like with like. The adapter's seat is
trained; with `opponents = "self"` every seat is its own and every seat trains it. Another
adapter of the fleet, a pinned version, the base model and the game's scripted players are
frozen: their replies are context for their own seat only. In a fleet, two adapters that play
each other (or cooperate, sharing a reward) each train on their own games.

With `opponents = "league"`, a group's opponent is drawn from the adapter's `League` (past
versions the run keeps registered in the engine: `orchestrator.league`), and each game's result
moves the league's Elo ratings. Held-out games are greedy, each problem played once against
each of `task.eval_opponents`, the adapter's seat alternating with the problem: win, draw and
loss rates against each; `accuracy` is the win rate against the first.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any, Callable

from ..generator.types import GenStatus
from ..config import EnvTask
from ..league import GameResult, League, Pick
from ..outcomes import EpisodeStats, Outcome
from ..rollout import EvalResult, Generate, GroupRollout, RolloutContext, sub_seed
from ..timing import NO_WAITS, Waits
from ..tokenizer import Tokenizer
from .base import Split
from .episode import EpisodeAborted, EpisodeError, EpisodeSettings, Trajectory, call_env
from .game import check_game, is_game
from .match import Kind, Match, MatchRecord, Opponent, SeatPolicy
from .source import EnvLoadError, EnvSource, load_object, transcript

if TYPE_CHECKING:
    from ..config import TrainConfig


class GameSource(EnvSource):
    """One adapter's game task (`rollout.RolloutSource`)."""

    name = "game"

    def __init__(self, config: EnvTask, seed: int, where: str, adapter: str, settings: EpisodeSettings,
                 eval_settings: EpisodeSettings, group_size: int, in_flight: int = 1) -> None:
        super().__init__(config, seed, where, adapter, settings, eval_settings, group_size, in_flight)
        task = where.removesuffix(".env")
        probe: Any = self.factory(0, "train")  # a game: checked below
        try:
            check_game(probe, f"{where} = {config.env!r}")
        except TypeError as exc:
            raise EnvLoadError(str(exc)) from None
        if config.reward is not None:
            raise EnvLoadError(f"{task}.reward: a game pays each seat its own reward (Move.rewards); "
                               "leave task.reward out")
        self.seats: tuple[str, ...] = tuple(probe.seats)
        self.players = sorted(getattr(probe, "players", {}) or {})
        if config.seat != "alternate" and config.seat not in self.seats:
            raise EnvLoadError(f"{task}.seat: {config.seat!r} is not a seat of {config.env} "
                               f"({', '.join(self.seats)}), nor 'alternate'")
        self.opponent = self._opponent(config.opponents, f"{task}.opponents", training=True)
        named = config.eval_opponents or ["self@v0", *(f"scripted:{p}" for p in self.players)]
        self.eval_opponents = [self._opponent(o, f"{task}.eval_opponents", training=False) for o in named]
        self.league = (League(adapter, config.league.size, config.league.every, Pick(config.league.pick), seed)
                       if self.opponent.kind is Kind.LEAGUE else None)

    def _opponent(self, text: str, field: str, training: bool) -> Opponent:
        opponent = Opponent.parse(text, self.adapter)
        if opponent.kind is Kind.SCRIPTED and opponent.player not in self.players:
            raise EnvLoadError(f"{field}: {self.config.env} has no scripted player {opponent.player!r} "
                               f"(it has: {', '.join(self.players) or 'none'})")
        if not training and opponent.kind in (Kind.SELF, Kind.LEAGUE):
            raise EnvLoadError(f"{field}: {text!r} is not a held-out opponent: name a fixed one ('self@v0', "
                               "'base', 'scripted:<player>' or another adapter)")
        return opponent

    def pinned(self) -> list[tuple[str, int]]:
        """The frozen versions the games name (`self@v0`, `other@v3`): the run keeps them registered."""
        found = (o.pinned for o in [self.opponent, *self.eval_opponents])
        return sorted({p for p in found if p is not None})

    def describe(self) -> str:
        line = (f"game {self.config.env} (seats: {', '.join(self.seats)}; this adapter plays "
                f"{self.config.seat}; opponents: {self.config.opponents}")
        if self.league is not None:
            league = self.config.league
            line += f", a version kept every {league.every}, {league.size} at most, drawn by {league.pick}"
        return (line + f"; held out: {len(self.heldout())} games against each of "
                f"{', '.join(o.text for o in self.eval_opponents)})")

    # ---------------------------------------------------------------- seats
    def seat_of(self, index: int) -> str:
        return self.seats[index % len(self.seats)] if self.config.seat == "alternate" else self.config.seat

    def policies(self, index: int, opponent: Opponent, adapter: str | None, trained: bool) -> dict[str, SeatPolicy]:
        """Who plays each seat of game `index`: `adapter` its seat (trained or not), `opponent` the others."""
        own = SeatPolicy(adapter, trained=trained and adapter is not None)
        other = {Kind.SELF: own, Kind.BASE: SeatPolicy(None), Kind.SCRIPTED: SeatPolicy(player=opponent.player),
                 Kind.ADAPTER: SeatPolicy(opponent.adapter, opponent.version)}[opponent.kind]
        return {seat: own if seat == self.seat_of(index) else other for seat in self.seats}

    # ---------------------------------------------------------------- training
    async def rollout(self, index: int, ctx: RolloutContext) -> GroupRollout:
        """Play, score and package one group of games against one opponent."""
        opponent, member = self.opponent, None
        if self.league is not None:
            member = self.league.draw(index)
            opponent = Opponent(f"{self.adapter}@v{member.version}", Kind.ADAPTER, self.adapter, member.version)
        policies = self.policies(index, opponent, self.adapter, trained=True)
        settings = self.settings if ctx.partial else dataclasses.replace(self.settings, partial=False)
        played = await asyncio.gather(*(self.play_game(index, "train", ctx.tokenizer, settings, ctx.generate,
                                                       policies, ctx.tag, (self.adapter, index), ctx.waits,
                                                       sub_seed(ctx.seed, i))
                                        for i in range(self.group_size)), return_exceptions=True)
        unexpected = [p for p in played if isinstance(p, BaseException) and not isinstance(p, EpisodeAborted)]
        if unexpected:
            raise unexpected[0]
        games = [p for p in played if isinstance(p, MatchRecord)]
        trained = [t for g in games for seat, t in g.trajectories.items() if policies[seat].trained]
        # a game that broke before a trained seat replied has no trajectory of it: counted all the same
        unplayed = [Trajectory([], outcome=Outcome.ENV_ERROR, error=g.error) for g in games
                    if g.outcome is Outcome.ENV_ERROR and not any(policies[s].trained for s in g.trajectories)]
        stats = EpisodeStats.of(trained + unplayed)
        broken = next((g for g in games if g.outcome is Outcome.ENV_ERROR), None)
        fault = None if broken is None else ("the game failed (it scores 0 and is not trained on; counted as "
                                             f"env_errors): {broken.error}")
        if member is not None and self.league is not None:
            for game in games:
                if game.outcome is not Outcome.ENV_ERROR:
                    self.league.record(member.version, game.results[self.seat_of(index)])
        return self.group_of(index, played, trained, stats, fault)

    async def play_game(self, index: int, split: Split, tokenizer: Tokenizer, settings: EpisodeSettings,
                        generate: Generate, policies: dict[str, SeatPolicy], tag: object, group: object = None,
                        waits: Waits = NO_WAITS, seed: int | None = None) -> MatchRecord:
        """One game of problem `index`; the game's faults end it as `env_error` (counted)."""
        try:
            game = await call_env(self.factory, index, split, timeout_s=self.config.env_timeout_s,
                                  what="the factory")
            check_game(game, self.where)
            record = await Match(game, self.renderer(tokenizer), settings, generate, policies, tag, group, waits,
                                 seed).play()
        except (EpisodeError, TypeError) as exc:
            record = MatchRecord({}, {}, Outcome.ENV_ERROR, {}, error=str(exc))
        if record.outcome is Outcome.ENV_ERROR:
            self.stats.record_error(f"{self.config.env}: {record.error}")
        self.stats.calls += 1
        return record

    # ---------------------------------------------------------------- held out
    async def evaluate(self, generate: Generate, tokenizer: Tokenizer, adapter: str | None, limit: int = 0,
                       done: Callable[[], None] | None = None) -> EvalResult:
        """Greedy games on the held-out split against each held-out opponent: win, draw and loss
        rates (`vs_<opponent>/win`, ...); `accuracy` is the success rate against the first (the
        win rate; in a game no one wins, a cooperative one, the games it counts a success). A
        frozen opponent the engine does not hold (a version not published yet, or `lora-async
        eval` on a saved adapter) is left out, and the next one gives the accuracy."""
        indices = self.heldout()[: limit or None]

        async def one(index: int, opponent: Opponent) -> MatchRecord | None:
            try:
                return await self.play_game(index, "eval", tokenizer, self.eval_settings, generate,
                                            self.policies(index, opponent, adapter, trained=False), None)
            except EpisodeAborted as exc:
                if opponent.pinned is not None and exc.result.status is GenStatus.REFUSED:
                    return None  # a frozen version not registered here (yet): its games are left out
                raise
            finally:
                if done is not None:
                    done()

        played = await asyncio.gather(*(one(i, o) for o in self.eval_opponents for i in indices),
                                      return_exceptions=True)
        failed = next((p for p in played if isinstance(p, BaseException)), None)
        if failed is not None:
            raise RuntimeError(f"evaluation game failed: {failed}")
        extra: dict[str, float | int] = {}
        own: list[Trajectory] = []
        first: list[float] = []
        for k, opponent in enumerate(self.eval_opponents):
            mine_played = played[k * len(indices):(k + 1) * len(indices)]
            if any(r is None for r in mine_played):  # not served here: every game of it left out, or none
                continue
            records = [(r, i) for r, i in zip(mine_played, indices) if isinstance(r, MatchRecord)]
            broken = sum(r.outcome is Outcome.ENV_ERROR for r, _ in records)
            if broken:  # the game's fault, not the adapter's: counted, not a result
                extra[f"vs_{opponent.label}/env_errors"] = broken
            games = [(r, i) for r, i in records if r.outcome is not Outcome.ENV_ERROR]
            if not games:
                continue
            mine = [r.results[self.seat_of(i)] for r, i in games]
            for result in GameResult:
                extra[f"vs_{opponent.label}/{result.value}"] = mine.count(result) / len(mine)
            first = first or [float(r.success(self.seat_of(i))) for r, i in games]
            own += [t for r, i in games if (t := r.trajectories.get(self.seat_of(i))) is not None]
        stats = EpisodeStats.of(own)
        versions = [v for t in own for v, trained in zip(t.versions, t.trained) if v >= 0]
        return EvalResult(adapter=adapter, version=max(versions) if adapter is not None and versions else None,
                          accuracy=sum(first) / len(first) if first else 0.0,
                          mean_reward=sum(t.reward for t in own) / len(own) if own else 0.0,
                          n=len(first),
                          examples=[transcript(t) for t in own[:3]], extra={**extra, **stats.eval_figures()})

    async def opening_ids(self, index: int, split: Split, tokenizer: Tokenizer) -> list[int] | None:
        """The rendered opening of the seat this adapter plays in game `index` (the canary's prompt)."""
        try:
            game = await self.build(index, split)
            openings = await call_env(game.reset, timeout_s=self.config.env_timeout_s, what="reset")
            return self.renderer(tokenizer).opening(openings[self.seat_of(index)])
        except (EpisodeError, TypeError, KeyError):
            return None


GAME_FIELDS = ("seat", "opponents", "eval_opponents", "league")  # what only a game reads


def is_game_task(config: EnvTask, where: str) -> bool:
    """Whether `task.env` builds a game (its first training problem has seats). A single-seat
    environment that sets a game's fields is refused (EnvLoadError, naming the field); a factory
    that fails says so when its source loads."""
    try:
        game = is_game(load_object(config.env, where)(0, "train"))
    except Exception:
        return False
    task = where.removesuffix(".env")
    stray = [f for f in GAME_FIELDS if f in config.model_fields_set]
    if not game and stray:
        raise EnvLoadError(f"{task}.{stray[0]}: {config.env} is a single-seat environment; only a game (one "
                           "with seats, lora_async.envs.game.Game) has seats and opponents")
    return game


def kept_versions(config: "TrainConfig") -> int:
    """Frozen versions a run's games keep registered beyond the staleness window, at most: LoRA
    slots of their own (`EngineSpec.kept`). Each game task's `EnvTask.kept_versions`; a
    single-seat environment keeps none (finding out calls its factory once, as loading it does)."""
    return sum(spec.task.kept_versions for spec in config.adapter_specs
               if isinstance(spec.task, EnvTask) and is_game_task(spec.task, f"{spec.task_path}.env"))
