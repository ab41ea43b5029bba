"""The trackers a run reports to, each behind one small class with the same four calls.

`start(kept)` opens the tracker's run, or reopens the one `kept` names (what `start` returned
when the run began: the run's id in that tracker), and returns what to keep. `held(kept)` reads
what the tracker's own store holds of that run: the last step of each prefix (`<prefix>/step`,
a figure every row carries), so a resumed run sends exactly the rows it lacks; None where the
store cannot be read from here, and the marks in OUT/trackers.json stand in. `log(prefix,
values, step)` sends one row's figures, named `<prefix>/<key>` as in TensorBoard (`names.py`).
`summary(values, step)` sends the run's summary figures, and `finish(failed)` closes the
tracker's run. They are called from one background thread per tracker (`thread.py`), never
from the training loop.

Every library is imported inside `start`, so a run that does not name it never imports it.
Each is an extra (`pip install 'lora-async[wandb]'`); `check_installed` says which is missing
before any model loads.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

from ..errors import UserError

# the module each tracker imports, and what installs it (TensorBoard is a dependency of lora-async)
MODULES = {"tensorboard": ("tensorboard", "pip install tensorboard"),
           "wandb": ("wandb", "pip install 'lora-async[wandb]'"),
           "trackio": ("trackio", "pip install 'lora-async[trackio]'"),
           "mlflow": ("mlflow", "pip install 'lora-async[mlflow]'")}
WANDB_SERVICE = "WANDB_SERVICE"  # where W&B names its running service process (wandb.env.SERVICE)
WANDB_FLUSH_S = 0.5  # how often W&B's service writes the run's file (its default: 15 s)
MLFLOW_PARAM_CHARS = 6000  # MLflow refuses a longer parameter value
MLFLOW_BATCH = 100  # parameters per `log_batch` (MLflow's limit)
MLFLOW_REFUSED = re.compile(r"[^\w\-. :/]")  # what MLflow refuses in a metric's name
TRACKIO_REMOTE = ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "TRACKIO_BUCKET_ID")  # Trackio sends elsewhere


class TrackerMissing(UserError):
    """A tracker named in `run.report_to` that is not installed (one line, exit code 2)."""


def check_installed(names: Sequence[str]) -> None:
    """Each tracker `names` lists can be imported; else one line with the pip command."""
    for name in names:
        if name in MODULES and importlib.util.find_spec(MODULES[name][0]) is None:
            raise TrackerMissing(f"run.report_to: {name} is not installed: {MODULES[name][1]}")


@dataclass(frozen=True)
class RunInfo:
    """What every tracker is told about the run when it opens it."""

    out_dir: Path
    project: str  # `run.tracker_project`
    name: str  # the run's name: its output directory's
    config: dict[str, Any]  # the resolved config, as OUT/config.json holds it
    adapters: list[str]  # the fleet's names: tags where the tracker has them


class Backend(Protocol):
    name: str

    def start(self, kept: dict[str, Any] | None) -> dict[str, Any]: ...

    def held(self, kept: dict[str, Any]) -> dict[str, int] | None: ...

    def log(self, prefix: str, values: dict[str, float], step: int) -> None: ...

    def summary(self, values: dict[str, float], step: int) -> None: ...

    def finish(self, failed: bool) -> None: ...


def new_id() -> str:
    import secrets

    return secrets.token_hex(4)


class TensorBoardBackend:
    """OUT/tb, as before (`torch.utils.tensorboard`); a resumed run appends to it."""

    name = "tensorboard"

    def __init__(self, info: RunInfo) -> None:
        self.info = info
        self.writer: Any = None

    def start(self, kept: dict[str, Any] | None) -> dict[str, Any]:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.info.out_dir / "tb"))
        return {}

    def held(self, kept: dict[str, Any]) -> dict[str, int] | None:
        return None  # each row is flushed before it is marked sent: the marks hold

    def log(self, prefix: str, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(f"{prefix}/{key}", value, step)
        self.writer.flush()  # on disk before it counts as sent (a killed run's resume skips it)

    def summary(self, values: dict[str, float], step: int) -> None:
        self.log("summary", values, step)

    def finish(self, failed: bool) -> None:
        self.writer.close()


class WandbBackend:
    """A W&B run: online, or offline with `WANDB_MODE=offline` (files under OUT/wandb). Each
    prefix has its own step (`<prefix>/step`, W&B's `define_metric`), so a fleet's adapters and
    the evals each keep their own x-axis. Resumed with the id kept and `resume="allow"`.

    W&B's service writes the run's `.wandb` file every 15 s by default, and a process killed in
    between loses what it had not written. Here every `WANDB_FLUSH_S` (W&B's
    `x_transaction_log_flush_interval`, checked by `tests/test_trackers.py`), and a resumed run
    reads the files to see what W&B holds (`held`): the rows a kill lost are
    sent again (`Trackers.replay` up to the checkpoint, the training after it)."""

    name = "wandb"

    def __init__(self, info: RunInfo) -> None:
        self.info = info
        self.run: Any = None
        self.prefixes: set[str] = set()

    def start(self, kept: dict[str, Any] | None) -> dict[str, Any]:
        import wandb

        leave_inherited_wandb_service()
        run_id = kept["id"] if kept else new_id()
        info = self.info
        self.run = wandb.init(project=info.project, id=run_id, resume="allow", name=info.name, dir=str(info.out_dir),
                              config=info.config, tags=info.adapters, reinit="create_new",
                              settings=wandb.Settings(x_transaction_log_flush_interval=WANDB_FLUSH_S))
        return {"id": run_id}

    def held(self, kept: dict[str, Any]) -> dict[str, int] | None:
        from .wandb_file import history_rows, run_files

        return last_steps([row for path in run_files(self.info.out_dir, kept["id"]) for row in history_rows(path)])

    def log(self, prefix: str, values: dict[str, float], step: int) -> None:
        if prefix not in self.prefixes:
            self.prefixes.add(prefix)
            self.run.define_metric(f"{prefix}/step")
            self.run.define_metric(f"{prefix}/*", step_metric=f"{prefix}/step")
        self.run.log({f"{prefix}/step": step, **{f"{prefix}/{k}": v for k, v in values.items()}})

    def summary(self, values: dict[str, float], step: int) -> None:
        self.run.summary.update(values)

    def finish(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def leave_inherited_wandb_service() -> None:
    """Start this process's own W&B service rather than a parent's. W&B names its service in
    `WANDB_SERVICE` (`<format>-<pid of the process that started it>-...`), and a child process
    inherits it: a `lora-async train` started by a process that used W&B (a notebook, a test
    runner) would share that process's service. A run killed there leaves its W&B run open in the
    shared service, and the resumed run cannot reopen its id ("run ID ... is in use"). A service
    this process started itself (an earlier run in the same notebook) is kept."""
    token = os.environ.get(WANDB_SERVICE, "")
    fields = token.split("-")
    if token and (len(fields) < 2 or fields[1] != str(os.getpid())):
        del os.environ[WANDB_SERVICE]


class TrackioBackend:
    """A Trackio run in its local store (`TRACKIO_DIR`, else the Hugging Face cache), or a Space
    or server its own settings name. Trackio has no tags: the fleet's names go in the config.

    Trackio's own thread writes what `log` queues every half second; a process killed in between
    would lose those rows while OUT/trackers.json already counts them sent, and the resumed run
    would skip them. So each row is written before `log` returns, as that thread writes it
    (`Run._flush_queues_inline` under `Run._client_lock`: trackio internals, checked by
    `tests/test_trackers.py`).

    Trackio's `log` looks each value up against `sys.modules["matplotlib.figure"].Figure` (and
    `matplotlib.animation`), and drops the whole row, with only a warning, when it finds the
    module half imported: as it is while the run's main thread first imports matplotlib (the
    chart). So `start` imports both first, through the import system's locks."""

    name = "trackio"

    def __init__(self, info: RunInfo) -> None:
        self.info = info
        self.run: Any = None

    def start(self, kept: dict[str, Any] | None) -> dict[str, Any]:
        import matplotlib.animation  # noqa: F401
        import matplotlib.figure  # noqa: F401
        import trackio

        name = kept["name"] if kept else f"{self.info.name}-{new_id()}"  # trackio names a run by its name
        config = {**self.info.config, "lora_async_adapters": self.info.adapters}
        self.run = trackio.init(project=self.info.project, name=name, config=config, resume="allow", embed=False,
                                auto_log_cpu=False, auto_log_gpu=False)
        return {"name": name}

    def held(self, kept: dict[str, Any]) -> dict[str, int] | None:
        from trackio import utils
        from trackio.sqlite_storage import SQLiteStorage

        if utils.get_storage_mode() != "sqlite" or any(os.environ.get(v) for v in TRACKIO_REMOTE):
            return None  # a Space, a server or JSONL fragments: not a store read from here
        return last_steps(SQLiteStorage.get_logs(self.info.project, kept["name"]))

    def log(self, prefix: str, values: dict[str, float], step: int) -> None:
        self.run.log({f"{prefix}/step": step, **{f"{prefix}/{k}": v for k, v in values.items()}}, step=step)
        with self.run._client_lock:
            self.run._flush_queues_inline()

    def summary(self, values: dict[str, float], step: int) -> None:
        self.log("summary", values, step)

    def finish(self, failed: bool) -> None:
        self.run.finish()


