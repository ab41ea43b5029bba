"""Token-budget micro-batching and the prompt-tree packing of the learner."""

import torch

from lora_async.buffer import TrainSample
from lora_async.learner import build_micro_batch, plan_micro_batches, plan_step
from lora_async.loop import may_start


def test_plan_respects_the_budget_and_packs_many_per_batch():
    lengths = [10, 50, 12, 48, 30, 31, 5, 7]
    plan = plan_micro_batches(lengths, token_budget=100)
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
    for batch in plan:
        assert max(lengths[i] for i in batch) * len(batch) <= 100
    assert len(plan) < len(lengths)  # never one sequence per micro-batch when more fit
    assert max(len(b) for b in plan) >= 3


def test_oversized_sequence_gets_its_own_micro_batch():
    plan = plan_micro_batches([500, 10, 10], token_budget=100)
    assert [0] in plan and sorted(i for b in plan for i in b) == [0, 1, 2]


def sample(prompt, completion, adv=1.0):
    return TrainSample("a", 0, prompt, completion, [-1.0] * len(completion), 1.0, adv)


def test_groups_share_their_prompt_in_one_row():
    samples = [sample([1, 2, 3], [10, 11]), sample([1, 2, 3], [12]), sample([4, 5], [13, 14, 15])]
    plan = plan_step(samples, token_budget=1000)
    rows = [row for mb in plan for row in mb]
    assert sorted(map(sorted, rows)) == [[0, 1], [2]]
    mb = build_micro_batch(samples, plan[0], pad_id=0, device=torch.device("cpu"))
    row = next(r for r, members in enumerate(plan[0]) if 0 in members)
    ids = mb.input_ids[row].tolist()
    assert ids[:6] == [1, 2, 3, 10, 11, 12]  # prompt once, then both completions
    pos = mb.position_ids[row].tolist()
    assert pos[:6] == [0, 1, 2, 3, 4, 3]  # the second completion restarts after the prompt
    mask = mb.attention_mask[row, 0]
    assert bool(mask[5, 2]) and not bool(mask[5, 3]) and not bool(mask[5, 4])  # sees prompt, not sibling
    assert bool(mask[4, 3]) and not bool(mask[3, 4])  # causal inside a completion
    assert mb.padded_tokens == len(plan[0]) * mb.input_ids.shape[1]
    assert mb.targets.numel() == sum(len(s.completion_ids) for s in samples if any(
        samples.index(s) in r for r in plan[0]))


def test_a_unit_bigger_than_the_budget_is_split():
    samples = [sample([1] * 10, [2] * 10) for _ in range(5)]
    rows = [row for mb in plan_step(samples, token_budget=35) for row in mb]
    assert sorted(i for r in rows for i in r) == list(range(5))
    assert all(10 + 10 * len(r) <= 35 for r in rows)


def test_admission_rule():
    # synchronous training: producers only while the learner waits for a batch
    assert may_start(False, 0, 8, 0) and may_start(False, 7, 8, 0)
    assert not may_start(False, 8, 8, 0) and not may_start(True, 0, 8, 0)
    # one step of staleness: one batch ahead while training, two while waiting
    assert may_start(True, 7, 8, 1) and not may_start(True, 8, 8, 1)
    assert may_start(False, 15, 8, 1) and not may_start(False, 16, 8, 1)
