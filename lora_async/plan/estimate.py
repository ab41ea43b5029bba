"""The memory plan's arithmetic: a run's config and its model's shape -> bytes per device, by item.

Pure arithmetic, no model is loaded. The learner's activations are what autograd keeps for
backward, counted tensor by tensor for a Llama-style layer with peft LoRA (see
`layer_bytes_per_token`); the counts were checked against the tensors torch actually saves on
the default model, and the totals against peak RSS (bench/memory_check.py, bench/RESULTS.md
"Memory plan vs measured"). Constants that could not be derived are named, with where they
come from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .machine import BYTES_BY_DTYPE_NAME, GIB, Layout, Machine, layout, planned_dtype
from .shapes import ALL_LINEAR, ModelShape, NothingToPlan, load_shape

if TYPE_CHECKING:
    from ..config import TrainConfig, VllmGeneratorConfig

# 4-bit codes, plus the double-quantised absmax: one 8-bit absmax per 64 weights and one fp32
# per 256 of those blocks (0.127 bits per weight).
NF4_BYTES = 0.5 + 0.127 / 8
LORA_STATE_BYTES = 16  # per LoRA parameter: fp32 weight, gradient, AdamW exp_avg and exp_avg_sq
SNAPSHOT_BYTES = 4  # the canary's spare fp32 copy of each adapter (learner.snapshot_logprobs)
# fp32 [chunk, vocab] tensors alive at once in a log-softmax chunk's backward: the recomputed
# log-softmax output, the gradient scattered into it, and the gradient of its input.
LOGPROB_COPIES = 3
MAX_ROW_TOKENS = 1024  # learner.packing.MAX_ROW_TOKENS: a packed row is at most this wide
# glibc malloc keeps blocks a CPU forward pass frees (its mmap threshold rises to 32 MiB), so
# the learner's RSS peaks above its tensors, with or without checkpointing, by about this many
# copies of every layer's linear outputs at the compute dtype: 1.3 to 1.9 measured on the
# default model (fp32 and bf16, bench/RESULTS.md); calibrated, not derived.
CPU_RETENTION = 1.7
# Not measured (no GPU here): the caching allocator's fragmentation over activations, the CUDA
# context with cuBLAS workspace per process and GPU, and the pool of vLLM's CUDA graphs.
CUDA_SLACK = 0.15
CUDA_CONTEXT = int(0.75 * GIB)
CUDA_GRAPHS = int(0.5 * GIB)
# vLLM's default max_num_batched_tokens (its profile run's batch) for an engine built from
# EngineArgs: 4096 on CPU, 8192 on GPUs under 70 GiB, 16384 above.
VLLM_BATCH_TOKENS_CPU, VLLM_BATCH_TOKENS_GPU, VLLM_BATCH_TOKENS_BIG_GPU = 4096, 8192, 16384
SAMPLER_COPIES = 3  # fp32 [seqs, vocab] in vLLM's sampler: logits, probabilities, logprobs


@dataclass(frozen=True)
class Item:
    part: str  # "learner", "learner rank 1", "generator", "framework"
    name: str
    bytes: int
    detail: str = ""


@dataclass
class DevicePlan:
    device: str
    capacity: int
    items: list[Item] = field(default_factory=list)

    @property
    def need(self) -> int:
        return sum(item.bytes for item in self.items)

    @property
    def fits(self) -> bool:
        return self.need <= self.capacity

    def part(self, prefix: str) -> int:
        return sum(item.bytes for item in self.items if item.part.startswith(prefix))


@dataclass
class Plan:
    model: str
    params: int
    machine: Machine
    layout: Layout
    devices: list[DevicePlan]
    problems: list[str]  # what fails whatever the totals (a KV cache too small for one sequence)
    activations: dict[str, int]  # the first learner rank's, checkpointing "off" and "on"
    kv_tokens: int | None
    dtypes: dict[str, str]
    served: str = ""  # which base the generator serves, when the learner's is quantised

    @property
    def fits(self) -> bool:
        return not self.problems and all(d.fits for d in self.devices)

    def over(self) -> list[DevicePlan]:
        return [d for d in self.devices if not d.fits]


# ---------------------------------------------------------------- learner


def layer_bytes_per_token(shape: ModelShape, itemsize: int, targets: set[str], row_tokens: int) -> int:
    """What autograd keeps per token in one decoder layer for the LoRA gradients (frozen base).

    - LoRA inputs: each lora_A keeps its input in fp32. peft casts the input per layer, so at a
      16-bit dtype each targeted layer has its own fp32 copy; at fp32 the layers sharing an input
      share it (o_proj's input is the attention output that sdpa keeps anyway).
    - attention (sdpa): q, and k and v repeated to every head (the packed rows' mask keeps
      GQA off), the output, the fp32 logsumexp per head, and the mask as a float [row] per token.
    - two RMSNorms: each keeps its input in fp32.
    - gated MLP: the gate output (SiLU's input), the activation and the up output.
    A frozen base linear keeps nothing (its weight is already there; bitsandbytes keeps the packed one).
    """
    h, inter, attn, b = shape.hidden, shape.intermediate, shape.heads * shape.head_dim, itemsize
    shapes = shape.linears()
    if b < 4:
        lora = sum(4 * shapes[name][0] for name in targets)
    else:
        lora = 4 * (h * bool(targets & {"q_proj", "k_proj", "v_proj"}) + h * bool(targets & {"gate_proj", "up_proj"})
                    + inter * ("down_proj" in targets))
    attention = 4 * attn * b + 4 * shape.heads + row_tokens * b
    return lora + attention + 2 * h * 4 + 3 * inter * b


def activation_bytes(shape: ModelShape, itemsize: int, targets: set[str], tokens: int, row_tokens: int,
                     checkpointing: bool) -> int:
    """A micro-batch's kept activations. Checkpointing keeps each layer's input and recomputes one
    layer at a time in backward. Both keep the final norm's fp32 input and the last hidden state."""
    layer = layer_bytes_per_token(shape, itemsize, targets, row_tokens)
    per_token = shape.layers * shape.hidden * itemsize + layer if checkpointing else shape.layers * layer
    return tokens * (per_token + shape.hidden * (4 + itemsize))


def logprob_chunk_bytes(shape: ModelShape, itemsize: int, chunk: int) -> int:
    """One chunk of the log-softmax over the vocabulary in backward (fp32, plus the 16-bit
    logits' gradient when the model computes in 16 bits)."""
    return chunk * shape.vocab * (4 * LOGPROB_COPIES + (itemsize if itemsize < 4 else 0))


def weight_items(config: "TrainConfig", shape: ModelShape, device: str, dtype: str, part: str) -> list[Item]:
    b, quant = BYTES_BY_DTYPE_NAME[dtype], config.model.quantization
    if quant == "none":
        params = shape.total_params
        items = [Item(part, f"base weights, {dtype}", params * b, f"{params / 1e9:.2f}B params")]
        if device == "cpu" and b == 2:
            # Measured on an AVX2 CPU: a bf16 step holds about one more copy of the linear weights
            # from forward to the end of backward; no tensor autograd saves, so the matmuls' own.
            items.append(Item(part, "bf16 matmul weight copies", shape.linear_params * b, "CPU, measured"))
        return items
    per = NF4_BYTES if quant == "nf4" else 1.0
    scales = shape.linear_rows * 4 if quant == "int8" else 0  # LLM.int8(): an fp32 scale per row
    packed = int(shape.linear_params * per) + scales
    rest = shape.other_params * b + shape.largest_linear * b  # + one layer dequantised at a time
    return [Item(part, f"base weights, {quant} + {dtype}", packed + rest,
                 f"{shape.linear_params / 1e9:.2f}B + {shape.other_params / 1e9:.2f}B params")]


def learner_items(config: "TrainConfig", shape: ModelShape, device: str, dtype: str, part: str = "learner",
                  row_tokens: int | None = None) -> list[Item]:
    """Everything one learner rank holds at its peak: the start of backward on a full micro-batch."""
    learner, b = config.learner, BYTES_BY_DTYPE_NAME[dtype]
    tokens = learner.token_budget
    row = row_tokens or min(MAX_ROW_TOKENS, tokens)
    items = weight_items(config, shape, device, dtype, part)
    specs = config.adapter_specs
    lora = sum(shape.lora_params(s.lora.rank, s.lora.target_modules) for s in specs)
    per_param = LORA_STATE_BYTES + (SNAPSHOT_BYTES if config.run.canary_every else 0)
    items.append(Item(part, f"LoRA x{len(specs)}, grads, AdamW", lora * per_param, f"{lora / 1e6:.1f}M params, fp32"))
    targets = union_targets(config)
    acts = activation_bytes(shape, b, targets, tokens, row, learner.gradient_checkpointing)
    ckpt = "on" if learner.gradient_checkpointing else "off"
    items.append(Item(part, f"activations, checkpointing {ckpt}", acts, f"{tokens} tokens, rows <= {row}"))
    chunk = min(learner.logprob_chunk, tokens)
    items.append(Item(part, "log-softmax chunk", logprob_chunk_bytes(shape, b, chunk),
                      f"{chunk} x {shape.vocab}, fp32"))
    if device == "cpu":
        outputs = sum(out for _, out in shape.linears().values())
        kept = CPU_RETENTION * tokens * shape.layers * outputs * b
        items.append(Item(part, "freed, kept by malloc", int(kept), "glibc; calibrated"))
    else:
        items.append(Item(part, "allocator slack", int(CUDA_SLACK * acts), f"{CUDA_SLACK:g} x activations"))
    return items


def union_targets(config: "TrainConfig") -> set[str]:
    """Every layer name any adapter targets (activations are per micro-batch: one adapter at a time)."""
    names: set[str] = set()
    for spec in config.adapter_specs:
        targets = spec.lora.target_modules
        names |= set(ALL_LINEAR) if targets == "all-linear" else set(targets) & set(ALL_LINEAR)
    return names


# ---------------------------------------------------------------- generator


def generator_items(config: "TrainConfig", gen: "VllmGeneratorConfig", shape: ModelShape, device: str, dtype: str,
                    capacity: int) -> tuple[list[Item], list[str], int]:
    """The vLLM engine `gen` (the run's `[generator]`): (items, problems, KV-cache tokens)."""
    from ..envs.games import kept_versions
    from ..generator.spec import DEFAULT_MAX_NUM_SEQS, EngineSpec

    b = BYTES_BY_DTYPE_NAME[dtype]
    part = "generator"
    if gen.quantization == "bitsandbytes":
        weights = int(shape.linear_params * NF4_BYTES) + shape.other_params * b
        items = [Item(part, f"base weights, 4-bit + {dtype}", weights, "vLLM bitsandbytes")]
    else:
        weights = shape.total_params * b
        learners = config.model.quantization != "none" and config.generator.base == "learner"
        items = [Item(part, f"base weights, {dtype}", weights,
                      f"learner's {config.model.quantization}, dequantised" if learners else "unquantised")]
    spec = EngineSpec(Path("."), tuple(config.adapter_names), config.buffer.window, config.max_lora_rank,
                      kept=kept_versions(config))  # a game's frozen opponents: slots of their own
    # vLLM sizes a slot for every linear layer it can adapt, at max_lora_rank, in the model dtype.
    slot = shape.lora_params(spec.max_lora_rank, "all-linear") * b
    slots = spec.max_loras + (spec.max_cpu_loras if device == "cpu" else 0)
    items.append(Item(part, f"LoRA slots, {slots} x rank {spec.max_lora_rank}", slots * slot,
                      f"max_loras {spec.max_loras}" + (f" + cpu {spec.max_cpu_loras}" if device == "cpu" else "")))
    batch = VLLM_BATCH_TOKENS_CPU if device == "cpu" else (
        VLLM_BATCH_TOKENS_BIG_GPU if capacity >= 70 * GIB else VLLM_BATCH_TOKENS_GPU)
    h, inter = shape.hidden, shape.intermediate
    qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    layer = batch * (3 * h + qkv + shape.heads * shape.head_dim + 3 * inter) * b
    sampler = DEFAULT_MAX_NUM_SEQS * shape.vocab * 4 * SAMPLER_COPIES
    acts = layer + sampler + (0 if device == "cpu" else CUDA_GRAPHS)
    items.append(Item(part, "activations, sampler", acts, f"{batch}-token batch"))
    fixed = sum(item.bytes for item in items)
    problems = []
    if gen.kv_cache_gb is not None:
        kv = int(gen.kv_cache_gb * GIB)
        items.append(Item(part, "KV cache", kv, "kv_cache_gb"))
    else:
        share = int(gen.memory_fraction * capacity)
        kv = max(0, share - fixed)
        items.append(Item(part, "KV cache", kv, f"rest of memory_fraction {gen.memory_fraction:g}"))
        if kv == 0:
            problems.append(f"generator on {device}: weights, LoRA slots and activations ({fixed / GIB:.1f} GiB) fill "
                            f"generator.memory_fraction {gen.memory_fraction:g} of {capacity / GIB:.1f} GiB; raise it "
                            "or set generator.kv_cache_gb")
    tokens = kv // shape.kv_bytes_per_token(b)
    if kv and tokens < gen.max_model_len:
        problems.append(f"generator on {device}: its KV cache holds {tokens} tokens, under generator.max_model_len "
                        f"{gen.max_model_len}; give it more (generator.kv_cache_gb) or lower max_model_len")
    return items, problems, int(tokens)


# ---------------------------------------------------------------- the plan


def _capacity(machine: Machine, device: str, field_name: str) -> int:
    capacity = machine.capacity(device)
    if capacity is None:
        raise NothingToPlan(f"{field_name}: {device} does not exist on this machine ({machine.describe()}); "
                              "plan for another with --gpus N --gpu-memory-gb G")
    return capacity


def plan_run(config: "TrainConfig", machine: Machine, shape: ModelShape | None = None) -> Plan:
    """The run's memory, device by device, on `machine` (raises PlanUnavailable)."""
    shape = shape or load_shape(config.model.name)
    where = layout(config, len(machine.gpus))
    devices: dict[str, DevicePlan] = {}

    def device_plan(device: str, field_name: str) -> DevicePlan:
        if device not in devices:
            devices[device] = DevicePlan(device, _capacity(machine, device, field_name))
        return devices[device]

    learner_field = "learner.devices" if config.learner.devices else "learner.device"
    learner_dtype = planned_dtype(config.learner.dtype, where.learners[0], machine)
    for rank, device in enumerate(where.learners):
        part = "learner" if rank == 0 else f"learner rank {rank}"
        device_plan(device, learner_field).items += learner_items(config, shape, device, learner_dtype, part)
    problems: list[str] = []
    kv_tokens, gen_dtype = None, None
    engine = config.local_engine
    if where.generator is not None and engine is not None:  # an engine here (the layout placed it)
        target = device_plan(where.generator, "generator.device")
        gen_dtype = planned_dtype(config.model.dtype, where.generator, machine)
        items, problems, kv_tokens = generator_items(config, engine, shape, where.generator, gen_dtype,
                                                     target.capacity)
        target.items += items
    for device, processes in _processes(where).items():
        if device != "cpu":
            devices[device].items.append(Item("framework", f"CUDA context x{processes}", processes * CUDA_CONTEXT,
                                              "one per process"))
    b = BYTES_BY_DTYPE_NAME[learner_dtype]
    tokens = config.learner.token_budget
    row = min(MAX_ROW_TOKENS, tokens)
    activations = {ckpt: activation_bytes(shape, b, union_targets(config), tokens, row, ckpt == "on")
                   for ckpt in ("off", "on")}
    dtypes = {"learner": learner_dtype} | ({"generator": gen_dtype} if gen_dtype else {})
    return Plan(config.model.name, shape.total_params, machine, where, list(devices.values()), problems,
                activations, kv_tokens, dtypes, served_base_text(config, shape.total_params * b, learner_dtype))


def served_base_text(config: "TrainConfig", disk: int, learner_dtype: str) -> str:
    """Which base the generator serves when the learner's is quantised (its memory is the same
    either way: a full-precision base)."""
    quantization = config.model.quantization
    if quantization == "none":
        return ""
    if config.generator.base == "original":
        return (f"generator base: the original checkpoint (generator.base = 'original'); the learner's {quantization} "
                "rounding shows as a logprob gap between the two")
    return (f"generator base: the learner's {quantization} base dequantised to {learner_dtype}, built once and "
            f"cached ({disk / GIB:.2f} GiB on disk); the generator's memory is that of any full-precision base")


def _processes(where: Layout) -> dict[str, int]:
    """Processes per device: rank 0 and an in-process engine share the main process."""
    owners: dict[str, set[str]] = {}
    for rank, device in enumerate(where.learners):
        owners.setdefault(device, set()).add("main" if rank == 0 else f"rank{rank}")
    if where.generator is not None:
        owners.setdefault(where.generator, set()).add("engine" if where.engine_separate else "main")
    return {device: len(names) for device, names in owners.items()}


def learner_total(config: "TrainConfig", device: str, row_tokens: int | None = None) -> int:
    """One learner rank's planned bytes on `device` (for checking the plan against measurement)."""
    shape = load_shape(config.model.name)
    dtype = planned_dtype(config.learner.dtype, device, Machine.this())
    return sum(item.bytes for item in learner_items(config, shape, device, dtype, row_tokens=row_tokens))


def learner_estimate(model_dir: str | Path, *, dtype: str, quantization: str, token_budget: int,
                     device: str = "cuda:0", row_tokens: int | None = None) -> dict[str, object]:
    """The learner's planned figures in GiB, for a check beside a measured step (bench/gpu_check.py):
    `tensors_gb` is what torch allocates (what `torch.cuda.max_memory_allocated` sees),
    `learner_gb` adds the allocator's share (CUDA slack, or what glibc keeps on CPU)."""
    from ..config import load_config

    config = load_config(None, [f"model.name='{model_dir}'", f"learner.dtype={dtype}",
                                f"model.quantization={quantization}", f"learner.token_budget={token_budget}"])
    items = learner_items(config, load_shape(str(model_dir)), device, dtype, row_tokens=row_tokens)
    allocator = sum(i.bytes for i in items if i.name in ("allocator slack", "freed, kept by malloc"))
    total = sum(i.bytes for i in items)
    return {"items_gb": {i.name: round(i.bytes / GIB, 3) for i in items},
            "tensors_gb": round((total - allocator) / GIB, 3), "learner_gb": round(total / GIB, 3)}
