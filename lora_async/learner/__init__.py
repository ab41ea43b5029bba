"""The learner: a frozen base with peft LoRA adapters, trained by importance-corrected PG.

| module | holds |
|---|---|
| `protocol.py` | `LearnerAPI`: what the orchestrator and checkpoints need of a learner (no torch import) |
| `learner.py` | `Learner`: the base once, one peft adapter and AdamW per adapter, the training step |
| `step.py` | a step's parts both learners build on: what its micro-batches add up to, its update, its stats |
| `parallel.py`, `ranks.py` | `ParallelLearner`: data-parallel ranks over `learner.devices` |
| `packing.py` | prompt trees and token-budget micro-batches |
| `logprobs.py` | chunked log-softmax over the vocabulary |
| `frozen_base.py` | loading the frozen base (or nf4/int8 with bitsandbytes) and the quantise probe |
| `served_base.py` | the generator's base for a quantised learner: the cache of its dequantised copies |
| `base_weights.py` | what such a copy holds: the weights the learner's quantised layers multiply by |
| `heap.py` | after a CPU step, glibc's freed heap handed back to the kernel |
| `probe.py` | the learner's speed per token on a placement, for an auto run |

Nothing here imports `generator/` or `orchestrator/`: what the learner hands over, an adapter
version (`lora_async.adapter_version`) and its base's recipe (`lora_async.base_recipe`), sits
below both.
"""

from .learner import Learner
from .step import Accumulated, StepStats, Update, step_stats

__all__ = ["Accumulated", "Learner", "StepStats", "Update", "step_stats"]
