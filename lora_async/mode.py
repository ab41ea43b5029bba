"""Sync or async, and at what staleness: the choice `buffer.mode = "auto"` makes, and why.

Asynchrony pays where a half would otherwise wait: on a tool, a reward or an environment (the
generator has nothing to compute while every episode in flight waits), or on a device of its
own (a learner GPU idle while the generator samples). On shared compute where nothing waits,
both halves do the same work on the same cores, and sync trains on fresher samples.

So an auto run decides in one of two ways:
- the learner has a device of its own (another GPU, or remote generators): async at once, at
  `buffer.max_staleness`;
- the two share compute: it measures both. The first `PROBE_STEPS` steps run synchronously on
  all the cores and measure a sync step (the learner's compute, the generator's compute, and the
  time the generator sat idle because everything in flight waited on a reward, tool or
  environment). `choose` predicts an async step from them and picks the staleness for a trial;
  the next `TRIAL_STEPS` steps run async (split cores), and `judge` keeps async only if it
  trained at least `ASYNC_MARGIN` times the samples per second that sync did (the first trial
  step, while the pipeline fills, is not counted). Otherwise the run goes back to sync.

The trial is what decides: the prediction cannot see what overlap changes besides the waits.
Measured on the sandbox environment (bench/RESULTS.md section 16), async kept 4x as many
requests in flight, and the CPU engine's throughput grows with its batch, so the generator's
compute per step shrank instead of growing as the model assumes.

The model of an async step (a pipeline: the learner trains step k while the generator makes
step k+1's groups, with up to `staleness + 1` steps' worth of groups in flight, so their waits
overlap each other and the learner), with the cores split between the halves:

    async step = max(learner on its share,  generator compute on its share,
                     (generator compute on its share + waits) / (staleness + 1))

and where they cannot be split (one GPU for both) their compute adds up, and only waits hide:

    async step = max(learner + generator compute,  (generator compute + waits) / (staleness + 1))

against the measured sync step (generator compute + waits + learner, one after the other).
Every decision is one `Choice`, with the figures and a reason in words: the start line, a
`mode` metrics event and `summary.json` show it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

PROBE_STEPS = 2  # sync steps an auto run measures before it decides (the first one includes warm-up)
TRIAL_STEPS = 3  # then async steps; the first is not counted (the pipeline fills)
TRIAL_SKIP = 1
# Split-core costs on a 2-core CPU (bench/RESULTS.md section 7): a learner step on one core took
# a median 29.2 s against 17.3 s on two (1.7x); the generator lost less (decoding scales
# sub-linearly with cores: 1.16x to 2x across the measured runs; 1.3 is their middle).
LEARNER_SPLIT_SLOWDOWN = 1.7
GENERATOR_SPLIT_SLOWDOWN = 1.3
# An async step trains on samples up to `staleness` versions old, so it learns a little less than
# a sync step: async must be clearly faster before it is kept on shared compute (in bench/RESULTS.md
# section 3 async made 1.55x the steps of sync on the demo and reached the target no sooner).
ASYNC_MARGIN = 1.2


class Mode(str, Enum):
    SYNC = "sync"
    ASYNC = "async"


@dataclass(frozen=True)
class SyncStep:
    """What a synchronous step on shared compute measured (seconds per step)."""

    step_s: float  # the step's wall-clock (generation, waits, learner, bookkeeping)
    learner_s: float  # the learner's compute
    gen_compute_s: float  # the engine's busy time
    wait_s: float  # the generator's idle time while everything in flight waited (reward, tool, env)

    @property
    def wait_share(self) -> float:
        return self.wait_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def other_s(self) -> float:
        """The rest of the step (bookkeeping, the hand-off, starting the next groups): an async
        step pays it too."""
        return max(0.0, self.step_s - self.learner_s - self.gen_compute_s - self.wait_s)

    @classmethod
    def of_rows(cls, rows: list[dict[str, Any]]) -> "SyncStep":
        """The mean of some step rows (`orchestrator.rows.step_row`)."""
        n = max(len(rows), 1)

        def mean(key: str) -> float:
            return sum(float(r.get(key) or 0.0) for r in rows) / n

        waits = mean("gen_idle_reward_s") + mean("gen_idle_tool_s") + mean("gen_idle_env_s")
        return cls(mean("step_s"), mean("learner_s"), mean("gen_compute_s"), waits)


@dataclass(frozen=True)
class Choice:
    """A run's mode: sync, or async at `staleness` (with the shared cores split between the two
    halves when `split`); `reason` says why in words."""

    mode: Mode
    staleness: int
    split: bool
    reason: str
    measured: SyncStep | None = None
    predicted_async_s: float | None = None
    decided_at_step: int = 0

    @property
    def synchronous(self) -> bool:
        return self.mode is Mode.SYNC

    def describe(self) -> str:
        if self.synchronous:
            return f"sync: {self.reason}"
        where = "generator and learner on their own cores" if self.split else "no core split"
        return f"async (max_staleness {self.staleness}; {where}): {self.reason}"

    def figures(self) -> dict[str, Any]:
        """For `summary.json` and the `mode` metrics event: flat `mode_*` keys."""
        out: dict[str, Any] = {"mode": self.mode.value, "mode_staleness": self.staleness, "mode_split": self.split,
                               "mode_reason": self.reason, "mode_decided_at_step": self.decided_at_step}
        if self.measured is not None:
            out.update({f"mode_sync_{k}": round(v, 3) for k, v in asdict(self.measured).items()})
        if self.predicted_async_s is not None:
            out["mode_predicted_async_step_s"] = round(self.predicted_async_s, 3)
        return out


def async_step_s(step: SyncStep, staleness: int, split: bool) -> float:
    """The predicted async step (the module docstring's model). `split`: each half computes on
    its own share of the cores; otherwise both compute on one device (one GPU, or cores that
    cannot be re-pinned), so their compute adds up and only the waits overlap."""
    if not split:
        return max(step.learner_s + step.gen_compute_s,
                   (step.gen_compute_s + step.wait_s) / (staleness + 1)) + step.other_s
    learner = step.learner_s * LEARNER_SPLIT_SLOWDOWN
    generator = step.gen_compute_s * GENERATOR_SPLIT_SLOWDOWN
    return max(learner, generator, (generator + step.wait_s) / (staleness + 1)) + step.other_s


def best_staleness(step: SyncStep, max_staleness: int, split: bool) -> tuple[int, float]:
    """The smallest staleness (1..max_staleness) whose predicted async step is the shortest, and that step."""
    options = [(async_step_s(step, s, split), s) for s in range(1, max_staleness + 1)]
    best = min(t for t, _ in options)
    return next((s, t) for t, s in options if t <= best * 1.001)


def choose(step: SyncStep, max_staleness: int, split: bool, at_step: int = 0) -> Choice:
    """Sync or async from a measured sync step on shared compute. Async takes the smallest
    staleness (at most `max_staleness`) that reaches its best predicted step, and only if that
    step is at least `ASYNC_MARGIN` times shorter than the sync step measured."""
    waits = f"waits {100 * step.wait_share:.0f}% of a sync step ({step.step_s:.1f}s)"
    if max_staleness < 1:
        return Choice(Mode.SYNC, 0, False, "buffer.max_staleness = 0", step, None, at_step)
    staleness, predicted = best_staleness(step, max_staleness, split)
    if predicted * ASYNC_MARGIN <= step.step_s:
        return Choice(Mode.ASYNC, staleness, split,
                      f"{waits}; predicted async step {predicted:.1f}s, {step.step_s / predicted:.2f}x shorter",
                      step, predicted, at_step)
    return Choice(Mode.SYNC, 0, False,
                  f"{waits}; predicted async step {predicted:.1f}s is not {ASYNC_MARGIN:g}x shorter than sync's "
                  f"{step.step_s:.1f}", step, predicted, at_step)


def initial_choice(mode: str, max_staleness: int, shared: bool, split: bool) -> Choice | None:
    """The choice before any step: what the config pins (`buffer.mode` sync or async, or
    max_staleness 0), async where the learner does not share compute with the generator
    (`shared` False), or None: an auto run on shared compute measures first. `split`: a pinned
    async run's placement gave each half its own cores."""
    if mode == "sync" or max_staleness == 0:
        return Choice(Mode.SYNC, 0, False, "pinned by buffer.mode" if mode == "sync" else "buffer.max_staleness = 0")
    if mode == "async":
        return Choice(Mode.ASYNC, max_staleness, split, "pinned by buffer.mode")
    if not shared:
        return Choice(Mode.ASYNC, max_staleness, False, "the learner has a device of its own (nothing is shared)")
    return None


def probing(max_staleness: int) -> str:
    """What an auto run on shared compute says before it has decided."""
    return (f"auto: the first {PROBE_STEPS} steps run sync on shared compute, the next {TRIAL_STEPS} async (at "
            f"max_staleness <= {max_staleness}); then it keeps the one that trained more samples per second")


def trained_rate(rows: list[dict[str, Any]]) -> float:
    """Samples trained per second over some step rows (flat groups skipped count as time spent)."""
    seconds = sum(float(r.get("step_s") or 0.0) for r in rows)
    return sum(int(r.get("samples") or 0) for r in rows) / seconds if seconds > 0 else 0.0


def trial(step: SyncStep, max_staleness: int, split: bool, at_step: int = 0) -> Choice:
    """The async trial after the sync probe: at the staleness `choose` would take (at least 1)."""
    staleness, predicted = best_staleness(step, max_staleness, split)
    waits = f"waits {100 * step.wait_share:.0f}% of a sync step ({step.step_s:.1f}s)"
    return Choice(Mode.ASYNC, staleness, split, f"trial of {TRIAL_STEPS} async steps; {waits}", step, predicted,
                  at_step)


def judge(sync_rows: list[dict[str, Any]], async_rows: list[dict[str, Any]], tried: Choice,
          at_step: int) -> Choice:
    """Keep the trial's async if it trained `ASYNC_MARGIN` times sync's samples per second."""
    sync_rate, async_rate = trained_rate(sync_rows), trained_rate(async_rows)
    ratio = async_rate / sync_rate if sync_rate > 0 else float("inf") if async_rate > 0 else 0.0
    measured = (f"async trained {async_rate:.2f} samples/s against sync's {sync_rate:.2f} ({ratio:.2f}x); "
                f"sync's step waited {100 * tried.measured.wait_share:.0f}%" if tried.measured else "")
    if ratio >= ASYNC_MARGIN:
        return Choice(Mode.ASYNC, tried.staleness, tried.split, measured, tried.measured, tried.predicted_async_s,
                      at_step)
    return Choice(Mode.SYNC, 0, False, f"{measured}: not {ASYNC_MARGIN:g}x", tried.measured,
                  tried.predicted_async_s, at_step)
