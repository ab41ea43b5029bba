"""The settings that would make a plan that does not fit fit: each tried by re-planning the run
with it, so a knob is only offered when the arithmetic says it is enough.

Learner knobs: quantise the base (nf4, int8), gradient checkpointing, a smaller token budget or
log-softmax chunk, another GPU. Generator knobs: a smaller KV cache (kv_cache_gb or
memory_fraction), another GPU; not generator.quantization, which the pinned vLLM refuses. When
no single knob is enough, the ones that help are combined in order of what they save until the
plan fits, then each that is not needed is dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .estimate import Plan, plan_run
from .machine import BYTES_BY_DTYPE_NAME, GIB, Machine
from .shapes import ModelShape, PlanUnavailable

if TYPE_CHECKING:
    from ..config import TrainConfig

MIN_TOKEN_BUDGET = 256  # below this a micro-batch holds too few rows to be worth suggesting
SMALL_LOGPROB_CHUNK = 256


@dataclass(frozen=True)
class Knob:
    settings: tuple[str, ...]  # `--set` overrides, e.g. ("model.quantization=nf4",)
    need: dict[str, int]  # bytes per device with them
    fits: bool

    def text(self) -> str:
        return " + ".join(self.settings)


def variant(config: "TrainConfig", settings: tuple[str, ...]) -> "TrainConfig | None":
    """The config with `settings` applied, or None when they make it invalid."""
    from pydantic import ValidationError

    from ..config import ConfigError, TrainConfig, apply_overrides

    try:
        return TrainConfig.model_validate(apply_overrides(config.model_dump(mode="json"), list(settings)))
    except (ValidationError, ConfigError):
        return None


def replan(config: "TrainConfig", machine: Machine, shape: ModelShape, settings: tuple[str, ...]) -> Knob | None:
    changed = variant(config, settings)
    if changed is None:
        return None
    try:
        plan = plan_run(changed, machine, shape)
    except PlanUnavailable:
        return None
    return Knob(settings, {d.device: d.need for d in plan.devices}, plan.fits)


def find_knobs(config: "TrainConfig", machine: Machine, shape: ModelShape, plan: Plan) -> list[Knob]:
    """Single settings that make the plan fit; else one combination that does (or helps most)."""
    tried = [k for s in candidates(config, machine, shape, plan) if (k := replan(config, machine, shape, s))]
    fitting = [k for k in tried if k.fits]
    if fitting or not tried:
        return fitting
    return [combine(config, machine, shape, plan, tried)]


def combine(config: "TrainConfig", machine: Machine, shape: ModelShape, plan: Plan, tried: list[Knob]) -> Knob:
    """Add the knobs that lower the need most first (one per setting name) until it fits."""
    total = sum(d.need for d in plan.devices)
    helpful = sorted((k for k in tried if sum(k.need.values()) < total), key=lambda k: sum(k.need.values()))
    chosen: list[str] = []
    best = Knob((), {d.device: d.need for d in plan.devices}, False)
    for knob in helpful:
        names = {s.split("=")[0] for s in chosen}
        fresh = tuple(s for s in knob.settings if s.split("=")[0] not in names)
        if not fresh:
            continue
        trial = replan(config, machine, shape, tuple(chosen) + fresh)
        if trial and sum(trial.need.values()) < sum(best.need.values()):
            chosen, best = list(trial.settings), trial
            if trial.fits:
                return prune(config, machine, shape, best)
    return best


def prune(config: "TrainConfig", machine: Machine, shape: ModelShape, knob: Knob) -> Knob:
    """Drop each setting of a fitting combination that it still fits without."""
    for setting in knob.settings:
        fewer = tuple(s for s in knob.settings if s != setting)
        trial = replan(config, machine, shape, fewer) if fewer else None
        if trial and trial.fits:
            knob = trial
    return knob


def candidates(config: "TrainConfig", machine: Machine, shape: ModelShape, plan: Plan) -> list[tuple[str, ...]]:
    over = {d.device for d in plan.over()}
    learner_over = bool(over & set(plan.layout.learners))
    generator_hit = plan.layout.generator is not None and (plan.layout.generator in over or bool(plan.problems))
    found: list[tuple[str, ...]] = []
    if learner_over:
        found += learner_candidates(config, machine, shape, plan)
    if generator_hit:
        found += generator_candidates(config, machine, shape, plan)
    return found


def learner_candidates(config: "TrainConfig", machine: Machine, shape: ModelShape,
                       plan: Plan) -> list[tuple[str, ...]]:
    learner = config.learner
    found: list[tuple[str, ...]] = []
    if config.model.quantization != "nf4":
        found.append(("model.quantization=nf4",))
    if config.model.quantization == "none":
        found.append(("model.quantization=int8",))
    if not learner.gradient_checkpointing:
        found.append(("learner.gradient_checkpointing=true",))
    budget = largest_budget(config, machine, shape)
    if budget is not None:
        found.append((f"learner.token_budget={budget}",))
    if learner.logprob_chunk > SMALL_LOGPROB_CHUNK:
        found.append((f"learner.logprob_chunk={SMALL_LOGPROB_CHUNK}",))
    spare = spare_gpu(machine, plan)
    if spare and not learner.devices:
        found.append((f"learner.device={spare}",))
    return found


def largest_budget(config: "TrainConfig", machine: Machine, shape: ModelShape) -> int | None:
    """The largest halving of learner.token_budget that fits (else the smallest tried, to combine)."""
    budget = config.learner.token_budget // 2
    last = None
    while budget >= MIN_TOKEN_BUDGET:
        last = budget
        knob = replan(config, machine, shape, (f"learner.token_budget={budget}",))
        if knob and knob.fits:
            return budget
        budget //= 2
    return last


def generator_candidates(config: "TrainConfig", machine: Machine, shape: ModelShape,
                         plan: Plan) -> list[tuple[str, ...]]:
    gen = config.local_engine
    found: list[tuple[str, ...]] = []
    if gen is None:  # servers and Ray replicas plan their own memory
        return found
    device = next(d for d in plan.devices if d.device == plan.layout.generator)
    kv = next((i.bytes for i in device.items if i.name.startswith("KV cache")), 0)
    room = device.capacity - (device.need - kv)  # what the KV cache could have on this device
    if device.need > device.capacity and room > 0:
        if gen.kv_cache_gb is not None:
            found.append((f"generator.kv_cache_gb={math.floor(room / GIB * 0.9 * 10) / 10:g}",))
        else:
            share = device.capacity * gen.memory_fraction - kv + room * 0.9
            fraction = math.floor(share / device.capacity * 20) / 20
            if 0 < fraction < gen.memory_fraction:
                found.append((f"generator.memory_fraction={fraction:g}",))
    if plan.problems:  # a KV cache too small: room for one full group of full-length sequences
        spec = config.adapter_specs[0].sampling
        per_token = shape.kv_bytes_per_token(BYTES_BY_DTYPE_NAME[plan.dtypes["generator"]])
        need = spec.samples_per_prompt * gen.max_model_len * per_token
        found.append((f"generator.kv_cache_gb={math.ceil(need / GIB * 10) / 10:g}",))
    spare = spare_gpu(machine, plan)
    if spare:
        found.append((f"generator.device={spare}",))
    return found


def spare_gpu(machine: Machine, plan: Plan) -> str | None:
    """A GPU no part of the run uses, when the run's parts share one."""
    used = set(plan.layout.learners) | {plan.layout.generator}
    if len(used) == len(plan.layout.learners) + 1:
        return None  # nothing shares a device
    return next((f"cuda:{i}" for i in range(len(machine.gpus)) if f"cuda:{i}" not in used), None)
