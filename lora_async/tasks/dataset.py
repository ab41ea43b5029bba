"""A task from a Hugging Face dataset (`task.type = "dataset"`), read with the `datasets` library.

The dataset is a local parquet, JSON/JSONL, CSV or arrow file (its one split is "train"), a
directory written by `save_to_disk` (a saved Dataset, not a DatasetDict, is the split "train"),
another local directory of data files, or a hub id. A row becomes a problem as a JSONL record
does (`records.record_problem`): the prompt column is text or chat messages, and every other
column reaches the rewards by name. Rows stay in the memory-mapped arrow table and become
problems when asked for; a row is plain Python (lists, dicts, str, numbers), so the rewards'
worker processes get no numpy or arrow values.

Held out: a split of its own (`heldout_split`), or a share of the training split drawn with
`heldout_seed` and removed from training (`heldout_share`), or nothing; at most `heldout_limit`
of them are evaluated. Every mistake a config can make here is a `TaskDataError` naming the
field, raised by `check_dataset` in the preflight, before any model loads.
"""

from __future__ import annotations

import logging
import random
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ..config import DatasetTask
from ..errors import error_line
from .problems import Problem, TaskDataError
from .records import CHAT_SHAPE, NotChatError, RecordProblems, record_problem, record_prompt

# The datasets library's builder for a local file, by suffix.
BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".arrow": "arrow"}
ONE_SPLIT = "train"  # the split of a single file or a saved Dataset: what `load_dataset` names it
INSTALL = "pip install 'lora-async[tasks]'"
MESSAGE_KEYS = ("role", "content")


@dataclass
class DatasetRows:
    """A dataset task's data as configured: the training split, which of its rows are trained on
    (None: all), and the held-out problems to evaluate."""

    source: str  # the path, with its configuration name
    train: Any  # datasets.Dataset, formatted as plain Python
    train_rows: list[int] | None
    heldout: list[Problem]

    @property
    def train_size(self) -> int:
        return len(self.train) if self.train_rows is None else len(self.train_rows)


class DatasetProblems(RecordProblems):
    name = "dataset"
    unit = "rows"

    def __init__(self, config: DatasetTask, seed: int, reward_workers: int = 1, where: str = "task") -> None:
        self.config, self.where = config, where
        self.data = open_dataset(config, where)
        super().__init__(config, seed, reward_workers, f"{self.data.source}, split {config.split!r}",
                         self.data.train_size, self.data.heldout)

    def _train_record(self, position: int) -> Problem:
        rows = self.data.train_rows
        row = position if rows is None else rows[position]
        return row_problem(self.data.train, row, self.config, self.where, self.data.source)


def check_dataset(config: DatasetTask, where: str) -> None:
    """Load the dataset (a local one in a second; a hub one downloads once, then is cached) and
    check its splits, columns, prompts and held-out rows. Raises `TaskDataError`."""
    from ..progress import stage

    with stage(f"{where}: loading and checking the dataset {config.path}"):
        open_dataset(config, where)


def open_dataset(config: DatasetTask, where: str) -> DatasetRows:
    splits, source = load_splits(config, where)
    for field, split in (("split", config.split), ("heldout_split", config.heldout_split)):
        if split is not None and split not in splits:
            raise TaskDataError(f"{where}.{field}: {split!r} is not a split of {source} "
                                f"(its splits: {', '.join(splits)})")
    train = splits[config.split].with_format(None)  # a saved dataset may keep a numpy format
    check_columns(train, config, where, source)
    if len(train) == 0:
        raise TaskDataError(f"{where}.split: {config.split!r} of {source} has no rows")
    if config.heldout_split is not None:
        held = splits[config.heldout_split].with_format(None)
        held_source = f"the {config.heldout_split!r} split of {source}"
        check_columns(held, config, where, held_source)
        count = min(len(held), config.heldout_limit)
        heldout = [row_problem(held, i, config, where, held_source) for i in range(count)]
        return DatasetRows(source, train, None, heldout)
    if config.heldout_share == 0:
        return DatasetRows(source, train, None, [])
    n = len(train)
    drawn = random.Random(config.heldout_seed).sample(range(n), max(1, round(n * config.heldout_share)))
    if len(drawn) >= n:
        raise TaskDataError(f"{where}.heldout_share: {config.heldout_share} of the {n} rows of {source} holds out "
                            f"{len(drawn)}; nothing would be left to train on (lower it, or use heldout_split)")
    heldout = [row_problem(train, i, config, where, source) for i in drawn[:config.heldout_limit]]
    return DatasetRows(source, train, sorted(set(range(n)) - set(drawn)), heldout)


def row_problem(dataset: Any, row: int, config: DatasetTask, where: str, source: str) -> Problem:
    try:
        return record_problem(row, dataset[int(row)], config.prompt_column, config.answer_column)
    except NotChatError:
        raise not_chat(row, config, where, source) from None


