"""The memory plan: will this run fit, device by device, before anything loads?

    shapes.py    a model's shape and parameter counts from its config.json (never the weights)
    machine.py   the machine (this one, or N hypothetical GPUs), where the parts go, their dtypes
    estimate.py  the arithmetic: learner, generator and framework items in bytes per device
    knobs.py     the settings that would make a plan that does not fit fit
    report.py    the table, the one-line verdict, and the JSON form
    gate.py      the check `train` makes first: a plan that cannot fit is refused (`PlanRefused`)

`lora-async plan CONFIG` prints it; `lora-async train` refuses a plan that cannot fit (exit 2)
unless `--force`. Nothing here imports vLLM, and torch only to ask a real GPU its size.
"""

from .estimate import DevicePlan, Item, Plan, learner_estimate, learner_items, learner_total, plan_run
from .machine import GIB, Layout, Machine, layout
from .shapes import ModelShape, PlanUnavailable, load_shape

__all__ = ["GIB", "DevicePlan", "Item", "Layout", "Machine", "ModelShape", "Plan", "PlanUnavailable",
           "layout", "learner_estimate", "learner_items", "learner_total", "load_shape", "plan_run"]
