"""The plans of a hot swap: where a version's tensors land in vLLM, learned once per structure.

Why: registering a version the normal way (`LoRAModel.from_lora_tensors`, `add_adapter`, then
vLLM's `activate_adapter` on the first batch that names it) redoes per-module Python work for
every version (~15-20 ms at r=8 on the 135M model, while the bytes take ~1 ms to copy). A new
version of an adapter has exactly the structure of the previous one, so that work is learned
once, as plans that `hotswap.HotSwap` follows:

- `ModelPlan`, learned from the first normal build of a structure (tensor names, shapes, peft
  config) by tensor identity: where each incoming tensor lands in vLLM's merged `LoRAModel`
  (packed qkv/gate_up slices included) and the scaling vLLM folds into lora_B. It is trusted
  only after that build compared equal, bit for bit, to what the plan would have written.
- `Spare`: a retired version's `LoRAModel` (nothing references it: the generator retires drained
  versions only and aborts before it evicts), its tensors moved into one flat buffer, taken by
  the next version of that structure. That version is written into a free slot, and the spare
  filled from the slot only if vLLM frees it; with no free slot it is copied into the spare
  (`copy_` casts as `.to(dtype)` does; lora_B then `*= scaling` as `LoRALayerWeights.optimize`
  does).
- `SlotPlan`: the views of the engine's stacked LoRA slots that `activate_adapter` writes
  (`set_lora` = `reset_lora` + one copy per slice), so a new version goes into a free slot
  with a few foreach ops instead of ~120 `set_lora` calls. Trusted once an activation by vLLM
  itself read back equal; then (on a CPU, where each tensor fills its block) the stacked
  tensors it writes become views of one slot-major buffer laid out as the plan (`lay_out`),
  so a sender's flat buffer goes into a slot with one copy.

Every vLLM internal used here is checked by `compat.check_vllm_compat()`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from . import compat
from .piecewise import copy_scaled

Loc = tuple[str, int | None, bool]  # (module key in LoRAModel.loras, slice of a packed module, is lora_B)


def _parts(value: Any) -> list[tuple[int | None, Any]]:
    return list(enumerate(value)) if isinstance(value, list) else [(None, value)]


def weight_at(model: Any, loc: Loc) -> torch.Tensor:
    key, index, is_b = loc
    value = model.loras[key].lora_b if is_b else model.loras[key].lora_a
    return value if index is None else value[index]


def _put(model: Any, loc: Loc, tensor: torch.Tensor) -> None:
    key, index, is_b = loc
    weights = model.loras[key]
    if index is not None:
        (weights.lora_b if is_b else weights.lora_a)[index] = tensor
    elif is_b:
        weights.lora_b = tensor
    else:
        weights.lora_a = tensor


@dataclass
class Spare:
    """A retired version's LoRAModel whose tensors are views of one flat buffer (plan order)."""

    model: Any
    flat: torch.Tensor
    views: list[torch.Tensor]
    slot_src: list[torch.Tensor] | None = None  # views in the slot plan's write order


@dataclass
class SlotViews:
    """The views of one slot that a version's activation writes: `writes` (one per plan write,
    `SlotPlan.positions` order) and `zeros` (what it clears)."""

    writes: list[torch.Tensor]
    zeros: list[torch.Tensor]
    region: torch.Tensor | None = None  # the slot's writes as one buffer in plan order (`SlotPlan.lay_out`)


