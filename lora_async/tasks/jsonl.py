"""A task read from a JSONL file: prompt and answer fields, rewards by name or user functions.

A record is one line; how it becomes a problem (chat prompts, the fields a reward gets) is
`records.record_problem`. The last `heldout` records are held out for evaluation. A file that
cannot be used (a bad record, too few records) is a `TaskDataError` naming the file and line.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..config import JsonlTask
from .problems import Problem, TaskDataError
from .records import CHAT_SHAPE, NotChatError, RecordProblems, record_problem


class JsonlProblems(RecordProblems):
    name = "jsonl"

    def __init__(self, config: JsonlTask, seed: int, reward_workers: int = 1) -> None:
        self.config = config
        records = self._read(Path(config.path))
        if len(records) <= config.heldout:
            raise TaskDataError(
                f"{config.path}: {len(records)} records but task.heldout={config.heldout}; "
                "nothing would be left to train on"
            )
        cut = len(records) - config.heldout
        self._train = records[:cut]
        super().__init__(config, seed, reward_workers, config.path, cut, records[cut:])

    def _read(self, path: Path) -> list[Problem]:
        records: list[Problem] = []
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                records.append(self._record(len(records), line, f"{path}:{line_no}"))
        if not records:
            raise TaskDataError(f"{path}: no records")
        return records

    def _record(self, index: int, line: str, where: str) -> Problem:
        """One line's problem, or a `TaskDataError` naming the file and line (`where`)."""
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskDataError(f"{where}: bad record, not JSON ({exc})") from None
        if not isinstance(row, dict):
            raise TaskDataError(f"{where}: bad record, a JSON {type(row).__name__} where a record is an object")
        try:
            return record_problem(index, row, self.config.prompt_field, self.config.answer_field)
        except NotChatError:
            raise TaskDataError(f"{where}: field {self.config.prompt_field!r} is a list but not chat messages "
                                f"{CHAT_SHAPE}") from None
        except KeyError as exc:
            raise TaskDataError(f"{where}: bad record, no field {exc}") from None

    def _train_record(self, position: int) -> Problem:
        return self._train[position]
