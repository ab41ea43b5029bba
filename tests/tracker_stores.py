"""Read what each tracker stored, through its own files or API (the tests' side of `trackers/`).

- W&B offline: the run's `.wandb` file is W&B's record log (LevelDB's log format after a 7-byte
  header: 32 KiB blocks of chunks with a 7-byte head, crc32 / length / type), each record a
  `wandb_internal_pb2.Record`. wandb itself no longer ships a Python reader for it.
- Trackio: its SQLite store, through `trackio.sqlite_storage.SQLiteStorage`.
- MLflow: its tracking store, through `MlflowClient`.

Each gives {prefixed metric name: {step: value}} plus the run's id and config, so a test can
compare them with metrics.jsonl.
"""

from __future__ import annotations

import json
import struct
from collections import defaultdict
from pathlib import Path
from typing import Any

WANDB_BLOCK = 32768
FULL, LAST = 1, 4


def wandb_records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B record log"
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if WANDB_BLOCK - pos % WANDB_BLOCK < 7:  # a block's tail too short for a chunk head is padding
            pos += WANDB_BLOCK - pos % WANDB_BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):  # a chunk still being written (a live run's file)
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_runs(out_dir: Path) -> list[dict[str, Any]]:
    """Each offline run directory under OUT/wandb, oldest first: id, config, tags, series, summary."""
    runs = []
    for run_dir in sorted((out_dir / "wandb").glob("offline-run-*")):
        run: dict[str, Any] = {"series": defaultdict(dict), "summary": {}, "config": {}}
        for record in wandb_records(next(run_dir.glob("run-*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"], run["tags"] = record.run.run_id, list(record.run.tags)
                run["config"].update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            elif kind == "config":
                run["config"].update({u.key: json.loads(u.value_json) for u in record.config.update})
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                for key, value in row.items():
                    prefix = key.rsplit("/", 1)[0]
                    if not key.startswith("_") and not key.endswith("/step") and f"{prefix}/step" in row:
                        run["series"][key].setdefault(row[f"{prefix}/step"], []).append(value)
            elif kind == "summary":
                run["summary"].update({u.key: json.loads(u.value_json) for u in record.summary.update})
        runs.append(run)
    return runs


def trackio_run(project: str) -> dict[str, Any]:
    """The project's one run: its name, config, and series."""
    from trackio.sqlite_storage import SQLiteStorage

    names = SQLiteStorage.get_runs(project)
    assert len(names) == 1, f"trackio project {project} holds runs {names}"
    series: dict[str, dict[int, list[float]]] = defaultdict(dict)
    for row in SQLiteStorage.get_logs(project, names[0]):
        for key, value in row.items():
            if key not in ("step", "timestamp"):
                series[key].setdefault(row["step"], []).append(value)
    return {"id": names[0], "config": SQLiteStorage.get_run_config(project, names[0]), "series": series}


def mlflow_run(project: str) -> dict[str, Any]:
    """The experiment's one run: id, parameters, tags, series, status."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    experiment = client.get_experiment_by_name(project)
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, f"mlflow experiment {project} holds {len(runs)} runs"
    run = runs[0]
    series: dict[str, dict[int, list[float]]] = defaultdict(dict)
    for key in run.data.metrics:
        for metric in client.get_metric_history(run.info.run_id, key):
            series[key].setdefault(metric.step, []).append(metric.value)
    return {"id": run.info.run_id, "params": run.data.params, "tags": run.data.tags, "series": series,
            "status": run.info.status}
