"""The orchestrator: one training run, producers and learner joined by the rollout buffer.

| module | owns |
|---|---|
| `state.py` | `Run`, `AdapterRun`, counters, and the one way a run stops or fails |
| `loop.py` | `train` (the main loop; the shutdown order in its docstring) and `train_step` |
| `admission.py` | when a new group may start: the rule, and the counts it reads (`Admission`) |
| `rollouts.py` | the producers (each group from the adapter's `rollout.RolloutSource`, counted, buffered) |
| `batches.py` | collecting each step's batch from the buffer |
| `publish.py` | handing new versions to the generator, the step's metrics line, the canary |
| `rows.py` | the step's metrics line and `summary.json`, each with where the time went (`timing.py`) |
| `periodic.py` | checkpoints, held-out evals and the chart |
| `lifecycle.py` | building the parts, resume, signals, teardown |
| `auto.py` | the mode in force: set at the start, decided by an auto run from what it measures |
| `auto_state.py` | an auto run's state (the engine's curve, the model, the decisions), checkpointed |
"""

from .lifecycle import LocalParts, Parts, StopSwitch
from .loop import train, train_step
from ..errors import TrainingError
from .state import Phase, Run

__all__ = ["LocalParts", "Parts", "Phase", "Run", "StopSwitch", "TrainingError", "train", "train_step"]
