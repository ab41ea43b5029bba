"""The weights a quantised learner computes with, read off its own layers: what the generator's
copy of its base (`served_base`) holds.

`quantised_base` loads a checkpoint as the learner does under a `Recipe` (bitsandbytes nf4 or
int8, on the learner's device type: bitsandbytes' CPU and CUDA kernels need not round alike).
`learner_weights` then yields every parameter at the learner's compute dtype: a quantised
layer's weight as the layer itself multiplies by (`_read_weight`), every other tensor
(embeddings, norms, LM head) as the learner holds it. `copy_bytes` is what that comes to on disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from ..base_recipe import Recipe
from .frozen_base import load_base, quiet_int8_casts


def quantised_base(model_dir: Path, recipe: Recipe) -> torch.nn.Module:
    """`model_dir` loaded as the learner loads it under `recipe`."""
    if recipe.quantization == "int8":
        quiet_int8_casts()
    return load_base(model_dir, recipe.dtype, recipe.quantization, torch.device(recipe.device))


def _quantised_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    import bitsandbytes as bnb

    return {name: module for name, module in model.named_modules()
            if isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))}


def copy_bytes(model: torch.nn.Module, compute: torch.dtype) -> int:
    """What `learner_weights` will write: a quantised layer's weight at `compute`, the rest as held."""
    layers = _quantised_layers(model)
    total = 0
    for name, param in model.named_parameters():
        layer = layers.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
        if layer is None:
            total += param.numel() * param.element_size()
        else:
            shape = int(layer.in_features) * int(layer.out_features)  # type: ignore[arg-type]
            total += shape * torch.empty((), dtype=compute).element_size()
    return total


def learner_weights(model: torch.nn.Module, compute: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter of a base loaded by `load_base`, as the learner computes with it, on the
    CPU. A bitsandbytes layer's weight is read off the layer itself: its output for the rows of
    an identity matrix, with its bias set aside, is the transposed weight it multiplies by.
    Each output element is 1 x w plus zeros, so this is exact, and it holds for
    whichever kernel the layer runs (`frozen_base.one_kernel_path`), on any device, without
    relying on how bitsandbytes lays out its packed weights. Any other parameter is taken as it
    is; tied parameters come once."""
    layers = _quantised_layers(model)
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        layer = layers.get(owner) if leaf == "weight" else None
        value = param.data if layer is None else _read_weight(layer, compute)
        yield name, value.detach().to("cpu", copy=True).contiguous()


@torch.no_grad()
def _read_weight(layer: torch.nn.Module, compute: torch.dtype, rows: int = 2048) -> torch.Tensor:
    """`layer`'s effective weight, [out_features, in_features], `rows` identity rows at a time."""
    n_in = int(layer.in_features)  # type: ignore[arg-type]
    device = next(layer.parameters()).device
    bias, layer.bias = layer.bias, None  # type: ignore[assignment]  # (w + b) - b need not round back to w
    try:
        parts = []
        for start in range(0, n_in, rows):
            eye = torch.zeros(min(rows, n_in - start), n_in, dtype=compute, device=device)
            eye[:, start:start + eye.shape[0]].fill_diagonal_(1)
            parts.append(layer(eye).to(compute))
    finally:
        layer.bias = bias
    return torch.cat(parts).t().contiguous()
