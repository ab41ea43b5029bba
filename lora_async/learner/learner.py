"""The learner: a frozen base with peft LoRA adapters, trained by importance-corrected PG.

One base model, one peft adapter per name (a fleet shares the base), one AdamW per adapter.
A step recomputes the completion-token logprobs in token-budget micro-batches (log-softmax in
chunks, so the 49k-vocab fp32 logits never exist for a whole batch), accumulates the loss as
an exact token-mean over the step, clips, and applies the update unless the loss or gradient
is not finite. The reference model for KL is the same base with the adapter switched off.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..adapter_version import AdapterVersion, peft_config_dict
from ..buffer import TrainSample
from ..config import LearnerConfig, LoraConfig, LossConfig
from ..dtypes import resolve_dtype
from ..loss import has_gradient, policy_loss
from ..placement import Placement
from .frozen_base import load_base, one_kernel_path, quiet_int8_casts
from .heap import release_freed_memory
from .logprobs import completion_logprobs
from .packing import build_micro_batch, plan_step
from .step import Accumulated, StepStats, Update, lr_scale, scaled_lr, step_stats

if TYPE_CHECKING:
    from peft import LoraConfig as PeftLoraConfig


def adapter_seed(seed: int, index: int) -> int:
    """The seed a learner's `index`-th adapter is initialised with: the run's seed for the first
    (and for an adapter added later with that seed: `Learner.add_adapter`), so equal seeds give
    equal initial weights however the learner was built."""
    return seed + index


def peft_lora_config(lora: LoraConfig) -> PeftLoraConfig:
    from peft import LoraConfig as PeftLoraConfig

    targets = lora.target_modules if isinstance(lora.target_modules, list) else "all-linear"
    # peft annotates lora_alpha as int but only divides it by r: a fractional alpha is valid
    return PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=targets,  # type: ignore[arg-type]
                          lora_dropout=lora.dropout, bias="none", task_type="CAUSAL_LM")


@dataclass
class _AdapterState:
    name: str
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    version: int = 0
    skipped_nonfinite: int = 0


class Learner:
    """Holds the base once; one peft adapter + AdamW per adapter name. Runs on one thread."""

    def __init__(self, model_dir: Path, adapters: dict[str, tuple[LoraConfig, float]],
                 learner: LearnerConfig, loss: LossConfig, placement: Placement,
                 temperature: float | dict[str, float], seed: int, quantization: str = "none") -> None:
        """`adapters`: name -> (LoRA shape, learning rate); `temperature`: the sampling
        temperature of the generator (per adapter in a fleet), so logprobs match vLLM's;
        `quantization`: how the frozen base is held ("none", "nf4", "int8": see `base.py`)."""
        from peft import get_peft_model
        from transformers import AutoTokenizer

        self.cfg = learner
        self.loss_cfg = loss
        self.temperatures = (dict(temperature) if isinstance(temperature, dict)
                             else {name: float(temperature) for name in adapters})
        self.device = torch.device(placement.device)
        torch.manual_seed(seed)
        self.dtype = resolve_dtype(learner.dtype, placement.device)
        self.quantization = quantization
        if quantization == "int8":
            quiet_int8_casts()
        base = load_base(model_dir, self.dtype, quantization, self.device)
        if learner.gradient_checkpointing:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.model_dir = Path(model_dir)
        self.peft_configs: dict[str, PeftLoraConfig] = {}
        self.adapters: dict[str, _AdapterState] = {}
        for i, (name, (lora, lr)) in enumerate(adapters.items()):
            torch.manual_seed(adapter_seed(seed, i))
            cfg = peft_lora_config(lora)
            if i == 0:
                self.model = get_peft_model(base, cfg, adapter_name=name)
            else:
                self.model.add_adapter(name, cfg)
            self.peft_configs[name] = cfg
        assert self.peft_configs, "a learner needs at least one adapter"
        self.model.train(any(lora.dropout > 0 for lora, _ in adapters.values()))
        if learner.gradient_checkpointing:
            # transformers checkpoints a decoder layer only while that layer is in training mode;
            # the model stays in eval mode (no dropout), so only the layers themselves are marked.
            from transformers.modeling_layers import GradientCheckpointingLayer

            for module in self.model.modules():
                if isinstance(module, GradientCheckpointingLayer):
                    module.training = True
        for name, (lora, lr) in adapters.items():
            self._train_adapter(name, lr)
        if quantization != "none":
            one_kernel_path(self.model)  # again: setting the mode above reset the int8 layers'
        self.model.set_adapter(next(iter(adapters)))

    def _train_adapter(self, name: str, lr: float) -> None:
        """Make `name`'s LoRA tensors trainable, in fp32 whatever the base dtype, with their own AdamW."""
        params = [p for n, p in self.model.named_parameters() if f".{name}." in n and "lora_" in n]
        for p in params:
            p.requires_grad_(True)
            if p.dtype != torch.float32:
                p.data = p.data.float()
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=self.cfg.weight_decay)
        self.adapters[name] = _AdapterState(name, opt, params)

    # ---- adapters added and removed while the learner lives (`lora-async bench staleness`)
    def add_adapter(self, name: str, lora: LoraConfig, lr: float, temperature: float, seed: int) -> None:
        """A fresh adapter initialised from `seed` as a learner's first adapter is (`adapter_seed`),
        with a new optimizer, at version 0."""
        if name in self.model.peft_config:
            raise ValueError(f"the learner already has an adapter {name!r}")
        torch.manual_seed(adapter_seed(seed, 0))
        cfg = peft_lora_config(lora)
        self.model.add_adapter(name, cfg)
        self.peft_configs[name] = cfg
        self.temperatures[name] = temperature
        self._train_adapter(name, lr)
        if self.quantization != "none":
            one_kernel_path(self.model)

    def remove_adapter(self, name: str) -> None:
        """Delete `name` (and its canary slot) with its optimizer; another adapter becomes active."""
        others = [a for a in self.adapters if a != name]
        if others and self.model.active_adapter in (name, f"{name}-snapshot"):
            self.model.set_adapter(others[0])
        for slot in (name, f"{name}-snapshot"):
            if slot in self.model.peft_config:
                self.model.delete_adapter(slot)
            self.temperatures.pop(slot, None)
        self.adapters.pop(name, None)
        self.peft_configs.pop(name, None)

    def set_objective(self, loss: LossConfig, scale: str) -> None:
        """The loss and `learner.lr_scale` of the steps to come (a shared learner's next arm)."""
        self.loss_cfg = loss
        self.cfg = self.cfg.model_copy(update={"lr_scale": scale})

    # ---- versions
    def version(self, adapter: str) -> int:
        return self.adapters[adapter].version

    def adapter_tensors(self, adapter: str) -> dict[str, torch.Tensor]:
        return self.adapter_version(adapter).tensors

    def adapter_version(self, adapter: str) -> AdapterVersion:
        """A CPU copy of the adapter's current weights, in one buffer (`AdapterVersion.gather`)."""
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.model, adapter_name=adapter)
        return AdapterVersion.gather(adapter, self.version(adapter), state, self.peft_config(adapter))

    def peft_config(self, adapter: str) -> dict:
        cfg = peft_config_dict(self.peft_configs[adapter])
        cfg["base_model_name_or_path"] = str(self.model_dir)
        return cfg

    def load_adapter_tensors(self, adapter: str, tensors: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.model, tensors, adapter_name=adapter)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"adapter {adapter}: unexpected keys {unexpected[:3]}")

    # ---- logprobs without training (canary, eval helpers)
    @torch.no_grad()
    def logprobs(self, adapter: str | None, samples: list[TrainSample]) -> list[list[float]]:
        """Logprobs of each sample's trained completion tokens under `adapter` (None = the base,
        adapter switched off)."""
        result: list[list[float]] = [[] for _ in samples]
        for rows in plan_step(samples, self.cfg.token_budget):
            mb = build_micro_batch(samples, rows, self.pad_id, self.device)
            if adapter is None:
                with self.model.disable_adapter():
                    flat = completion_logprobs(self.model, mb, 1.0, self.cfg.logprob_chunk)
            else:
                self.model.set_adapter(adapter)
                flat = completion_logprobs(self.model, mb, self.temperatures[adapter], self.cfg.logprob_chunk)
            order = [i for row in rows for i in row]
            for i, piece in zip(order, flat.split(mb.lengths)):
                result[i] = piece.float().tolist()
        return result

    def snapshot_logprobs(self, version: AdapterVersion, samples: list[TrainSample]) -> list[list[float]]:
        """Logprobs under a snapshot of an adapter version (e.g. the one just published), held in a
        spare slot so the live adapter and its optimizer are untouched."""
        from peft import set_peft_model_state_dict

        slot = f"{version.adapter}-snapshot"
        if slot not in self.model.peft_config:
            self.model.add_adapter(slot, self.peft_configs[version.adapter])
            self.temperatures[slot] = self.temperatures[version.adapter]
        set_peft_model_state_dict(self.model, version.tensors, adapter_name=slot)
        try:
            return self.logprobs(slot, samples)
        finally:
            self.model.set_adapter(version.adapter)

    def trainable(self, samples: list[TrainSample]) -> list[TrainSample]:
        """The samples that train: those with trained tokens and a gradient (`loss.has_gradient`)."""
        return [s for s in samples if s.trained_tokens and has_gradient(s.advantage, self.loss_cfg.kl_coef)]

    def fits(self, samples: list[TrainSample]) -> bool:
        """Whether one step can take all of `samples` within `learner.micro_batches_per_step`
        (the orchestrator keeps a group that does not fit for the next step)."""
        return len(plan_step(self.trainable(samples), self.cfg.token_budget)) <= self.cfg.micro_batches_per_step

    # ---- the training step
    def train_step(self, adapter: str, samples: list[TrainSample]) -> StepStats:
        started, cpu_started = time.perf_counter(), time.process_time()
        self.begin_step(adapter, samples)
        trained = self.trainable(samples)
        total_tokens = sum(s.trained_tokens for s in trained)
        plan = plan_step(trained, self.cfg.token_budget)
        part = self.accumulate(adapter, trained, plan, total_tokens)
        update = self.apply_update(adapter, part.loss_sum / total_tokens if total_tokens else 0.0, total_tokens,
                                   lr_scale(self.cfg.lr_scale, part.stats))
        return step_stats(adapter, self.version(adapter), samples, total_tokens, len(plan), part, update, started, cpu_started)

    def begin_step(self, adapter: str, samples: list[TrainSample]) -> None:
        """Check that `samples` are all `adapter`'s, make it the active adapter, clear its gradients."""
        strangers = {s.adapter for s in samples} - {adapter}
        if strangers:  # fleet isolation: one adapter's data never trains another
            raise ValueError(f"train_step({adapter!r}) got samples of {sorted(strangers)}")
        self.model.set_adapter(adapter)
        self.adapters[adapter].optimizer.zero_grad(set_to_none=True)

    def accumulate(self, adapter: str, samples: list[TrainSample], plan: list[list[list[int]]],
                   total_tokens: int, on_micro_batch: Callable[[], None] | None = None) -> Accumulated:
        """Forward and backward of `plan`'s micro-batches, the gradients summed in the params.

        Each micro-batch's loss is divided by `total_tokens`, the trained tokens of the whole
        step (a data-parallel rank's share is only part of it), so the summed gradient is the
        step's exact token mean however the micro-batches are split. `on_micro_batch` is told
        after each one (a data-parallel rank's heartbeat)."""
        part = Accumulated()
        for rows in plan:
            part.merge(self._micro_batch(adapter, samples, rows, total_tokens))
            if on_micro_batch is not None:
                on_micro_batch()
        return part

    def _micro_batch(self, adapter: str, samples: list[TrainSample], rows: list[list[int]],
                     total_tokens: int) -> Accumulated:
        temperature, kl_coef = self.temperatures[adapter], self.loss_cfg.kl_coef
        mb = build_micro_batch(samples, rows, self.pad_id, self.device)
        logp = completion_logprobs(self.model, mb, temperature, self.cfg.logprob_chunk)
        ref = None
        if kl_coef > 0:
            with torch.no_grad(), self.model.disable_adapter():
                ref = completion_logprobs(self.model, mb, temperature, self.cfg.logprob_chunk)
        loss_sum, stats = policy_loss(logp, mb.behaviour, mb.advantages, self.loss_cfg, ref_logp=ref,
                                      stale=mb.stale, lag=mb.lag, lengths=mb.lengths)
        with torch.no_grad():
            on_policy = mb.lag == 0
            stats.onpolicy_tokens = int(on_policy.sum())
            stats.onpolicy_mismatch_sum = float((logp - mb.behaviour)[on_policy].abs().sum())
        (loss_sum / total_tokens).backward()
        return Accumulated(float(loss_sum.detach()), mb.padded_tokens, stats)

    def apply_update(self, adapter: str, loss_value: float, total_tokens: int, scale: float = 1.0) -> Update:
        """Clip the accumulated gradients and step with the learning rate times `scale`, unless
        the loss or the gradient is not finite (a data-parallel rank passes the all-reduced values
        and rank 0's scale, so every rank decides and steps alike)."""
        state = self.adapters[adapter]
        update = Update(lr_scale=scale)
        if total_tokens:
            update.grad_norm = float(torch.nn.utils.clip_grad_norm_(state.params, self.cfg.grad_clip))
            update.nonfinite = not (math.isfinite(loss_value) and math.isfinite(update.grad_norm))
            if update.nonfinite:
                state.skipped_nonfinite += 1
            else:
                with scaled_lr(state.optimizer, scale):
                    state.optimizer.step()
                state.version += 1
                update.updated = True
        state.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cpu":
            release_freed_memory()  # glibc keeps what the step freed, and steps grow past it (heap.py)
        return update

    # ---- checkpoint state
    def state_dict(self, adapter: str) -> dict[str, Any]:
        st = self.adapters[adapter]
        return {"optimizer": st.optimizer.state_dict(), "version": st.version,
                "skipped_nonfinite": st.skipped_nonfinite}

    def load_state_dict(self, adapter: str, state: dict[str, Any]) -> None:
        st = self.adapters[adapter]
        st.optimizer.load_state_dict(state["optimizer"])
        st.version = int(state["version"])
        st.skipped_nonfinite = int(state.get("skipped_nonfinite", 0))

    def close(self) -> None:
        """Nothing to release: the model goes with the process (a `ParallelLearner` ends its ranks)."""
