"""A task read from a JSONL file: prompt and answer fields, rewards by name or user functions.

Every other field of a record rides along in `Problem.fields`, so a user reward can ask for
it by name (`def score(completion, difficulty)`); so does the answer under its own column name
when that is not `answer` (TRL's `accuracy_reward` asks for `solution`). A prompt that is a
list of chat messages is a chat prompt: rendered as it is, and TRL-style rewards get its
completions as messages.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from ..config import JsonlTask
from ..rewards import RewardError, Rewards, make_rewards
from .problems import Messages, Problem, RewardStats

# What a reward gets besides the record's fields; a record field of one of these names is dropped.
ROLE_FIELDS = ("prompt", "completion", "answer")


class JsonlProblems:
    name = "jsonl"

    def __init__(self, config: JsonlTask, seed: int, reward_workers: int = 1) -> None:
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
        self.rewards: Rewards = make_rewards(config.reward_list(), config.reward_weights, config.reward_timeout_s,
                                             reward_workers, self.stats)

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
            taken = (self.config.prompt_field, *ROLE_FIELDS)
            fields = {k: v for k, v in row.items() if k not in taken}
            records.append(Problem(len(records), self._prompt(prompt, path, line_no), str(answer), fields))
        if not records:
            raise RewardError(f"{path}: no records")
        return records

    def _prompt(self, value: Any, path: Path, line_no: int) -> str | Messages:
        """Text, or a chat: a list of {"role", "content"} messages (TRL's conversational format)."""
        if not isinstance(value, list):
            return str(value)
        if not value or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                and isinstance(m.get("content"), str) for m in value):
            raise RewardError(f"{path}:{line_no}: field {self.config.prompt_field!r} is a list but not chat messages "
                              '([{"role": ..., "content": ...}, ...])')
        return [{"role": m["role"], "content": m["content"]} for m in value]

    def train_problem(self, index: int) -> Problem:
        # Epochs of a seeded permutation: every record once per epoch, order fixed by seed.
        epoch, offset = divmod(index, len(self._train))
        order = list(range(len(self._train)))
        random.Random(f"{self.seed}:epoch{epoch}").shuffle(order)
        record = self._train[order[offset]]
        return Problem(index, record.prompt, record.answer, record.fields)

    def heldout(self) -> list[Problem]:
        return list(self._heldout)

    def describe(self) -> str:
        return f"{self.config.path}: {len(self._train)} training records, {len(self._heldout)} held out; " \
               + self.reward_line()

    def reward_line(self) -> str:
        """A startup line naming the fields the reward gets, judged by the first record."""
        return self.rewards.describe([*ROLE_FIELDS, *self._train[0].fields])

    def close(self) -> None:
        self.rewards.close()
