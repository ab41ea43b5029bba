"""Read what each tracker stored, through its own files or API (the tests' side of `trackers/`).

- W&B offline: the run's `.wandb` file, W&B's record log (`trackers.wandb_file.records`).
- Trackio: its SQLite store, through `trackio.sqlite_storage.SQLiteStorage`.
- MLflow: its tracking store, through `MlflowClient`.

Each gives {prefixed metric name: {step: value}} plus the run's id and config, so a test can
compare them with metrics.jsonl. The `<prefix>/step` figure every row carries is left out.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from lora_async.trackers.wandb_file import records


def wandb_runs(out_dir: Path) -> list[dict[str, Any]]:
    """Each offline run directory under OUT/wandb, oldest first: id, config, tags, series, summary."""
    runs = []
    for run_dir in sorted((out_dir / "wandb").glob("offline-run-*")):
        run: dict[str, Any] = {"series": defaultdict(dict), "summary": {}, "config": {}}
        for record in records(next(run_dir.glob("run-*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"], run["tags"] = record.run.run_id, list(record.run.tags)
                run["config"].update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            elif kind == "config":
                run["config"].update({u.key: json.loads(u.value_json) for u in record.config.update})
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                prefixes = [k.removesuffix("/step") for k in row if k.endswith("/step")]
                for key, value in row.items():
                    owner = max((p for p in prefixes if key.startswith(f"{p}/")), key=len, default=None)
                    if owner is not None and key != f"{owner}/step":
                        run["series"][key].setdefault(row[f"{owner}/step"], []).append(value)
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
            if key not in ("step", "timestamp") and not key.endswith("/step"):
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
        if key.endswith("/step"):  # each row's step, beside its figures (what a resume reads)
            continue
        for metric in client.get_metric_history(run.info.run_id, key):
            series[key].setdefault(metric.step, []).append(metric.value)
    return {"id": run.info.run_id, "params": run.data.params, "tags": run.data.tags, "series": series,
            "status": run.info.status}
