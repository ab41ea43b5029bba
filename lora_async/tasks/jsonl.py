"""A task read from a JSONL file: prompt and answer fields, rewards by name or user functions.

A record is one line; how it becomes a problem (chat prompts, the fields a reward gets) is
`records.record_problem`. The last `heldout` records are held out for evaluation.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..config import JsonlTask
from ..rewards import RewardError
from .problems import Problem
from .records import CHAT_SHAPE, NotChatError, RecordProblems, record_problem


class JsonlProblems(RecordProblems):
    name = "jsonl"

    def __init__(self, config: JsonlTask, seed: int, reward_workers: int = 1) -> None:
        self.config = config
        records = self._read(Path(config.path))
        if len(records) <= config.heldout:
            raise RewardError(
                f"{config.path}: {len(records)} records but task.heldout={config.heldout}; "
                "nothing would be left to train on"
            )
        cut = len(records) - config.heldout
        self._train = records[:cut]
        super().__init__(config, seed, reward_workers, config.path, cut, records[cut:])

    def _read(self, path: Path) -> list[Problem]:
        records: list[Problem] = []
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(record_problem(len(records), json.loads(line), self.config.prompt_field,
                                              self.config.answer_field))
            except NotChatError:
                raise RewardError(f"{path}:{line_no}: field {self.config.prompt_field!r} is a list but not chat "
                                  f"messages {CHAT_SHAPE}") from None
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise RewardError(f"{path}:{line_no}: bad record ({type(exc).__name__}: {exc})") from None
        if not records:
            raise RewardError(f"{path}: no records")
        return records

    def _train_record(self, position: int) -> Problem:
        return self._train[position]
