"""How a plan is shown: a table per device, a one-line verdict, and the JSON form.

The verdict is the line `lora-async train` refuses a run with, so it names the device, what it
needs against what it has, and the knobs; the table is for reading.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console, JustifyMethod
from rich.table import Table

from .estimate import DevicePlan, Plan
from .knobs import Knob
from .machine import GIB

CAVEAT = ("Estimates from the model's config.json, not measurements: the learner's totals came within 10% under "
          "to 19% over peak RSS on CPU (bench/RESULTS.md); the GPU overheads are allowances, not measured.")


def gib(value: int) -> str:
    return f"{value / GIB:,.2f}"


def device_table(device: DevicePlan) -> Table:
    status = "[green]fits[/]" if device.fits else "[bold red]does not fit[/]"
    table = Table(title=f"{device.device}: {gib(device.need)} of {gib(device.capacity)} GiB, {status}",
                  title_justify="left")
    columns: tuple[tuple[str, JustifyMethod], ...] = (("part", "left"), ("item", "left"), ("GiB", "right"),
                                                      ("", "left"))
    for col, justify in columns:
        table.add_column(col, justify=justify)
    for item in device.items:
        table.add_row(item.part, item.name, gib(item.bytes), item.detail)
    table.add_row("", "[bold]total[/]", f"[bold]{gib(device.need)}[/]", f"capacity {gib(device.capacity)}")
    return table


def notes(plan: Plan) -> list[str]:
    lines = [f"model {plan.model}: {plan.params / 1e9:.3f}B params; "
             + ", ".join(f"{part} in {dtype}" for part, dtype in plan.dtypes.items())
             + f"; machine: {plan.machine.describe()}",
             "learner activations at learner.token_budget: "
             f"{gib(plan.activations['off'])} GiB without gradient checkpointing, "
             f"{gib(plan.activations['on'])} GiB with it"]
    if plan.kv_tokens is not None:
        lines.append(f"generator KV cache: {plan.kv_tokens:,} tokens")
    if plan.served:
        lines.append(plan.served)
    if plan.layout.generator is None:
        lines.append("generator: not on this machine's plan (remote servers or Ray replicas); each replica holds "
                     "one engine as generator.type = \"vllm\" would")
    elif any(d.device == "cpu" for d in plan.devices):
        lines.append("cpu: the learner and the generator share system RAM; the Python, torch and vLLM imports "
                     "(about 0.5 GiB per process) are not counted")
    return lines + plan.problems + [CAVEAT]


def render(plan: Plan, knobs: list[Knob], console: Console) -> None:
    for device in plan.devices:
        console.print(device_table(device))
    for line in notes(plan):
        console.print(f"  {line}", highlight=False, soft_wrap=True)
    if not plan.fits:
        console.print(f"  {remedy(plan, knobs)}", highlight=False, soft_wrap=True)


def knob_text(knob: Knob, plan: Plan) -> str:
    """The settings, and what the most over-full device would need with them."""
    worst = max(plan.over(), key=lambda d: d.need - d.capacity, default=None)
    if worst is None or worst.device not in knob.need:
        return knob.text()
    return f"{knob.text()} ({worst.device} {gib(knob.need[worst.device])} GiB)"


def remedy(plan: Plan, knobs: list[Knob]) -> str:
    fitting = [k for k in knobs if k.fits]
    if fitting:
        return "would fit with: " + " | ".join(knob_text(k, plan) for k in fitting)
    if knobs:
        return "no setting makes it fit on this machine; closest: " + knob_text(knobs[0], plan)
    return "no setting makes it fit on this machine"


def verdict(plan: Plan, knobs: list[Knob]) -> str:
    """One line: 'fits: ...' or what does not fit, by how much, and what would make it fit."""
    if plan.fits:
        return "memory plan: fits (" + ", ".join(f"{d.device} {gib(d.need)} of {gib(d.capacity)} GiB"
                                                 for d in plan.devices) + ")"
    parts = []
    for device in plan.over():
        split = ", ".join(f"{name} {gib(device.part(name))}" for name in ("learner", "generator", "framework")
                          if device.part(name))
        parts.append(f"{device.device} needs {gib(device.need)} GiB of {gib(device.capacity)} GiB ({split})")
    parts += plan.problems
    return "memory plan: will not fit: " + "; ".join(parts) + "; " + remedy(plan, knobs)


def as_json(plan: Plan, knobs: list[Knob]) -> dict[str, Any]:
    return {
        "model": plan.model, "params": plan.params, "fits": plan.fits, "machine": plan.machine.describe(),
        "dtypes": plan.dtypes, "layout": {"generator": plan.layout.generator, "learners": list(plan.layout.learners)},
        "devices": [{"device": d.device, "capacity_bytes": d.capacity, "need_bytes": d.need, "fits": d.fits,
                     "items": [{"part": i.part, "item": i.name, "bytes": i.bytes, "detail": i.detail}
                               for i in d.items]} for d in plan.devices],
        "activations_bytes": {"checkpointing_off": plan.activations["off"],
                              "checkpointing_on": plan.activations["on"]},
        "kv_cache_tokens": plan.kv_tokens, "generator_base": plan.served, "problems": plan.problems,
        "knobs": [{"set": list(k.settings), "fits": k.fits, "need_bytes": k.need} for k in knobs],
        "verdict": verdict(plan, knobs),
    }
