"""Guess the number: the model guesses, the environment answers "higher" or "lower", until it
is right or `task.max_turns` replies are spent. Reward 1 for finding it in one guess, 0.1 less
for every further guess, 0 for not finding it.

Episode lengths are long-tailed by nature: a lucky first guess ends at once, a search that
ignores the feedback runs to the turn limit, and replies that ramble instead of guessing cost
up to `sampling.max_new_tokens` each. That is the workload where a synchronous trainer idles
behind its longest episode (see `lora-async bench e2e`).

    [task]
    type = "env"
    env = "lora_async.envs.builtin.guess:make"
    max_turns = 8
"""

from __future__ import annotations

import random
import re

from ..base import Env, Message, Reply, StepResult, user

LOW, HIGH = 1, 16
STEP_COST = 0.1  # reward lost per guess after the first
INTEGER = re.compile(r"-?\d+")
RULES = (f"I picked a whole number from {LOW} to {HIGH}. Guess it: reply with only your guess. "
         "After each guess I say higher or lower.")
# One finished game in every opening: without it the base model answers the rules with prose
# and never a number (no reward to learn from).
EXAMPLE_GAME = [user(RULES), {"role": "assistant", "content": "8"}, user("Higher."),
                {"role": "assistant", "content": "12"}, user("Lower."), {"role": "assistant", "content": "10"},
                user("Correct! Let's play again.")]


class Guess(Env):
    def __init__(self, secret: int) -> None:
        self.secret = secret
        self.guesses = 0

    def reset(self) -> list[Message]:
        return [*EXAMPLE_GAME, user(RULES)]

    def step(self, reply: Reply) -> StepResult:
        found = INTEGER.search(reply.content)
        if found is None:
            return StepResult([user(f"Reply with only a number from {LOW} to {HIGH}.")])
        self.guesses += 1
        guess = int(found.group())
        if guess == self.secret:
            reward = max(0.0, 1.0 - STEP_COST * (self.guesses - 1))
            return StepResult(reward=reward, done=True, info={"success": True, "guesses": self.guesses})
        return StepResult([user("Higher." if guess < self.secret else "Lower.")],
                          info={"success": False, "guesses": self.guesses})


def make(index: int, split: str) -> Guess:
    """The secret of game `index`: a pure function of its arguments (held-out games differ by seed)."""
    return Guess(random.Random(f"guess:{split}:{index}").randint(LOW, HIGH))