class MlflowBackend:
    """An MLflow run in the tracking store MLflow's own settings name (`MLFLOW_TRACKING_URI`,
    else its default, `sqlite:///mlflow.db`), under the experiment `run.tracker_project`. The
    config goes in as parameters (dotted names), the fleet's names as tags; a resumed run keeps
    the parameters it began with (MLflow refuses to change one). A metric name with a character
    MLflow refuses has it as `_` (`mlflow_name`)."""

    name = "mlflow"

    def __init__(self, info: RunInfo) -> None:
        self.info = info
        self.client: Any = None
        self.run_id = ""

    def start(self, kept: dict[str, Any] | None) -> dict[str, Any]:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = client = MlflowClient()
        if kept:
            self.run_id = kept["run_id"]
            client.update_run(self.run_id, status="RUNNING")
            return dict(kept)
        info = self.info
        experiment = client.get_experiment_by_name(info.project)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(info.project)
        tags = {"lora_async.adapters": ",".join(info.adapters), **{f"adapter.{a}": "true" for a in info.adapters}}
        self.run_id = client.create_run(experiment_id, run_name=info.name, tags=tags).info.run_id
        params = [Param(key, value[:MLFLOW_PARAM_CHARS]) for key, value in flat_params(info.config)]
        for at in range(0, len(params), MLFLOW_BATCH):
            client.log_batch(self.run_id, params=params[at:at + MLFLOW_BATCH])
        return {"run_id": self.run_id}

    def held(self, kept: dict[str, Any]) -> dict[str, int] | None:
        from mlflow.tracking import MlflowClient

        # a metric's latest value is the one at its largest step: `<prefix>/step`'s is that step
        return last_steps([MlflowClient().get_run(kept["run_id"]).data.metrics])

    def log(self, prefix: str, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        figures = {"step": step, **values}
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_name(f"{prefix}/{k}"), v, now, step)
                                                    for k, v in figures.items()])

    def summary(self, values: dict[str, float], step: int) -> None:
        self.log("summary", values, step)

    def finish(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def mlflow_name(name: str) -> str:
    """A metric name as MLflow takes it: each character it refuses (it takes letters, digits and
    `_-. :/`) becomes `_`, so `main/lag3+/tokens` is `main/lag3_/tokens`."""
    return MLFLOW_REFUSED.sub("_", name)


def last_steps(rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    """The largest `<prefix>/step` figure of each prefix over `rows`."""
    held: dict[str, int] = {}
    for row in rows:
        for key, value in row.items():
            if key.endswith("/step") and isinstance(value, (int, float)):
                prefix = key.removesuffix("/step")
                held[prefix] = max(int(value), held.get(prefix, int(value)))
    return held


def flat_params(config: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """A nested config as (dotted name, value) pairs; a list is one value, as JSON."""
    import json

    pairs = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            pairs += flat_params(value, f"{name}.")
        else:
            pairs.append((name, value if isinstance(value, str) else json.dumps(value)))
    return pairs


BACKENDS: dict[str, type] = {"tensorboard": TensorBoardBackend, "wandb": WandbBackend, "trackio": TrackioBackend,
                             "mlflow": MlflowBackend}
