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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from .buffer import TrainSample
from .config import LearnerConfig, LoraConfig, LossConfig
from .generator.types import AdapterVersion
from .generator.validate import peft_config_dict
from .loss import LossStats, policy_loss
from .placement import Placement


# ---------------------------------------------------------------- micro-batching


def plan_micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Pack sequence indices into micro-batches whose padded size (rows x longest) fits the budget.

    Longest first, greedy: sequences of similar length share a micro-batch, so padding stays
    small. A sequence longer than the budget gets a micro-batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        grown = max(longest, lengths[i])
        if current and grown * (len(current) + 1) > token_budget:
            batches.append(current)
            current, longest = [], 0
            grown = lengths[i]
        current.append(i)
        longest = grown
    if current:
        batches.append(current)
    return batches


@dataclass
class MicroBatch:
    """Rows of prompt trees: one prompt followed by all its completions, each completion
    attending to the shared prompt and to itself only (so a group's prompt is computed once)."""

    input_ids: torch.Tensor  # [B, T]
    position_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, 1, T, T] bool, True = may attend
    rows: torch.Tensor  # [N] row of the hidden state that predicts each completion token
    cols: torch.Tensor  # [N] its column
    targets: torch.Tensor  # [N] the completion tokens
    behaviour: torch.Tensor  # [N] vLLM's sampling logprobs
    advantages: torch.Tensor  # [N]
    stale: torch.Tensor  # [N] bool
    lag: torch.Tensor  # [N] policy lag of the sample each token belongs to
    lengths: list[int]  # completion length of each sample, in input order

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.shape[0] * self.input_ids.shape[1])


def prompt_units(samples: list[TrainSample]) -> list[list[int]]:
    """Indices of samples grouped by identical prompt (a GRPO group shares one prompt)."""
    units: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(samples):
        units.setdefault(tuple(s.prompt_ids), []).append(i)
    return list(units.values())


def unit_tokens(samples: list[TrainSample], unit: list[int]) -> int:
    return len(samples[unit[0]].prompt_ids) + sum(len(samples[i].completion_ids) for i in unit)


def plan_step(samples: list[TrainSample], token_budget: int) -> list[list[list[int]]]:
    """Micro-batches of rows of sample indices: one prompt unit per row, rows packed to the budget.

    A unit bigger than the budget is split into several rows that repeat the prompt.
    """
    rows: list[list[int]] = []
    for unit in prompt_units(samples):
        prompt_len = len(samples[unit[0]].prompt_ids)
        row: list[int] = []
        size = prompt_len
        for i in unit:
            extra = len(samples[i].completion_ids)
            if row and size + extra > token_budget:
                rows.append(row)
                row, size = [], prompt_len
            row.append(i)
            size += extra
        rows.append(row)
    lengths = [unit_tokens(samples, row) for row in rows]
    return [[rows[r] for r in batch] for batch in plan_micro_batches(lengths, token_budget)]


def build_micro_batch(samples: list[TrainSample], rows: list[list[int]], pad_id: int,
                      device: torch.device) -> MicroBatch:
    width = max(unit_tokens(samples, row) for row in rows)
    n_rows = len(rows)
    ids = torch.full((n_rows, width), pad_id, dtype=torch.long)
    pos = torch.zeros((n_rows, width), dtype=torch.long)
    branch = torch.full((n_rows, width), -2, dtype=torch.long)  # -1 prompt, k sample k, -2 pad
    pred_rows, pred_cols, behaviour, adv, stale, lag, lengths = [], [], [], [], [], [], []
    for r, row in enumerate(rows):
        prompt = samples[row[0]].prompt_ids
        p = len(prompt)
        ids[r, :p] = torch.tensor(prompt)
        pos[r, :p] = torch.arange(p)
        branch[r, :p] = -1
        start = p
        for k, i in enumerate(row):
            s = samples[i]
            c = len(s.completion_ids)
            ids[r, start : start + c] = torch.tensor(s.completion_ids)
            pos[r, start : start + c] = torch.arange(p, p + c)
            branch[r, start : start + c] = k
            # token j of this completion is predicted from token j-1 (the last prompt token for j=0)
            pred_rows.extend([r] * c)
            pred_cols.extend([p - 1, *range(start, start + c - 1)])
            behaviour.extend(s.logprobs)
            adv.extend([s.advantage] * c)
            stale.extend([s.stale] * c)
            lag.extend([s.policy_lag] * c)
            lengths.append(c)
            start += c
    index = torch.arange(width)
    causal = index[None, :, None] >= index[None, None, :]  # [1, q, k]
    bq, bk = branch[:, :, None], branch[:, None, :]
    same_tree = (bk == -1) | (bk == bq)
    real = (bq != -2) & (bk != -2)
    allowed = causal & same_tree & real
    allowed |= torch.eye(width, dtype=torch.bool)[None]  # padding rows attend to themselves (no NaN)
    flat_targets = torch.tensor([t for row in rows for i in row for t in samples[i].completion_ids])
    return MicroBatch(
        ids.to(device), pos.to(device), allowed[:, None].to(device),
        torch.tensor(pred_rows, device=device), torch.tensor(pred_cols, device=device),
        flat_targets.to(device),
        torch.tensor(behaviour, dtype=torch.float32, device=device),
        torch.tensor(adv, dtype=torch.float32, device=device),
        torch.tensor(stale, dtype=torch.bool, device=device),
        torch.tensor(lag, dtype=torch.long, device=device),
        lengths,
    )