@dataclass
class SlotPlan:
    """What `activate_adapter` writes into slot `index` of the engine's stacked LoRA tensors:
    `set_lora` zeroes a module's whole slot (`reset_lora`), then copies each slice into
    `[index, 0, :rows, :cols]`; a module the adapter leaves out is only zeroed."""

    writes: list[tuple[str, int, int, int]]  # (module, slice, plan entry of lora_A, of lora_B)
    zeroed: list[tuple[str, int | None]]  # (module, slice; None: every slice) left all zero
    views: dict[int, SlotViews] = field(default_factory=dict)
    stacks: list[tuple[Any, Any]] = field(default_factory=list)  # what `views` are views of
    trusted: bool | None = None  # None: not yet read back after an activation by vLLM itself
    slab: torch.Tensor | None = None  # [slots, plan numel]: what the written stacks are views of (`lay_out`)

    @property
    def positions(self) -> list[int]:
        """The plan entry copied into each write view, in order."""
        return [p for _, _, a, b in self.writes for p in (a, b)]

    @classmethod
    def learn(cls, cache: Any, plan: "ModelPlan") -> "SlotPlan | None":
        """None when some layer is not one whose `set_lora`/`reset_lora` this reproduces."""
        if cache.is_pooling_model:
            return None
        writable, zeroed_only = compat.lora_layer_classes()
        by_module: dict[str, dict[tuple[int | None, bool], int]] = {}
        for position, (key, index, is_b) in enumerate(plan.locs):
            by_module.setdefault(key, {})[(index, is_b)] = position
        writes: list[tuple[str, int, int, int]] = []
        zeroed: list[tuple[str, int | None]] = []
        for name, module in cache.modules.items():
            entries = by_module.pop(name, None)
            if entries is None and type(module) in zeroed_only:
                zeroed.append((name, None))
                continue
            if type(module) not in writable or module.tp_size != 1:
                return None
            if entries is None:
                zeroed.append((name, None))
                continue
            slices, packed = len(module.lora_a_stacked), plan.packed[name]
            indices = [None] if packed is None else list(range(packed))
            if len(indices) != slices or len(module.lora_b_stacked) != slices:
                return None
            for s, index in enumerate(indices):
                a, b = entries.get((index, False)), entries.get((index, True))
                if a is None and b is None:
                    zeroed.append((name, s))
                    continue
                if a is None or b is None:
                    return None
                for stack, p in ((module.lora_a_stacked[s], a), (module.lora_b_stacked[s], b)):
                    if len(plan.shapes[p]) != 2:
                        return None
                    rows, cols = plan.shapes[p]
                    if stack.dim() != 4 or stack.shape[1] != 1 or rows > stack.shape[2] or cols > stack.shape[3]:
                        return None
                writes.append((name, s, a, b))
        return None if by_module else cls(writes, zeroed)

    def at(self, cache: Any, plan: "ModelPlan", index: int) -> SlotViews:
        """The views of slot `index`, made once per slot (again if vLLM ever replaced its
        stacked tensors)."""
        stacks = [(m.lora_a_stacked, m.lora_b_stacked) for m in cache.modules.values()]
        if len(stacks) != len(self.stacks) or any(a is not x or b is not y
                                                  for (a, b), (x, y) in zip(stacks, self.stacks)):
            self.views.clear()
            self.stacks = stacks
            self.slab = None
            if self.trusted:  # another plan laid the slots out: alike, maybe (the same tensors)
                self.lay_out(cache, plan, move=False)
        if index not in self.views:
            writes: list[torch.Tensor] = []
            zeros: list[torch.Tensor] = []
            for name, s, a, b in self.writes:
                module = cache.modules[name]
                for stack, p in ((module.lora_a_stacked[s], a), (module.lora_b_stacked[s], b)):
                    rows, cols = plan.shapes[p]
                    slot = stack[index, 0]
                    writes.append(slot[:rows, :cols])
                    zeros += [v for v in (slot[rows:, :], slot[:rows, cols:]) if v.numel()]
            for name, part in self.zeroed:
                module = cache.modules[name]
                for stacked in (module.lora_a_stacked, module.lora_b_stacked):
                    group = list(stacked) if isinstance(stacked, (list, tuple)) else [stacked]
                    zeros += [stack[index] for stack in (group if part is None else [group[part]])]
            region = self.slab[index] if self.slab is not None else None
            self.views[index] = SlotViews(writes, zeros, region)
        return self.views[index]

    def lay_out(self, cache: Any, plan: "ModelPlan", move: bool = True) -> bool:
        """Move the stacked tensors this plan writes into one slot-major buffer, each slot's part
        laid out as the plan (lora_A then lora_B, in the sender's order): a version then goes into
        a slot with one copy from the sender's flat buffer instead of one per tensor, and out of
        it (`HotSwap`'s eviction) with one copy into its LoRAModel's flat buffer. A buffer another
        plan laid out alike is taken as it is; `move=False`: only that.

        Each module keeps stacked tensors of the same shapes and dtype, now views of the buffer;
        the layers read them at each call (`compat.HOTSWAP_SOURCES`). Only where each tensor fills
        its block (the adapter's rank is the engine's), on a CPU (CUDA graphs keep addresses)."""
        blocks: dict[int, torch.Tensor] = {}  # plan entry -> the stacked tensor it is written into
        for name, s, a, b in self.writes:
            module = cache.modules[name]
            blocks[a], blocks[b] = module.lora_a_stacked[s], module.lora_b_stacked[s]
        if sorted(blocks) != list(range(len(plan.shapes))):
            return False
        first = blocks[0]
        if any(tuple(stack.shape[2:]) != plan.shapes[p] or stack.device.type != "cpu" or stack.dtype != first.dtype
               or stack.shape[:2] != first.shape[:2] for p, stack in blocks.items()):
            return False
        slots, sizes = first.shape[0], [math.prod(shape) for shape in plan.shapes]
        starts = [0, *itertools.accumulate(sizes)][:-1]
        base = first._base
        if (base is not None and base.dim() == 2 and tuple(base.shape) == (slots, sum(sizes))
                and all(blocks[p]._base is base and blocks[p].storage_offset() - base.storage_offset() == starts[p]
                        for p in blocks)):
            self.slab = base  # laid out alike already
            self.views.clear()
            return True
        if not move:
            return False
        slab = torch.empty(slots, sum(sizes), dtype=first.dtype)
        moved = {p: slab[:, starts[p]:starts[p] + sizes[p]].view(slots, 1, *plan.shapes[p]) for p in blocks}
        with torch.no_grad():
            torch._foreach_copy_([moved[p] for p in blocks], [blocks[p] for p in blocks])
        for name, s, a, b in self.writes:
            module = cache.modules[name]
            module.lora_a_stacked = _replaced(module.lora_a_stacked, s, moved[a])
            module.lora_b_stacked = _replaced(module.lora_b_stacked, s, moved[b])
        self.views.clear()
        self.stacks = [(m.lora_a_stacked, m.lora_b_stacked) for m in cache.modules.values()]
        self.slab = slab
        return True

    def matches(self, cache: Any, plan: "ModelPlan", index: int, tensors: list[torch.Tensor]) -> bool:
        """Slot `index` holds exactly what this plan writes from `tensors` (plan order)."""
        views = self.at(cache, plan, index)
        return (all(torch.equal(view, tensors[p]) for view, p in zip(views.writes, self.positions))
                and not any(bool(view.any()) for view in views.zeros))

    @staticmethod
    def write(views: SlotViews, sources: list[torch.Tensor]) -> None:
        """Activate a version into a free slot as `activate_adapter` would, from its LoRAModel's
        tensors (`positions` order): clear what it does not write, copy each into its block."""
        with torch.no_grad():
            if views.zeros:
                torch._foreach_zero_(views.zeros)
            torch._foreach_copy_(views.writes, sources)


