"""Packing a step's samples for the learner: prompt trees in token-budget micro-batches.

A GRPO group shares its prompt, so a row holds one prompt followed by all its completions, each
completion attending to the shared prompt and to itself only (the prompt is computed once).
Rows are packed longest first into micro-batches whose padded size (rows x longest) fits the
token budget.

An episode's completion also holds environment, tool and template tokens: they are inputs (the
model reads them) but never targets, so only the tokens the model sampled reach the LM head,
the loss and the gradient.

Each target token carries its own lag and stale mark (a sample continued on a newer version
holds tokens of several versions; `buffer.py` marks those outside the staleness window).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..buffer import TrainSample

# Rows wider than this are split (each part repeats the prompt). Attention over a packed row is
# quadratic in its width, and the 4-D prompt-tree mask keeps CPU attention on the plain path: a
# guessing-game step (4 groups of 8 episodes of up to 8 turns, ~2,300 tokens per group row) grew
# the process past 13 GB and ran for minutes before this cap.
MAX_ROW_TOKENS = 1024


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
    rows: torch.Tensor  # [N] row of the hidden state that predicts each trained token
    cols: torch.Tensor  # [N] its column
    targets: torch.Tensor  # [N] the trained (model-sampled) completion tokens
    behaviour: torch.Tensor  # [N] vLLM's sampling logprob of each
    advantages: torch.Tensor  # [N]
    stale: torch.Tensor  # [N] bool: each token sampled outside the staleness window (its own lag's)
    lag: torch.Tensor  # [N] each token's own policy lag (its version's, not the sample's)
    lengths: list[int]  # trained tokens of each sample, in input order

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

    A unit wider than the budget (or MAX_ROW_TOKENS) is split into several rows that repeat the prompt.
    """
    width = min(token_budget, MAX_ROW_TOKENS)
    rows: list[list[int]] = []
    for unit in prompt_units(samples):
        prompt_len = len(samples[unit[0]].prompt_ids)
        row: list[int] = []
        size = prompt_len
        for i in unit:
            extra = len(samples[i].completion_ids)
            if row and size + extra > width:
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
    pred_rows: list[int] = []
    pred_cols: list[int] = []
    targets: list[int] = []
    behaviour: list[float] = []
    adv: list[float] = []
    stale: list[bool] = []
    lag: list[int] = []
    lengths: list[int] = []
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
            keep = [j for j, t in enumerate(s.token_trained()) if t]
            pred_rows.extend([r] * len(keep))
            pred_cols.extend(start + j - 1 if j else p - 1 for j in keep)
            targets.extend(s.completion_ids[j] for j in keep)
            behaviour.extend(s.logprobs[j] for j in keep)
            adv.extend([s.advantage] * len(keep))
            marks = s.token_stale()
            stale.extend(marks[j] for j in keep)
            lags = s.token_lags()
            lag.extend(lags[j] for j in keep)
            lengths.append(len(keep))
            start += c
    index = torch.arange(width)
    causal = index[None, :, None] >= index[None, None, :]  # [1, q, k]
    bq, bk = branch[:, :, None], branch[:, None, :]
    same_tree = (bk == -1) | (bk == bq)
    real = (bq != -2) & (bk != -2)
    allowed = causal & same_tree & real
    allowed |= torch.eye(width, dtype=torch.bool)[None]  # padding rows attend to themselves (no NaN)
    return MicroBatch(
        ids.to(device), pos.to(device), allowed[:, None].to(device),
        torch.tensor(pred_rows, dtype=torch.long, device=device),
        torch.tensor(pred_cols, dtype=torch.long, device=device),
        torch.tensor(targets, dtype=torch.long, device=device),
        torch.tensor(behaviour, dtype=torch.float32, device=device),
        torch.tensor(adv, dtype=torch.float32, device=device),
        torch.tensor(stale, dtype=torch.bool, device=device),
        torch.tensor(lag, dtype=torch.long, device=device),
        lengths,
    )