# ---------------------------------------------------------------- logprobs


def _chunk_logprobs(hidden: torch.Tensor, targets: torch.Tensor, head_weight: torch.Tensor,
                    temperature: float) -> torch.Tensor:
    logits = (hidden @ head_weight.T).float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.log_softmax(-1).gather(1, targets[:, None]).squeeze(1)


def completion_logprobs(model: Any, mb: MicroBatch, temperature: float, chunk: int) -> torch.Tensor:
    """Logprob of every completion token ([N]); only those positions go through the LM head."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = causal_lm.model(
        input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids
    ).last_hidden_state
    picked = hidden[mb.rows, mb.cols]
    weight = causal_lm.get_output_embeddings().weight
    parts = []
    for h, t in zip(picked.split(chunk), mb.targets.split(chunk)):
        if torch.is_grad_enabled():
            # Recompute the chunk's logits in backward instead of keeping [chunk, vocab] fp32.
            parts.append(checkpoint(_chunk_logprobs, h, t, weight, temperature, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(h, t, weight, temperature))
    return torch.cat(parts) if parts else picked.new_zeros(0)


# ---------------------------------------------------------------- the learner


@dataclass
class StepStats:
    adapter: str
    version: int  # after the step
    updated: bool
    skipped_nonfinite: bool
    loss: float
    grad_norm: float
    samples: int
    tokens_trained: int
    padded_tokens: int
    micro_batches: int
    loss_stats: LossStats = field(default_factory=LossStats)
    seconds: float = 0.0


@dataclass
class _AdapterState:
    name: str
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    version: int = 0
    skipped_nonfinite: int = 0


DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


class Learner:
    """Holds the base once; one peft adapter + AdamW per adapter name. Runs on one thread."""

    def __init__(self, model_dir: Path, adapters: dict[str, tuple[LoraConfig, float]],
                 learner: LearnerConfig, loss: LossConfig, placement: Placement,
                 temperature: float | dict[str, float], seed: int) -> None:
        """`adapters`: name -> (LoRA shape, learning rate); `temperature`: the sampling
        temperature of the generator (per adapter in a fleet), so logprobs match vLLM's."""
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = learner
        self.loss_cfg = loss
        self.temperatures = (dict(temperature) if isinstance(temperature, dict)
                             else {name: float(temperature) for name in adapters})
        self.device = torch.device(placement.device)
        torch.manual_seed(seed)
        # sdpa takes the boolean 4-D prompt-tree masks built in `build_micro_batch` as they are.
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[learner.dtype],
                                                    attn_implementation="sdpa")
        base.to(self.device)
        if learner.gradient_checkpointing:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.model_dir = Path(model_dir)
        self.peft_configs: dict[str, Any] = {}
        self.adapters: dict[str, _AdapterState] = {}
        model = None
        for name, (lora, lr) in adapters.items():
            targets = lora.target_modules if isinstance(lora.target_modules, list) else "all-linear"
            cfg = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=targets,
                                 lora_dropout=lora.dropout, bias="none", task_type="CAUSAL_LM")
            if model is None:
                model = get_peft_model(base, cfg, adapter_name=name)
            else:
                model.add_adapter(name, cfg)
            self.peft_configs[name] = cfg
        assert model is not None, "a learner needs at least one adapter"
        self.model = model
        self.model.train(any(lora.dropout > 0 for lora, _ in adapters.values()))
        for name, (lora, lr) in adapters.items():
            params = [p for n, p in model.named_parameters() if f".{name}." in n and "lora_" in n]
            for p in params:
                p.requires_grad_(True)
                if p.dtype != torch.float32:  # train adapters in fp32 whatever the base dtype
                    p.data = p.data.float()
            opt = torch.optim.AdamW(params, lr=lr, weight_decay=learner.weight_decay)
            self.adapters[name] = _AdapterState(name, opt, params)
        self.model.set_adapter(next(iter(adapters)))

    # ---- versions
    def version(self, adapter: str) -> int:
        return self.adapters[adapter].version

    def adapter_tensors(self, adapter: str) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.model, adapter_name=adapter)
        return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}

    def adapter_version(self, adapter: str) -> AdapterVersion:
        return AdapterVersion(adapter, self.version(adapter), self.adapter_tensors(adapter),
                              self.peft_config(adapter))

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
        """Completion-token logprobs under `adapter` (None = the base, adapter switched off)."""
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

    def _trainable(self, samples: list[TrainSample]) -> list[TrainSample]:
        # Samples with zero advantage contribute no gradient (unless KL needs them): skip them.
        kl = self.loss_cfg.kl_coef > 0
        return [s for s in samples if s.completion_ids and (s.advantage != 0.0 or kl)]

    def micro_batches_needed(self, samples: list[TrainSample]) -> int:
        return len(plan_step(self._trainable(samples), self.cfg.token_budget))

    # ---- the training step
    def train_step(self, adapter: str, samples: list[TrainSample]) -> StepStats:
        started = time.perf_counter()
        state = self.adapters[adapter]
        strangers = {s.adapter for s in samples} - {adapter}
        if strangers:  # fleet isolation: one adapter's data never trains another
            raise ValueError(f"train_step({adapter!r}) got samples of {sorted(strangers)}")
        self.model.set_adapter(adapter)
        temperature = self.temperatures[adapter]
        kl_coef = self.loss_cfg.kl_coef
        trained = self._trainable(samples)
        total_tokens = sum(len(s.completion_ids) for s in trained)
        plan = plan_step(trained, self.cfg.token_budget)
        stats = LossStats()
        loss_total = 0.0
        padded = 0
        state.optimizer.zero_grad(set_to_none=True)
        for rows in plan:
            mb = build_micro_batch(trained, rows, self.pad_id, self.device)
            padded += mb.padded_tokens
            logp = completion_logprobs(self.model, mb, temperature, self.cfg.logprob_chunk)
            ref = None
            if kl_coef > 0:
                with torch.no_grad(), self.model.disable_adapter():
                    ref = completion_logprobs(self.model, mb, temperature, self.cfg.logprob_chunk)
            loss_sum, mb_stats = policy_loss(
                logp, mb.behaviour, mb.advantages, None, self.loss_cfg.type,
                clip_eps=self.loss_cfg.clip_eps, ratio_cap=self.loss_cfg.ratio_cap,
                kl_coef=kl_coef, ref_logp=ref, stale=mb.stale,
            )
            with torch.no_grad():
                on_policy = mb.lag == 0
                mb_stats.onpolicy_tokens = int(on_policy.sum())
                mb_stats.onpolicy_mismatch_sum = float((logp - mb.behaviour)[on_policy].abs().sum())
            (loss_sum / total_tokens).backward()
            loss_total += float(loss_sum.detach())
            stats.merge(mb_stats)
        loss_value = loss_total / total_tokens if total_tokens else 0.0
        grad_norm = 0.0
        updated = False
        nonfinite = False
        if total_tokens:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(state.params, self.cfg.grad_clip))
            nonfinite = not (math.isfinite(loss_value) and math.isfinite(grad_norm))
            if nonfinite:
                state.skipped_nonfinite += 1
            else:
                state.optimizer.step()
                state.version += 1
                updated = True
        state.optimizer.zero_grad(set_to_none=True)
        return StepStats(
            adapter=adapter, version=state.version, updated=updated, skipped_nonfinite=nonfinite,
            loss=loss_value, grad_norm=grad_norm, samples=len(samples), tokens_trained=total_tokens,
            padded_tokens=padded, micro_batches=len(plan), loss_stats=stats,
            seconds=time.perf_counter() - started,
        )

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
