"""What a W&B run's `.wandb` files hold: read back at `--resume` (`WandbBackend.held`), so the
resumed run sends W&B exactly the rows it does not have.

W&B's service writes a run's records to `OUT/wandb/<run dir>/run-<id>.wandb` every half second
(`backends.WANDB_FLUSH_S`), so a killed run may have sent rows that never reached the file; the
marks in OUT/trackers.json would count them as sent. The file is the truth: LevelDB's log format
after a 7-byte header (32 KiB blocks of chunks, each with a 7-byte head: crc32, length, type),
each record a `wandb_internal_pb2.Record`. W&B ships no Python reader for it any more; this one
is checked against W&B's own writing by `tests/test_trackers.py`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterator

BLOCK = 32768
HEAD = 7
FULL, LAST = 1, 4


def records(path: Path) -> Iterator[Any]:
    """The file's records, in order (a chunk still being written ends the read)."""
    from wandb.proto import wandb_internal_pb2

    new_record: Any = getattr(wandb_internal_pb2, "Record")  # generated protobuf: no type stubs
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B record log")
    pos, pending = HEAD, b""
    while pos + HEAD <= len(data):
        if BLOCK - pos % BLOCK < HEAD:  # a block's tail too short for a chunk head is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEAD])
        if pos + HEAD + length > len(data):
            return
        pending += data[pos + HEAD:pos + HEAD + length]
        pos += HEAD + length
        if kind in (FULL, LAST):
            record = new_record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def history_rows(path: Path) -> Iterator[dict[str, Any]]:
    """Each history row the file holds, as {key: value}."""
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            yield {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}


def run_files(out_dir: Path, run_id: str) -> list[Path]:
    """Every attempt's file of run `run_id` under OUT/wandb (offline or online), oldest first."""
    return sorted((out_dir / "wandb").glob(f"*run-*-{run_id}/run-{run_id}.wandb"))

