"""Environments: multi-turn episodes with tools, played token-in, token-out.

    base.py      the interface a user writes: Env (reset, step, tools), Reply, StepResult
    tools.py     tool schemas (transformers' get_json_schema), call parsing, guarded tool workers
    render.py    the chat template as token deltas (nothing in the context is re-tokenised)
    episode.py   one episode: turns on the newest version, partial rollouts, faults as outcomes
    source.py    a `[task] type = "env"` as a rollout source: the factory loaded by module path and
                 checked at startup; groups of episodes played at once; greedy held-out episodes
    game.py      the interface of a game: an environment with seats (Game, Move)
    match.py     one game: each seat's own conversation and trajectory, who plays each (SeatPolicy)
    games.py     a game task as a rollout source: the adapter's seat, its opponents, held-out win rates
    builtin/     environments that ship with lora-async (calculator, sandbox, programs, guess, nim, relay)
"""

from .base import Env, Message, Reply, StepResult, ToolCall, ToolResult, system, user

__all__ = ["Env", "Message", "Reply", "StepResult", "ToolCall", "ToolResult", "system", "user"]
