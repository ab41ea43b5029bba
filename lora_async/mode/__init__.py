"""Sync or async, and at what staleness: the choice `buffer.mode = "auto"` makes, and why.

Asynchrony pays where a half would otherwise wait (a tool, a reward, an environment, a device
of its own), and on a CPU engine also through batching: async keeps more requests in flight,
and the engine's throughput grows with its batch. It costs twice: on shared cores each half
computes on a share of them, and a sample k versions old teaches less (`lag_cost.py`).

Where the learner has a device of its own (another GPU, remote generators), an auto run is
async from the start. Where the two halves share compute, it decides from what it measures:
1. **the engine and the learner, in seconds** (`EngineCurve`, at start-up): decode throughput at
   a few batch sizes on every core, and on the generator's share where an async run would split
   them, and the learner's speed per token on every core and on its share (`learner/probe.py`);
2. **the first `OPEN_STEPS` steps, run async** at `OPEN_STALENESS` (`opening_choice`): the
   first fills the pipeline; from the second's time split (`StepFigures`) follows the sync
   step it implies (`implied_sync`: the learner on every core, the generation on every core
   at a k + 1-th of the async batch, the waits async could not hide or a median call of each
   kind, the longer). Async that reaches the target `MARGIN` times sooner than that, after
   lag's cost, stays, at the staleness the model's ratios favour (`decide_opened`); the sync
   step it would first have run to measure cost every run one slow step on tasks solved in
   4-7;
3. otherwise **sync steps measure** (`StepFigures`: the learner's compute, the generator's
   compute, the waits on rewards, tools and environments, the engine's batch), and **a
   prediction for each staleness k in {0, 1, 2, 4}** (up to `buffer.max_staleness`;
   `Model.step_s`), each weighed by k's steps-to-target ratio r(k), picks the one with the
   least predicted time to target (`step x r(k)`; `decide`), async only if `MARGIN` times
   better than sync;
4. **the first async steps confirm it** (`Model.confirmed`; after the opening, its async steps
   already did, before the sync steps measured): the one that fills the pipeline
   and re-pins the threads, and the one after. The learner's cost per token and the engine's
   rate on their shares, each the better of the two steps (the first learner step at a new
   thread count and the fill's burst of prompts measured 1.5-2.5x a steady step), replace the
   assumed ones, and the choice is made again on the corrected model. It falls back to sync
   there only if sync is then predicted sooner (no margin: staying costs nothing, switching
   back a step).
Then it keeps checking: a step `OFF_BY` away from its prediction, per sample drawn
(`scaled_step_s`: a task being solved draws more groups per step), `OFF_STEPS` times in a row
(a tool got slower, generations got longer) makes it decide again: from the last sync steps
if it is sync. If it is async, the steps keep async where they still beat the sync step they
imply, as the opening's did (`async_beats_implied`), and the mark moves to them; only
otherwise do `REMEASURE_STEPS` sync steps measure.

The model of an async step at staleness k, with the shared cores split between the halves
(the learner trains step n while the generator makes step n+1's groups, up to k + 1 steps'
worth of groups in flight, whose waits overlap each other and the learner):

    gen(k)   = sync's generator compute x useful share x rate(sync batch) / rate_share(batch x (k+1))
    async(k) = max(learner x learner share cost, gen(k), (gen(k) + waits) / (k + 1)) + other

where the halves cannot be split (one GPU for both) their compute adds up and only waits hide:

    async(k) = max(learner + gen(k), (gen(k) + waits) / (k + 1)) + other

"useful share" is the part of sync's generator compute that went to groups it trained: sync
aborts the groups still generating when a step starts, async keeps them.
"""

from __future__ import annotations

from .decide import (CANDIDATES, MARGIN, OFF_BY, OFF_STEPS, OPEN_STALENESS, OPEN_STEPS, REMEASURE_STEPS, Choice, Mode,
                     async_beats_implied, async_still_sooner, candidates, decide, decide_opened, implied_by,
                     initial_choice, off_prediction, opening_choice, scaled_step_s)
from .measured import EngineCurve, StepFigures, StepRecord
from .predict import LEARNER_SPLIT_SLOWDOWN, Model, Prediction, implied_sync, predict

__all__ = ["CANDIDATES", "LEARNER_SPLIT_SLOWDOWN", "MARGIN", "OFF_BY", "OFF_STEPS", "OPEN_STALENESS", "OPEN_STEPS",
           "REMEASURE_STEPS", "Choice", "EngineCurve", "Mode", "Model", "Prediction", "StepFigures", "StepRecord",
           "async_beats_implied", "async_still_sooner", "candidates", "decide", "decide_opened", "implied_by",
           "implied_sync", "initial_choice", "off_prediction", "opening_choice", "predict", "scaled_step_s"]
