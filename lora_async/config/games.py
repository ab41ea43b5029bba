"""A game's seats in the config: who plays the other seats (`task.opponents`), who the held-out
games are played against (`task.eval_opponents`), and the pool of past versions (`[task.league]`).

Only an environment whose factory builds a game (`envs.game.Game`) reads these; the check that
the task is a game happens when the task loads (`envs.games`), where the factory is called.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field

from .sections import Section

# 'self', 'league', 'base', 'scripted:<player>', '<adapter>' or '<adapter>@v<k>' ('self@v0' included)
OPPONENT_RE = re.compile(r"^(self|league|base|scripted:[A-Za-z0-9_-]{1,64}|[A-Za-z_][A-Za-z0-9_-]{0,63}(@v[0-9]{1,9})?)$")
RESERVED = ("self", "league", "base")  # opponent words, never read as an adapter's name
OPPONENTS_TEXT = ("'self' (this adapter's newest version, every seat trained), 'league' (past versions, "
                  "[task.league]), 'base' (the base model), 'scripted:<player>' (one of the game's scripted "
                  "players), '<adapter>' (another adapter of the fleet, its newest version) or '<adapter>@v<k>' (a "
                  "frozen version; 'self@v0' is this adapter's start)")


class LeagueConfig(Section):
    """`task.opponents = "league"`: past versions kept as frozen opponents, each a LoRA slot."""

    every: int = Field(4, ge=1, le=1_000_000,
                       description="Keep the adapter's published version every this many versions (v0 first) as a "
                                   "frozen opponent.")
    size: int = Field(8, ge=1, le=64, description="Past versions in the pool at most (the oldest leaves first; v0 "
                                                  "stays registered as the anchor the held-out games play).")
    pick: Literal["latest", "uniform", "losses"] = Field(
        "losses", description="How each group of games draws its opponent from the pool: the newest, uniformly, "
                              "or weighted towards the versions this adapter loses to (its smoothed rate of not "
                              "winning against each).")


def check_opponent(value: str) -> str:
    if not OPPONENT_RE.fullmatch(value):
        raise ValueError(f"{value!r} is not an opponent: use {OPPONENTS_TEXT}")
    return value


