"""Registering adapter versions in vLLM's worker: the normal build, and the recycled fast path.

`HotSwap` is one worker's registrar. The first version of a structure (tensor names, shapes,
peft config) is built the normal way (`LoRAModel.from_lora_tensors`, `add_adapter`, vLLM's
activation), and from that build it learns the plans of `swap_plans.py`: where each tensor
lands in the merged `LoRAModel` (`ModelPlan`) and in the engine's LoRA slots (`SlotPlan`), and
lays the slots out as the plan. A later version of that structure takes a retired version's
`LoRAModel` (a `Spare`) and the new int id, and is registered with `add_adapter` (a no-op merge
on a merged model). Sent as one buffer (as the learner hands versions over), it is written
straight into a free slot: one copy, the lora_B scaling, one value check on the copy. vLLM only
reads a `LoRAModel` to activate it, so that one is filled from the slot only if vLLM frees the
slot while the version is live (its LRU eviction; `_watch_evictions`). Otherwise the version is
copied into the spare, then into a free slot by foreach copies (or by vLLM on first use).

Anything else (first version, another structure, unknown layers, no spare, a plan that failed
its check) takes vLLM's own path. Every vLLM internal used here is checked by
`compat.check_vllm_compat()`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..validate import finite_flat
from . import compat
from .piecewise import copy_scaled
from .swap_plans import ModelPlan, SlotPlan, SlotViews, Spare, weight_at

log = logging.getLogger(__name__)

SPARES_PER_STRUCTURE = 1  # a publish takes one; the retirement that follows it gives one back


def structure_key(tensors: dict[str, torch.Tensor], peft_config: dict) -> tuple:
    """What must match for one version to be copied into another's LoRAModel (whole-sequence
    comprehensions: it runs on every registration, over ~400 tensors)."""
    return (tuple(tensors), tuple([t.shape for t in tensors.values()]),
            json.dumps(peft_config, sort_keys=True, default=str))


def build_lora_model(manager: Any, int_id: int, tensors: dict, peft_config: dict) -> Any:
    """What `WorkerLoRAManager._load_adapter` does after reading files, from tensors."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapper = mapper.get_rename_mapper()
    return LoRAModel.from_lora_tensors(
        lora_model_id=int_id, tensors=tensors, peft_helper=helper, device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
        weights_mapper=mapper, skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )


@dataclass
class SwapCounts:
    """How one worker registered and activated versions (what `bench sync` and the tests read)."""

    built: int = 0  # by vLLM's own path (`from_lora_tensors` + `add_adapter`)
    recycled: int = 0  # took a retired version's LoRAModel
    one_copy: int = 0  # ... of those, copied in (to its slot or that model) with one copy of the sender's buffer
    fast_activated: int = 0  # written into a free slot by the slot plan
    straight: int = 0  # ... of those, from the sender's tensors (its LoRAModel filled only if vLLM evicts it)
    filled_from_slot: int = 0  # LoRAModels filled from their slot as vLLM evicted them
    vllm_activated: int = 0  # activated by vLLM's `activate_adapter` (to check the slot plan)


class InvalidValues(ValueError):
    """Borrowed tensors with NaN or Inf: the version is refused, nothing is registered."""


