"""Rewards that wait, as real ones do: `lora-async train examples/slow_reward.toml`.

`sandbox` stands in for running a completion in a code sandbox or asking a judge: it takes
0.4 s at the median and sometimes several seconds (lognormal, sigma 1), the same time for the
same text. `brief` is a batched, TRL-style function that favours short answers. Imported from
the repository root as `examples.sandbox_rewards`.
"""

import math
import random
import re
import time

MEDIAN_S, SIGMA = 0.4, 1.0


def sandbox(completion: str, answer: str) -> float:
    """1.0 when the last number in the completion is the answer; takes a sandbox's time."""
    time.sleep(random.Random(completion).lognormvariate(math.log(MEDIAN_S), SIGMA))
    numbers = re.findall(r"-?\d+", completion)
    return float(bool(numbers) and numbers[-1] == answer.strip())


def brief(completions: list[str], **kwargs) -> list[float]:
    """Batched (TRL's convention): 1.0 for an answer of at most 12 characters."""
    return [1.0 if len(c.strip()) <= 12 else 0.0 for c in completions]
