"""A model's shape as the memory plan needs it, read from its config.json without loading it.

Only Llama-style dense decoders are planned (Llama, Qwen2/3, Mistral, SmolLM, ...): embeddings,
per layer q/k/v/o attention with grouped KV heads and a gated MLP (gate, up, down), RMSNorms,
and an LM head unless it is tied to the embeddings. The embedded default model's config.json
ships with the package, so planning it never builds it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Keys that mark a mixture-of-experts config: its per-token memory is not a dense decoder's.
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


class PlanUnavailable(Exception):
    """The plan cannot be made (unknown model config, unsupported architecture): one line."""


class NothingToPlan(PlanUnavailable):
    """A run the plan cannot describe and the run's own checks refuse anyway (a model name that
    does not resolve, a device this machine lacks): `train` leaves the telling to them."""


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a dense decoder that decide its memory."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool  # the LM head is the embedding matrix
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of q and k

    @classmethod
    def from_config(cls, cfg: dict[str, Any], name: str = "model") -> "ModelShape":
        cfg = cfg.get("text_config", cfg)  # multimodal configs nest the language model's
        if any(cfg.get(key) for key in MOE_KEYS):
            raise PlanUnavailable(f"{name}: a mixture-of-experts model; the memory plan covers dense decoders only")
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            kind = str(cfg.get("model_type", ""))
            return cls(
                hidden=hidden, intermediate=int(cfg["intermediate_size"]), layers=int(cfg["num_hidden_layers"]),
                heads=heads, kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads), vocab=int(cfg["vocab_size"]),
                # transformers' Llama/Qwen configs default to untied; an absent key means that.
                tied=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=kind == "qwen2" or bool(cfg.get("attention_bias", False)),
                o_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
                qk_norm=kind.startswith("qwen3"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanUnavailable(f"{name}: config.json lacks a decoder field ({exc}); "
                                  "cannot plan its memory") from None

    # ---- shapes
    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one decoder layer."""
        attn, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q_proj": (self.hidden, attn), "k_proj": (self.hidden, kv), "v_proj": (self.hidden, kv),
                "o_proj": (attn, self.hidden), "gate_proj": (self.hidden, self.intermediate),
                "up_proj": (self.hidden, self.intermediate), "down_proj": (self.intermediate, self.hidden)}

    # ---- parameter counts
    @property
    def linear_params(self) -> int:
        """Weights of every decoder linear layer: what bitsandbytes quantises."""
        return self.layers * sum(i * o for i, o in self.linears().values())

    @property
    def linear_rows(self) -> int:
        """Output rows of every decoder linear layer (int8 keeps one scale per row)."""
        return self.layers * sum(o for _, o in self.linears().values())

    @property
    def other_params(self) -> int:
        """Everything bitsandbytes leaves at the compute dtype: embeddings, LM head, norms, biases."""
        shapes = self.linears()
        bias = sum(shapes[n][1] for n in ("q_proj", "k_proj", "v_proj")) if self.qkv_bias else 0
        bias += self.hidden if self.o_bias else 0
        bias += 2 * self.intermediate + self.hidden if self.mlp_bias else 0
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return embeddings + self.layers * (bias + norms) + self.hidden  # + the final norm

    @property
    def total_params(self) -> int:
        return self.linear_params + self.other_params

    @property
    def largest_linear(self) -> int:
        return max(i * o for i, o in self.linears().values())

    def lora_params(self, rank: int, targets: str | list[str]) -> int:
        """A LoRA adapter's parameters: A [r, in] and B [out, r] on each targeted layer.
        peft's 'all-linear' is every decoder linear (never the LM head)."""
        shapes = self.linears()
        names = ALL_LINEAR if targets == "all-linear" else [n for n in targets if n in shapes]
        return self.layers * sum(rank * (shapes[n][0] + shapes[n][1]) for n in names)

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """KV cache per token: a key and a value per KV head per layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize


def model_config(name: str, embedded: dict[str, Path], cache_models: Path) -> dict[str, Any]:
    """The config.json of a model name, found without building or downloading anything.

    `embedded`: embedded model names -> their shipped config; `cache_models`: where built
    embedded models live (their own config is preferred when present)."""
    if name in embedded:
        built = cache_models / name / "config.json"
        return json.loads(built.read_text() if built.is_file() else embedded[name].read_text())
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise NothingToPlan(f"model.name: {path} has no config.json")
        return json.loads((path / "config.json").read_text())
    if "/" in name and name.count("/") == 1 and not name.startswith((".", "/")):
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "config.json")
        if isinstance(found, str):
            return json.loads(Path(found).read_text())
        raise PlanUnavailable(f"model.name: no local config.json for hub model {name!r} (not in the HF cache); "
                              "cannot plan its memory")
    raise NothingToPlan(f"model.name: unknown model {name!r}; cannot plan its memory")


def shipped_configs() -> dict[str, Path]:
    """Embedded model name -> its config.json inside this package."""
    from ..models import EMBEDDED

    folder = resources.files(__package__)
    return {name: Path(str(folder / f"{name}.json")) for name in EMBEDDED if (folder / f"{name}.json").is_file()}


def load_shape(name: str) -> ModelShape:
    """The shape of the model `model.name` names (see `model_config`)."""
    from ..models import cache_dir

    return ModelShape.from_config(model_config(name, shipped_configs(), cache_dir() / "models"), name)
