"""A task read from a JSONL file: prompt and answer fields, reward by name or user function.

Every other field of a record rides along in `Problem.fields`, so a user reward can ask for
it by name (`def score(completion, difficulty)`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from ..config import JsonlTask
from .problems import Problem, RewardStats
from .rewards import RewardError, make_reward, safe_rewards

# What a reward gets besides the record's fields; a record field of one of these names is dropped.
ROLE_FIELDS = ("prompt", "completion", "answer")


class JsonlProblems:
    name = "jsonl"

    def __init__(self, config: JsonlTask, seed: int) -> None:
        self.config = config
        self.seed = seed
        self.system_prompt = config.system_prompt
        self.stats = RewardStats()
        records = self._read(Path(config.path))
        if len(records) <= config.heldout:
            raise RewardError(
                f"{config.path}: {len(records)} records but task.heldout={config.heldout}; "
                "nothing would be left to train on"
            )
        cut = len(records) - config.heldout
        self._train = records[:cut]
        self._heldout = [Problem(i, p.prompt, p.answer, p.fields) for i, p in enumerate(records[cut:])]
        self._reward = make_reward(config.reward, config.reward_timeout_s, self.stats)

    def _read(self, path: Path) -> list[Problem]:
        records: list[Problem] = []
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt, answer = row[self.config.prompt_field], row[self.config.answer_field]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise RewardError(f"{path}:{line_no}: bad record ({type(exc).__name__}: {exc})") from None
            taken = (self.config.prompt_field, self.config.answer_field, *ROLE_FIELDS)
            fields = {k: v for k, v in row.items() if k not in taken}
            records.append(Problem(len(records), str(prompt), str(answer), fields))
        if not records:
            raise RewardError(f"{path}: no records")
        return records

    def train_problem(self, index: int) -> Problem:
        # Epochs of a seeded permutation: every record once per epoch, order fixed by seed.
        epoch, offset = divmod(index, len(self._train))
        order = list(range(len(self._train)))
        random.Random(f"{self.seed}:epoch{epoch}").shuffle(order)
        record = self._train[order[offset]]
        return Problem(index, record.prompt, record.answer, record.fields)

    def heldout(self) -> list[Problem]:
        return list(self._heldout)

    def rewards(self, problem: Problem, completions: list[str]) -> list[float]:
        return safe_rewards(self._reward, self.stats, problem, completions)

    def describe(self) -> str:
        return f"{self.config.path}: {len(self._train)} training records, {len(self._heldout)} held out; " \
               + self.reward_line()

    def reward_line(self) -> str:
        """A startup line naming the fields the reward gets, judged by the first record."""
        return self._reward.describe([*ROLE_FIELDS, *self._train[0].fields])

    def close(self) -> None:
        self._reward.close()
