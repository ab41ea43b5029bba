"""The builtin arithmetic task: `a op b` with configurable digits and operations.

The held-out split is a fixed function of the problem itself (a hash), the same for every run
and seed: about 30% of the problem space on small spaces (1-digit addition has only 100
problems), capped at `heldout`. Training draws uniformly from the rest.
"""

from __future__ import annotations

import hashlib
import random

from ..config import ArithmeticTask
from ..rewards import Rewards, make_rewards
from .problems import Problem, RewardStats

HELDOUT_PERCENT = 30  # share of the problem space kept for evaluation
ENUMERATE_LIMIT = 200_000  # spaces up to this size are listed exhaustively for the split


class ArithmeticProblems:
    name = "arithmetic"

    def __init__(self, config: ArithmeticTask, seed: int) -> None:
        self.config = config
        self.seed = seed
        self.system_prompt = config.system_prompt
        self.stats = RewardStats()
        self.rewards: Rewards = make_rewards(["numeric"], None, timeout_s=1.0, workers=1, stats=self.stats)
        d = config.digits
        self.lo, self.hi = (0 if d == 1 else 10 ** (d - 1)), 10**d - 1
        self._heldout = self._build_heldout()

    def _is_heldout(self, a: int, op: str, b: int) -> bool:
        digest = hashlib.blake2s(f"{a}{op}{b}".encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little") % 100 < HELDOUT_PERCENT

    def _problem(self, index: int, a: int, op: str, b: int) -> Problem:
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        prompt = self.config.template.format(a=a, op=op, b=b)
        return Problem(index, prompt, str(answer))

    def _build_heldout(self) -> list[Problem]:
        span = self.hi - self.lo + 1
        ops = self.config.ops
        found: list[tuple[int, str, int]] = []
        if span * span * len(ops) <= ENUMERATE_LIMIT:
            found = [(a, op, b) for op in ops for a in range(self.lo, self.hi + 1)
                     for b in range(self.lo, self.hi + 1) if self._is_heldout(a, op, b)]
            random.Random("heldout").shuffle(found)
        else:
            rng = random.Random("heldout")
            seen: set[tuple[int, str, int]] = set()
            while len(found) < self.config.heldout:
                item = (rng.randint(self.lo, self.hi), rng.choice(ops), rng.randint(self.lo, self.hi))
                if item not in seen and self._is_heldout(*item):
                    seen.add(item)
                    found.append(item)
        return [self._problem(i, *item) for i, item in enumerate(found[: self.config.heldout])]

    def train_problem(self, index: int) -> Problem:
        rng = random.Random(f"{self.seed}:{index}")
        while True:
            a, b = rng.randint(self.lo, self.hi), rng.randint(self.lo, self.hi)
            op = rng.choice(self.config.ops)
            if not self._is_heldout(a, op, b):
                return self._problem(index, a, op, b)

    def describe(self) -> str:
        return (f"arithmetic: {self.config.digits}-digit {' '.join(self.config.ops)}, {len(self._heldout)} held out; "
                "reward numeric gets completion, answer")

    def heldout(self) -> list[Problem]:
        return list(self._heldout)

    def close(self) -> None:
        pass