def not_chat(row: int, config: DatasetTask, where: str, source: str) -> TaskDataError:
    return TaskDataError(f"{where}.prompt_column: row {row} of {source}: {config.prompt_column!r} is a list but "
                         f"not chat messages {CHAT_SHAPE}")


def check_columns(dataset: Any, config: DatasetTask, where: str, source: str) -> None:
    """The prompt and answer columns exist, and every prompt is text or chat messages: read
    from the arrow table where its type says so, else row by row (a column of mixed JSON)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    for field, column in (("prompt_column", config.prompt_column), ("answer_column", config.answer_column)):
        if column not in dataset.column_names:
            raise TaskDataError(f"{where}.{field}: {column!r} is not a column of {source} "
                                f"(its columns: {', '.join(dataset.column_names)})")
    kind = dataset.data.schema.field(config.prompt_column).type
    if not (pa.types.is_nested(kind) or isinstance(kind, pa.ExtensionType)):
        return  # text, or a value written as text (a number)
    if is_chat_type(kind):
        values = dataset.with_format("arrow")[config.prompt_column]
        messages = pc.list_flatten(values)
        if not (values.null_count or pc.min(pc.list_value_length(values)).as_py() == 0
                or any(pc.struct_field(messages, k).null_count for k in MESSAGE_KEYS)):
            return
    for row, value in enumerate(dataset[config.prompt_column]):
        try:
            record_prompt(value)
        except NotChatError:
            raise not_chat(row, config, where, source) from None


def is_chat_type(kind: Any) -> bool:
    """An arrow list of structs with string `role` and `content` fields."""
    import pyarrow as pa

    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_struct(kind.value_type):
        return False
    item = kind.value_type
    return all(item.get_field_index(k) >= 0 and (pa.types.is_string(item.field(k).type)
                                                 or pa.types.is_large_string(item.field(k).type))
               for k in MESSAGE_KEYS)


def load_splits(config: DatasetTask, where: str) -> tuple[dict[str, Any], str]:
    """Every split of the dataset by name, and how errors name the dataset."""
    try:
        import datasets
    except ImportError:
        raise TaskDataError(f'{where}.type = "dataset" needs the datasets library: {INSTALL}') from None
    path = Path(config.path)
    source = config.path if config.name is None else f"{config.path} [{config.name}]"
    with quiet_loading(datasets):
        try:
            if path.is_file():
                loaded = load_file(datasets, path, config, where)
            elif path.is_dir() and any((path / name).is_file() for name in (
                    datasets.config.DATASETDICT_JSON_FILENAME, datasets.config.DATASET_STATE_JSON_FILENAME)):
                loaded = datasets.load_from_disk(str(path))
            else:  # a directory of data files, or a hub id
                loaded = datasets.load_dataset(config.path, config.name)
        except TaskDataError:
            raise
        except ConnectionError as exc:
            raise TaskDataError(f"{where}.path: {config.path!r} could not be fetched from the Hugging Face Hub "
                                f"({error_line(exc, with_type=False)}); check the id and the network, or save the dataset where the "
                                f"Hub is reachable (save_to_disk, or to_parquet) and point {where}.path at the "
                                "copy") from None
        except datasets.exceptions.DatasetNotFoundError as exc:
            raise TaskDataError(f"{where}.path: {error_line(exc, with_type=False)} (a gated dataset needs `hf auth login`)") from None
        except ValueError as exc:
            field = "name" if "config" in str(exc).lower() else "path"
            raise TaskDataError(f"{where}.{field}: {source} could not be loaded: {error_line(exc, with_type=False)}") from None
        except Exception as exc:  # a library error of any kind: what the user must fix is the data
            raise TaskDataError(f"{where}.path: {source} could not be loaded ({type(exc).__name__}: "
                                f"{error_line(exc, with_type=False)})") from None
    return (dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {ONE_SPLIT: loaded}), source


def load_file(datasets: Any, path: Path, config: DatasetTask, where: str) -> Any:
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise TaskDataError(f"{where}.path: {path} is not a file type the datasets library reads "
                            f"(use {', '.join(BUILDERS)}, or a save_to_disk directory)")
    if config.name is not None:
        raise TaskDataError(f"{where}.name: {path} is a single file, with no configurations; leave {where}.name out")
    return datasets.load_dataset(builder, data_files=str(path))


@contextmanager
def quiet_loading(datasets: Any) -> Iterator[None]:
    """The datasets library's progress bars and INFO/WARNING lines (the hub client's retries
    too) off while loading, as they were afterwards; errors still raise."""
    bars, verbosity = datasets.is_progress_bar_enabled(), datasets.logging.get_verbosity()
    hub = logging.getLogger("huggingface_hub")
    hub_level = hub.level
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    hub.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hub.setLevel(hub_level)
        datasets.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()
