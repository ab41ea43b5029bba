"""The learner's frozen base: at its compute dtype, or quantised by bitsandbytes (QLoRA).

`model.quantization = "nf4"` loads every linear layer of the base as 4-bit NormalFloat with
double quantisation (the QLoRA recipe); `"int8"` as LLM.int8() weights. Embeddings, norms and
the LM head stay at the compute dtype. The LoRA weights are trained at full precision either
way, so the adapter is an ordinary PEFT adapter. vLLM serves it on these same weights,
dequantised (`served_base.py`), so both halves compute from the same numbers.

peft's `prepare_model_for_kbit_training` is not used. What it does is cast the non-quantised
weights (norms, embeddings, LM head) to float32, turn on reentrant gradient checkpointing, and
make the inputs require grad for that checkpointing. Each is either done already or does not
help here. transformers' RMSNorm already normalises in float32. float16 compute, where the cast
helps, is not a learner dtype. Checkpointing stays under `learner.gradient_checkpointing`, and
it is non-reentrant, so inputs need no grad. The cast would also cost memory: a float32 copy of
a 128k-vocab LM head is 2 GB on an 8B model.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..dtypes import torch_dtype

if TYPE_CHECKING:
    from transformers import PreTrainedModel

QUANTIZATIONS = ("none", "nf4", "int8")


class QuantizationError(RuntimeError):
    """bitsandbytes cannot quantise on this device (one line, for the CLI's exit code 2)."""


def check_quantization(quantization: str, device: str, field: str = "model.quantization") -> None:
    """Quantise a small tensor the way the learner will, before any model is loaded: a missing
    or broken bitsandbytes, or a device it has no kernels for, fails here in one line."""
    if quantization == "none":
        return
    try:
        import bitsandbytes
        import bitsandbytes.functional as bnbf
    except Exception as exc:  # ImportError, or a build that fails to load its native library
        raise QuantizationError(f"{field} = {quantization!r} needs bitsandbytes, which cannot be loaded "
                                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                                "install it (pip install bitsandbytes) or set it to 'none'") from None
    try:
        probe = torch.linspace(-1, 1, 256, device=device, dtype=torch.float32).reshape(4, 64)
        if quantization == "nf4":
            packed, state = bnbf.quantize_4bit(probe, quant_type="nf4")
            back = bnbf.dequantize_4bit(packed, state)
        else:
            packed, scales, _ = bnbf.int8_vectorwise_quant(probe.half())
            back = bnbf.int8_vectorwise_dequant(packed, scales)
        # NF4's widest gap (0.72 to 1.0 of a block's absmax) bounds its round-trip error near 0.14.
        tolerance = 0.2 if quantization == "nf4" else 0.02
        if not torch.allclose(back.float(), probe, atol=tolerance):
            raise RuntimeError(f"a quantise/dequantise round trip is off by more than {tolerance}")
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise QuantizationError(f"{field} = {quantization!r}: bitsandbytes {bitsandbytes.__version__} "
                                f"cannot quantise on {device} ({first}); set it to 'none' or use another "
                                "device") from None


def quantization_config(quantization: str, compute_dtype: torch.dtype) -> Any:
    """transformers' `BitsAndBytesConfig` for `model.quantization` (None for "none")."""
    from transformers import BitsAndBytesConfig

    if quantization == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=compute_dtype)
    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def load_base(model_dir: Path, dtype: str, quantization: str, device: torch.device) -> "PreTrainedModel":
    """The frozen base on `device`: at `dtype`, or quantised with its compute in `dtype`."""
    from transformers import AutoModelForCausalLM

    compute = torch_dtype(dtype)
    # sdpa takes the boolean 4-D prompt-tree masks built in `build_micro_batch` as they are.
    if quantization == "none":
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=compute, attn_implementation="sdpa")
        return base.to(device)  # type: ignore[arg-type]  # transformers' `to` decorator hides its signature
    check_quantization(quantization, str(device))
    base = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=compute, attn_implementation="sdpa", device_map={"": str(device)},
        quantization_config=quantization_config(quantization, compute))
    for param in base.parameters():
        param.requires_grad_(False)
    one_kernel_path(base)
    return base


def one_kernel_path(base: torch.nn.Module) -> None:
    """Make every bitsandbytes layer compute as its training forward does, whatever the mode:
    dequantise the weight to the input's dtype, then an ordinary matmul.

    bitsandbytes 0.50 switches kernels on the module's mode and the input. On a CPU with
    AVX512-BF16, a 4-bit layer in eval mode given an input that needs no grad repacks its weight
    and runs a kernel that rounds the activations to bfloat16, 1.4% off a float32 matmul; from
    then on every call takes it. An int8 layer in eval mode quantises its inputs to int8 as
    well. The learner's layers are in eval mode (no dropout), and its first layers' inputs need
    no grad. Without this, one learner computed with two kernels, and no served copy of its
    weights could match it. With it, `base_weights.learner_weights` reads off exactly the
    weights the learner multiplies by. Call it again after anything sets the model's mode."""
    import bitsandbytes as bnb

    for module in base.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
        elif isinstance(module, bnb.nn.Linear8bitLt):
            module.training = True  # its `state.is_training`: dequantise, then matmul (MatMul8bitFp on CPU)


def quiet_int8_casts() -> None:
    """LLM.int8() logs on every float32 matmul that it casts the inputs to float16 (its kernels'
    dtype); the cast is expected here, and the message would flood the log."""
    logger = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _Int8CastFilter) for f in logger.filters):
        logger.addFilter(_Int8CastFilter())


class _Int8CastFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "inputs will be cast" not in record.getMessage()
