"""Packing a step's samples for the learner: prompt trees in token-budget micro-batches.

A GRPO group shares its prompt, so a row holds one prompt followed by all its completions, each
completion attending to the shared prompt and to itself only (the prompt is computed once).
Rows are packed longest first into micro-batches whose padded size (rows x longest) fits the
token budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..buffer import TrainSample


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