class HotSwap:
    """One worker's registrations: learned plans by structure, spare models, live ids, and the
    versions that live in their slot only."""

    def __init__(self) -> None:
        self.plans: dict[tuple, ModelPlan | None] = {}  # None: this structure is never recycled
        self.spares: dict[tuple, list[Spare]] = {}
        self.live: dict[int, tuple[tuple, Spare | None]] = {}  # registered here: structure, spare it reuses
        # written straight into a slot, their LoRAModel not filled: the slot's views, the spare it took
        self.in_slot: dict[int, tuple[SlotViews, Spare]] = {}
        self.seen: set[int] = set()
        self.stats = SwapCounts()
        self.watching: object = None  # the cache of active adapters whose evictions `_watch_evictions` sees

    def add(self, manager: Any, int_id: int, tensors: dict, peft_config: dict, borrowed: bool = False,
            flat: torch.Tensor | None = None, structure: tuple | None = None) -> None:
        """Register `int_id`: recycled when a plan and a spare exist, else built by vLLM's path.

        `borrowed`: the tensors stay the sender's (in-process): they are copied before anything
        keeps them, and their values are checked (`InvalidValues`). `flat`: the buffer they are
        views of, in order (`AdapterVersion.flat`): one copy instead of one per tensor, into a
        free slot or a spare, and one value check. `structure`: the sender's `AdapterVersion.structure` of
        these tensors (else the key is built here)."""
        cache = manager._adapter_manager
        if int_id in self.seen or int_id in cache.list_adapters():
            raise ValueError(f"LoRA id {int_id} was registered before; ids are never reused")
        if len(cache) + 1 > cache.capacity:
            raise RuntimeError(f"vLLM's LoRA cache is full ({len(cache)}/{cache.capacity}); "
                               "retire a version before publishing another")
        self.seen.add(int_id)
        key = ("sender", structure) if structure is not None else structure_key(tensors, peft_config)
        plan = self.plans.get(key)
        spare = self.spares[key].pop() if plan is not None and self.spares.get(key) else None
        if spare is None:
            sources = [flat] if flat is not None else tensors.values()
            if borrowed and not all(finite_flat(t) for t in sources):
                raise InvalidValues("tensors contain NaN or Inf")
            model = self._build(manager, key, int_id, tensors, peft_config, borrowed)
            self.stats.built += 1
            self.live[int_id] = (key, None)
            self._activate(cache, self.plans.get(key), model)
            return
        assert plan is not None
        slot = self._free_region(cache, plan, tensors, flat)
        try:
            if slot is None:  # into the spare; then a free slot as vLLM's activation would, or vLLM on first use
                self.stats.one_copy += plan.fill(spare, tensors, flat)
                if borrowed and not finite_flat(spare.flat):
                    raise InvalidValues("tensors contain NaN or Inf")
            else:  # straight into the free slot; its LoRAModel is filled only if vLLM frees the slot
                assert flat is not None
                self._write_region(slot[1], plan, flat, borrowed)
        except InvalidValues:
            self.spares[key].append(spare)  # unregistered: its next fill overwrites it
            raise
        model = spare.model
        model.id = int_id
        cache.add_adapter(model)
        self.stats.recycled += 1
        self.live[int_id] = (key, spare)
        if slot is None:
            self._activate(cache, plan, model, spare)
            return
        self._watch_evictions(cache)
        self.in_slot[int_id] = (slot[1], spare)
        self._mark_active(cache, slot[0], int_id)
        self.stats.fast_activated += 1
        self.stats.straight += 1

    def _write_region(self, views: SlotViews, plan: ModelPlan, flat: torch.Tensor, borrowed: bool) -> None:
        """Write a version into a free slot laid out as the plan, from the sender's buffer laid
        out alike, as vLLM's build and activation would: clear what it does not write, then one
        copy (`copy_` casts as `.to(dtype)`) with lora_B `*= scaling` in the slot's dtype (as
        `LoRALayerWeights.optimize`: the same operations, the same bits) and the value check,
        piece by piece (`copy_scaled`; a refused version leaves the slot free)."""
        assert views.region is not None
        if views.zeros:
            with torch.no_grad():
                torch._foreach_zero_(views.zeros)
        finite = copy_scaled(views.region, flat, plan.scale, check=borrowed)
        self.stats.one_copy += 1
        if not finite:
            raise InvalidValues("tensors contain NaN or Inf")

    def remove(self, manager: Any, int_id: int) -> bool:
        """Remove `int_id`; keep its LoRAModel as a spare (vLLM holds no reference any more)."""
        model = manager._adapter_manager.get_adapter(int_id)
        self.in_slot.pop(int_id, None)  # retired: nothing will read its weights again
        removed = bool(manager.remove_adapter(int_id))
        key, spare = self.live.pop(int_id, ((), None))
        plan = self.plans.get(key)
        if removed and model is not None and plan is not None:
            spares = self.spares.setdefault(key, [])
            if len(spares) < SPARES_PER_STRUCTURE:
                spares.append(spare if spare is not None else plan.spare(model))
        return removed

    def _free_region(self, cache: Any, plan: ModelPlan, tensors: dict,
                     flat: torch.Tensor | None) -> tuple[int, SlotViews] | None:
        """A free slot and its views, where a version can be written straight into it: the slot
        plan is trusted, the slots are laid out as the plan (`SlotPlan.lay_out`), and the
        sender's tensors are one buffer laid out alike."""
        slots = plan.slots
        if slots is None or slots.trusted is not True or slots.slab is None or None not in cache.lora_index_to_id:
            return None
        index = cache.lora_index_to_id.index(None)
        views = slots.at(cache, plan, index)
        if views.region is None or not plan.dense_source(tensors, flat, views.region.numel()):
            return None
        return index, views

    @staticmethod
    def _mark_active(cache: Any, index: int, int_id: int) -> None:
        """What `activate_adapter` records around its `set_lora` calls."""
        cache._active_adapters[int_id] = None
        cache.lora_index_to_id[index] = int_id

    def _watch_evictions(self, cache: Any) -> None:
        """Have vLLM tell us before it frees a slot (`AdapterLRUCache` calls `deactivate_fn`
        on every removal, its LRU eviction in `activate_adapter` included): a version written
        straight into its slot gets its LoRAModel filled from the slot first, so vLLM can
        activate it again from there."""
        active = cache._active_adapters
        if self.watching is active:
            return
        self.watching, release = active, active.deactivate_fn

        def deactivate(int_id: int) -> object:
            views, spare = self.in_slot.pop(int_id, (None, None))
            if views is not None and views.region is not None and spare is not None:
                with torch.no_grad():
                    spare.flat.copy_(views.region)  # both laid out as the plan
                self.stats.filled_from_slot += 1
            return release(int_id)

        active.deactivate_fn = deactivate

    def _build(self, manager: Any, key: tuple, int_id: int, tensors: dict, peft_config: dict,
               borrowed: bool = False) -> Any:
        cache = manager._adapter_manager
        if key in self.plans:  # known: recyclable but no spare yet, or never recyclable
            if borrowed:  # vLLM keeps (and scales in place) tensors already in its dtype
                dtype = manager.lora_config.lora_dtype
                tensors = {n: t.to(device="cpu", dtype=dtype, copy=True) for n, t in tensors.items()}
            model = build_lora_model(manager, int_id, tensors, peft_config)
            cache.add_adapter(model)
            return model
        # First of its structure: build from staged copies in vLLM's dtype (which vLLM keeps as
        # they are), so each tensor can be followed by identity through vLLM's merge.
        dtype = manager.lora_config.lora_dtype
        pin = bool(compat.pin_memory())
        staged = {n: t.to(device="cpu", dtype=dtype, copy=True) for n, t in tensors.items()}
        if pin:
            staged = {n: t.pin_memory() for n, t in staged.items()}
        model = build_lora_model(manager, int_id, staged, peft_config)
        origin = {id(t): n for n, t in staged.items()}
        before: dict[str, tuple[bool, float]] = {}
        for weights in model.loras.values():
            for is_b, value in ((False, weights.lora_a), (True, weights.lora_b)):
                name = origin.get(id(value))
                if name is not None:
                    before[name] = (is_b, float(weights.scaling) if is_b else 1.0)
        followed = len(before) == 2 * len(model.loras)  # every tensor is one of ours, as it was
        cache.add_adapter(model)
        plan = ModelPlan.learn(staged, before, model, dtype) if followed else None
        if plan is not None and not plan.reproduces(tensors, model):
            log.warning("lora-async: vLLM built an adapter differently than expected; versions of this "
                        "structure are registered the normal way")
            plan = None
        if plan is not None:
            plan.slots = SlotPlan.learn(cache, plan)
        self.plans[key] = plan
        return model

    def _activate(self, cache: Any, plan: ModelPlan | None, model: Any, spare: Spare | None = None) -> None:
        """Put a version whose LoRAModel is filled in a free slot now: the first time through
        vLLM's own activation, read back to trust the slot plan; then by foreach copies.
        Without a free slot (or a plan) vLLM activates it on first use, as it always has."""
        slots = plan.slots if plan is not None else None
        if plan is None or slots is None or slots.trusted is False or None not in cache.lora_index_to_id:
            return
        index = cache.lora_index_to_id.index(None)
        tensors = spare.views if spare is not None else [weight_at(model, loc) for loc in plan.locs]
        if slots.trusted is None:
            cache.activate_adapter(model.id)
            self.stats.vllm_activated += 1
            slots.trusted = cache.lora_index_to_id[index] == model.id and slots.matches(cache, plan, index, tensors)
            if not slots.trusted:
                log.warning("lora-async: vLLM's LoRA slots are laid out differently than expected; "
                            "versions are activated the normal way")
            else:
                slots.lay_out(cache, plan)
            return
        if spare is None:
            source = [tensors[p] for p in slots.positions]
        else:
            if spare.slot_src is None:
                spare.slot_src = [spare.views[p] for p in slots.positions]
            source = spare.slot_src
        SlotPlan.write(slots.at(cache, plan, index), source)
        self._mark_active(cache, index, model.id)
        self.stats.fast_activated += 1
