"""Rewards: builtin ones by name, and user functions in three forms, run concurrently.

    builtin.py     exact / numeric / regex:<pattern>, in-process
    code.py        code_tests: a completion's program run against the record's tests in the sandbox
    functions.py   one function of any form (per sample, batched TRL-style, async) scoring a group
    scoring.py     a task's functions with their weights: `Rewards.score(batch) -> Scores`

A user function runs in a `guarded.GuardedPool`: a step's completions score at once, a call past
`reward_timeout_s` is cut off alone, and a function that raises, hangs or crashes scores 0 and
is counted without taking the run down.
"""

from .builtin import exact_reward, final_number, numeric_reward
from .functions import Batch, Call, Prompt, RewardError, RewardFunction
from .scoring import Rewards, Scores, make_rewards

__all__ = ["Batch", "Call", "Prompt", "RewardError", "RewardFunction", "Rewards", "Scores", "exact_reward",
           "final_number", "make_rewards", "numeric_reward"]
