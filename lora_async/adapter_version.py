"""An adapter version as the learner hands it over and every other side names it.

`AdapterVersion` is one version of one adapter ready to publish: tensors under peft state-dict
names and the peft config (`peft_config_dict`) that goes with them. `served_name` is the one
place the name a version is served under is built (`<adapter>@v<version>`, never reused), and
`parse_served_name` its inverse.

Below both `learner/` (which makes versions) and `generator/` (which serves them), so neither
imports the other for it. Kept free of torch imports: the generator's contract (`generator.types`)
and the environments that read it import this module.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

from .config import ADAPTER_NAME_RE

if TYPE_CHECKING:
    import torch

SEPARATOR = "@v"


def served_name(adapter: str, version: int) -> str:
    """The name `adapter`'s `version` is served under: `<adapter>@v<version>` (never reused:
    vLLM keys its prefix cache by name)."""
    return f"{adapter}{SEPARATOR}{version}"


def parse_served_name(name: str) -> tuple[str, int]:
    """(adapter, version) of a served name; ValueError for anything else, a plain adapter name
    (letters, digits, '_' and '-') included."""
    adapter, _, version = name.partition(SEPARATOR)
    if not ADAPTER_NAME_RE.fullmatch(adapter) or not version.isdigit():
        raise ValueError(f"adapter version name {name!r} is not '<name>@v<k>' with a plain name "
                         "(letters, digits, '_' and '-')")
    return adapter, int(version)


class _ConfigObject(Protocol):
    def to_dict(self) -> dict[str, Any]: ...


def peft_config_dict(config: _ConfigObject | Mapping[str, Any]) -> dict[str, Any]:
    """A peft `LoraConfig` (or a mapping of its fields) as a JSON-able dict (sets become sorted lists)."""
    raw = dict(config) if isinstance(config, Mapping) else config.to_dict()
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in raw.items()}


@dataclass(frozen=True)
class AdapterVersion:
    """An adapter version ready to publish: tensors (peft state-dict names) + peft config."""

    adapter: str
    version: int
    tensors: dict[str, torch.Tensor]
    peft_config: dict = field(default_factory=dict)
    # The one contiguous CPU buffer `tensors` are views of, laid end to end in their order
    # (`gather` makes it): a receiver may copy every tensor with one op. None: separate tensors.
    flat: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @classmethod
    def gather(cls, adapter: str, version: int, state: dict[str, torch.Tensor], peft_config: dict) -> "AdapterVersion":
        """One copy of `state` (any device) into one contiguous CPU buffer, every lora_A tensor
        first and then every lora_B one (the order vLLM's merged model is filled in), as views.
        Tensors of mixed dtypes are copied one by one instead."""
        import torch

        ordered = sorted(state, key=lambda k: "lora_B" in k)  # stable: A's, then B's, each as given
        dtypes = {t.dtype for t in state.values()}
        if len(dtypes) != 1:
            return cls(adapter, version, {k: state[k].detach().to("cpu", copy=True) for k in ordered}, peft_config)
        flat = torch.empty(sum(state[k].numel() for k in ordered), dtype=dtypes.pop())
        views = dict(zip(ordered, (piece.view(state[k].shape) for piece, k in
                                   zip(torch.split(flat, [state[k].numel() for k in ordered]), ordered))))
        with torch.no_grad():
            torch._foreach_copy_(list(views.values()), [state[k].detach() for k in ordered])
        return cls(adapter, version, views, peft_config, flat)

    @cached_property
    def structure(self) -> tuple:
        """What a version shares with any other that can take its place in an engine: tensor
        names, shapes and dtypes, and the peft config. Built once per version, from
        whole-sequence comprehensions (~400 tensors), for the generator's structure check and
        the in-process worker's hot-swap plans alike."""
        tensors = self.tensors.values()
        dtypes = (self.flat.dtype,) if self.flat is not None else tuple([t.dtype for t in tensors])
        return (tuple(self.tensors), tuple([t.shape for t in tensors]), dtypes,
                json.dumps(self.peft_config, sort_keys=True, default=str))

    @property
    def served_name(self) -> str:
        """The name it is served under (`served_name`)."""
        return served_name(self.adapter, self.version)

    @property
    def nbytes(self) -> int:
        if self.flat is not None:
            return self.flat.numel() * self.flat.element_size()
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
