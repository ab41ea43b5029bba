"""Token-budget micro-batching and the prompt-tree packing of the learner."""

import torch

from lora_async.buffer import TrainSample
from lora_async.learner.packing import build_micro_batch, plan_micro_batches, plan_step


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


def test_packed_prompt_tree_logprobs_equal_an_unpacked_forward(tiny_model):
    """Prompt trees packed into budget-bound micro-batches (shared prompts, split rows, padding)
    give the logprobs of one plain causal forward per sample, to 1e-5 (fp32, random LoRA)."""
    from lora_async.config import LearnerConfig, LoraConfig, default_loss
    from lora_async.learner import Learner
    from lora_async.placement import Placement

    learner = Learner(tiny_model, {"main": (LoraConfig(rank=8), 1e-3)},
                      LearnerConfig(dtype="float32", token_budget=32), default_loss(), Placement("cpu", None), 0.7, 0)
    rng = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(v.shape, generator=rng) * 0.05 for k, v in learner.adapter_tensors("main").items()}
    learner.load_adapter_tensors("main", tensors)
    a, b, c = [1, 510, 2114, 314, 260, 1372], [1, 22, 3320, 4217, 3106, 17, 28, 39], [1, 900, 901]
    samples = [sample(a, [44, 55, 66]), sample(b, [77]), sample(a, [88, 99, 111, 122, 133, 144]),
               sample(b, [155, 166]), sample(a, list(range(200, 210))), sample(c, list(range(400, 410))),
               sample(a, list(range(300, 310)))]
    plan = plan_step(samples, 32)
    rows = [row for mb in plan for row in mb]
    assert len(plan) > 1 and any(len(mb) > 1 for mb in plan)  # several micro-batches, padded rows
    assert sum(0 in row or 2 in row or 4 in row or 6 in row for row in rows) > 1  # group a is split
    for adapter, temperature in (("main", 0.7), (None, 1.0)):
        packed = learner.logprobs(adapter, samples)
        for s, got in zip(samples, packed):
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            with torch.no_grad():
                if adapter is None:
                    with learner.model.disable_adapter():
                        logits = learner.model(input_ids=ids).logits[0]
                else:
                    learner.model.set_adapter(adapter)
                    logits = learner.model(input_ids=ids).logits[0]
            start = len(s.prompt_ids) - 1
            want = (logits.float() / temperature).log_softmax(-1)[start:-1].gather(
                1, torch.tensor(s.completion_ids)[:, None]).squeeze(1)
            # fp32 logprobs of ~-18 differ by a few ulps when packing reorders the sums (1.1e-5
            # seen); a wrong position, mask or prompt shows as differences of order 1
            torch.testing.assert_close(torch.tensor(got), want, rtol=2e-6, atol=1e-5)
