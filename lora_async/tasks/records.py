"""Problem sets read from records (JSONL lines, dataset rows): a record becomes a `Problem`, and
the training records are served in seeded per-epoch order.

A record's prompt is text, or a chat: a list of {"role", "content"} messages (TRL's
conversational format), rendered as it is; TRL-style rewards then get its completions as
messages. Every other field of a record rides along in `Problem.fields`, so a user reward can
ask for it by name (`def score(completion, difficulty)`); so does the answer under its own
name when that is not `answer` (TRL's `accuracy_reward` asks for `solution`).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Mapping

from ..config.tasks import ProblemRewards
from ..rewards import Prompt, Rewards, make_rewards
from .problems import Problem, RewardStats

# What a reward gets besides the record's fields; a record field of one of these names is dropped.
ROLE_FIELDS = ("prompt", "completion", "answer")
CHAT_SHAPE = '([{"role": ..., "content": ...}, ...])'  # how an error shows what a chat prompt must be


class NotChatError(ValueError):
    """A prompt that is a list but not chat messages; the caller names where it was."""


def record_prompt(value: Any) -> Prompt:
    """Text, or a chat: a non-empty list of messages, each with a string role and content (other
    keys of a message are dropped). Raises `NotChatError` for any other list."""
    if not isinstance(value, list):
        return str(value)
    if not value or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                            and isinstance(m.get("content"), str) for m in value):
        raise NotChatError("a list but not chat messages")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def record_problem(index: int, row: Mapping[str, Any], prompt_key: str, answer_key: str) -> Problem:
    """The problem of one record (raises `NotChatError`, or KeyError for a missing key)."""
    prompt, answer = row[prompt_key], row[answer_key]
    taken = (prompt_key, *ROLE_FIELDS)
    fields = {k: v for k, v in row.items() if k not in taken}
    return Problem(index, record_prompt(prompt), str(answer), fields)


class RecordProblems:
    """`problems.Task` over records: `train_size` training records (`_train_record` gives each,
    by position), a fixed held-out list, and the rewards of `config`. Subclasses read the
    records, then call `__init__`."""

    name = "records"
    unit = "records"  # what describe() counts

    def __init__(self, config: ProblemRewards, seed: int, reward_workers: int, source: str, train_size: int,
                 heldout: list[Problem]) -> None:
        self.seed = seed
        self.system_prompt = config.system_prompt
        self.stats = RewardStats()
        self.source, self.train_size = source, train_size
        self._heldout = [dataclasses.replace(p, index=i) for i, p in enumerate(heldout)]
        self._order: tuple[int, list[int]] | None = None  # (epoch, permutation) of the latest epoch asked for
        self.rewards: Rewards = make_rewards(config.reward_list(), config.reward_weights, config.reward_timeout_s,
                                             reward_workers, self.stats, env=config.sandbox_env())
        self.sandbox = config.sandbox if "code_tests" in config.reward_list() else None

    def _train_record(self, position: int) -> Problem:
        raise NotImplementedError

    def train_problem(self, index: int) -> Problem:
        # Epochs of a seeded permutation: every record once per epoch, order fixed by seed.
        epoch, offset = divmod(index, self.train_size)
        if self._order is None or self._order[0] != epoch:
            order = list(range(self.train_size))
            random.Random(f"{self.seed}:epoch{epoch}").shuffle(order)
            self._order = (epoch, order)
        record = self._train_record(self._order[1][offset])
        return Problem(index, record.prompt, record.answer, record.fields)

    def heldout(self) -> list[Problem]:
        return list(self._heldout)

    def describe(self) -> str:
        return f"{self.source}: {self.train_size} training {self.unit}, {len(self._heldout)} held out; " \
               + self.reward_line()

    def reward_line(self) -> str:
        """A startup line naming the fields the reward gets, judged by the first record (and
        where code_tests runs the programs)."""
        line = self.rewards.describe([*ROLE_FIELDS, *self._train_record(0).fields])
        if self.sandbox is not None:
            from ..sandbox import describe

            line += "; programs run in " + describe(self.sandbox)
        return line

    def close(self) -> None:
        self.rewards.close()