def _replaced(stacked: tuple, index: int, tensor: torch.Tensor) -> tuple:
    return tuple(tensor if i == index else old for i, old in enumerate(stacked))


@dataclass
class ModelPlan:
    """Where each incoming tensor of one structure lands in vLLM's merged LoRAModel."""

    names: list[str]  # incoming tensor names: lora_A first, then lora_B grouped by scaling
    locs: list[Loc]
    shapes: list[tuple[int, ...]]
    factors: list[float]  # what vLLM multiplies each into (lora_B: its scaling; lora_A: 1)
    scale: list[tuple[int, int, float]]  # the same as flat ranges: (start, end, factor)
    packed: dict[str, int | None]  # module key -> slices of a packed module (None: not packed)
    dtype: torch.dtype
    in_order: bool = False  # `names` is the incoming order: a sender's flat buffer is this plan's layout
    slots: SlotPlan | None = None

    @classmethod
    def learn(cls, staged: dict[str, torch.Tensor], before: dict[str, tuple[bool, float]], model: Any,
              dtype: torch.dtype) -> "ModelPlan | None":
        """From a model vLLM built out of `staged` (our tensors, already in its dtype: it keeps
        them as they are) and then merged, find each staged tensor by identity. `before`: name ->
        (is lora_B, scaling) as `from_lora_tensors` left them. None when a tensor was replaced
        (stacked, pinned) or something else appeared."""
        origin = {id(t): name for name, t in staged.items()}
        found: dict[str, Loc] = {}
        packed: dict[str, int | None] = {}
        for key, weights in model.loras.items():
            packed[key] = len(weights.lora_a) if isinstance(weights.lora_a, list) else None
            for is_b, value in ((False, weights.lora_a), (True, weights.lora_b)):
                for index, tensor in _parts(value):
                    if tensor is None:
                        continue
                    name = origin.get(id(tensor))
                    if name is None or name in found or name not in before or before[name][0] != is_b:
                        return None
                    found[name] = (key, index, is_b)
        if set(found) != set(before) or getattr(model, "modules_to_save", None):
            return None
        order = [n for n in staged if n in found and not before[n][0]]
        order += sorted((n for n in staged if n in found and before[n][0]), key=lambda n: before[n][1])
        shapes = [tuple(staged[n].shape) for n in order]
        factors = [before[n][1] for n in order]
        return cls(order, [found[n] for n in order], shapes, factors, _runs(shapes, factors), packed, dtype,
                   in_order=order == list(staged))

    def reproduces(self, tensors: dict[str, torch.Tensor], model: Any) -> bool:
        """This plan's recipe applied to `tensors` gives `model`'s tensors bit for bit."""
        for name, loc, factor in zip(self.names, self.locs, self.factors):
            expected = tensors[name].to(device="cpu", dtype=self.dtype, copy=True)
            if factor != 1:
                expected *= factor  # in place, in vLLM's dtype, as LoRALayerWeights.optimize
            if not torch.equal(expected, weight_at(model, loc)):
                return False
        return True

    def spare(self, model: Any) -> Spare:
        """Move a retired model's tensors into one flat buffer, in plan order."""
        old = [weight_at(model, loc) for loc in self.locs]
        flat = torch.empty(sum(t.numel() for t in old), dtype=self.dtype, pin_memory=bool(old[0].is_pinned()))
        views, offset = [], 0
        for tensor in old:
            views.append(flat[offset:offset + tensor.numel()].view(tensor.shape))
            offset += tensor.numel()
        with torch.no_grad():
            torch._foreach_copy_(views, old)
        for loc, view in zip(self.locs, views):
            _put(model, loc, view)
        return Spare(model, flat, views)

    def fill(self, spare: Spare, tensors: dict[str, torch.Tensor], flat: torch.Tensor | None = None) -> bool:
        """Copy a new version into a spare, as `from_lora_tensors` + `add_adapter` build it:
        with one copy when the sender's `flat` buffer (its tensors' backing, in their order)
        is laid out as this plan (returns True), else tensor by tensor."""
        one_copy = self.dense_source(tensors, flat, spare.flat.numel())
        if one_copy:
            assert flat is not None
            copy_scaled(spare.flat, flat, self.scale, check=False)
            return True
        with torch.no_grad():
            torch._foreach_copy_(spare.views, [tensors[name] for name in self.names])
            for start, end, factor in self.scale:
                spare.flat[start:end].mul_(factor)  # lora_B *= scaling, as LoRALayerWeights.optimize
        return False

    def dense_source(self, tensors: dict[str, torch.Tensor], flat: torch.Tensor | None, numel: int) -> bool:
        """`flat` holds `tensors` end to end in this plan's order (checked at both ends)."""
        if flat is None or not self.in_order or flat.dim() != 1 or flat.numel() != numel or not flat.is_contiguous():
            return False
        first, last = tensors[self.names[0]], tensors[self.names[-1]]
        return (first.data_ptr() == flat.data_ptr() and last.is_contiguous()
                and last.data_ptr() + last.numel() * last.element_size() == flat.data_ptr() + numel * flat.element_size())


def _runs(shapes: list[tuple[int, ...]], factors: list[float]) -> list[tuple[int, int, float]]:
    """(start, end, factor): the ranges of a flat buffer holding `shapes` in order to multiply,
    one per run of equal factors other than 1."""
    ranges: list[tuple[int, int, float]] = []
    offset = 0
    for shape, factor in zip(shapes, factors):
        end = offset + math.prod(shape)
        if factor != 1:
            if ranges and ranges[-1][1] == offset and ranges[-1][2] == factor:
                ranges[-1] = (ranges[-1][0], end, factor)
            else:
                ranges.append((offset, end, factor))
        offset = end
    return ranges
