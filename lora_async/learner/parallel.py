"""A data-parallel learner (`learner.devices`): N ranks of the same `Learner`, LoRA gradients summed.

Rank 0 is a plain `Learner` in this process, on the learner thread where the orchestrator calls
it; it plans every step, publishes, answers logprobs and is the checkpoint. Ranks 1..N-1 are
spawned processes that build the same `Learner` (same seed, and rank 0's adapters broadcast at
start, so the weights are identical for sure) on their own GPU or their share of the cores, and
join a gloo (CPU) or NCCL (CUDA) process group of our own: vLLM's in-process engine owns torch's
default group.

A step: rank 0 packs the step's micro-batches as `Learner.train_step` would, hands whole
micro-batches to the ranks (balancing padded tokens) over each rank's pipe, and every rank runs
its share with each loss divided by the step's total trained tokens. One flat all-reduce then
sums the adapter's LoRA gradients and the loss, and every rank clips and steps on the same sums,
so the weights stay identical and the non-finite check agrees everywhere.

Why not torch DDP: the ranks get different numbers of micro-batches in a step (a step may have
fewer micro-batches than ranks), and gradient accumulation over uneven counts hangs DDP unless
every step is wrapped in `join`; DDP would also bucket every parameter that requires grad,
while only the active adapter's LoRA tensors (a few MB) need to move, once per step.

Faults: rank 0 never blocks on a rank without a bound. A rank that dies ends its pipe at once;
one that sends nothing for `RankTimeouts.silence_s` (workers report each micro-batch) is taken
as hung. Either way every rank is stopped and a one-line `TrainingError` names the rank.
What ranks 1..N-1 run, and the collectives, are in `ranks.py`.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, NoReturn

import torch

from ..adapter_version import AdapterVersion
from ..buffer import TrainSample
from ..config import LearnerConfig, LoraConfig, LossConfig
from ..placement import Placement
from ..process_groups import make_store
from .packing import plan_step, unit_tokens
from .ranks import HOST, LearnerArgs, Rendezvous, all_reduce_step, broadcast_weights, dumps, loads, rank_main
from .step import Accumulated, StepStats, lr_scale, step_stats

POLL_S = 0.2  # how often rank 0 checks that a rank it waits for is still alive
CLOSE_S = 10.0  # a rank asked to close exits at once; one that does not is killed after this


@dataclass(frozen=True)
class RankTimeouts:
    """How long rank 0 waits for a live rank before it calls it hung (a dead one is seen at once)."""

    start_s: float = 900.0  # a rank loads the base as rank 0 does: a large model from a cold disk takes minutes
    silence_s: float = 300.0  # between two messages of a working rank: one micro-batch, a load, a reply
    collective_s: float = 120.0  # one all-reduce or broadcast: ranks enter together, after rank 0's go


# ---- splitting a step

def assign_micro_batches(samples: list[TrainSample], plan: list[list[list[int]]], world: int) -> list[list[int]]:
    """Micro-batch indices per rank: largest first to the least loaded rank (padded tokens are
    the work), ties to the lowest rank, so rank 0 is never idle while another rank works."""
    padded = [len(rows) * max(unit_tokens(samples, row) for row in rows) for rows in plan]
    work = [0] * world
    shares: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(plan)), key=lambda i: -padded[i]):
        rank = min(range(world), key=lambda r: work[r])
        shares[rank].append(i)
        work[rank] += padded[i]
    return [sorted(share) for share in shares]


def subset(samples: list[TrainSample], plan: list[list[list[int]]]) -> tuple[list[TrainSample], list[list[list[int]]]]:
    """Only the samples `plan` uses, renumbered: what a rank is sent (its micro-batches unchanged)."""
    used = sorted({i for rows in plan for row in rows for i in row})
    index = {old: new for new, old in enumerate(used)}
    return [samples[i] for i in used], [[[index[i] for i in row] for row in rows] for rows in plan]


@dataclass
class _Handle:
    rank: int
    process: BaseProcess
    conn: Connection

    @property
    def name(self) -> str:
        return f"learner rank {self.rank} (pid {self.process.pid})"

    def death(self) -> str:
        self.process.join(1.0)  # its pipe ends a moment before its exit code is known
        code = self.process.exitcode
        how = ("no exit code yet" if code is None else
               f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}")
        return f"{self.name} died ({how})"


# ---- rank 0

class ParallelLearner:
    """The `Learner` API over N data-parallel ranks; rank 0 (this process) holds the truth."""

    def __init__(self, model_dir: Path, adapters: dict[str, tuple[LoraConfig, float]], learner: LearnerConfig,
                 loss: LossConfig, placements: list[Placement], temperature: float | dict[str, float], seed: int,
                 quantization: str = "none", timeouts: RankTimeouts = RankTimeouts()) -> None:
        """`placements`: one per rank, rank 0's first (the calling thread is already pinned to it)."""
        if len(placements) < 2:
            raise ValueError("a data-parallel learner needs at least two ranks (use Learner for one)")
        self.world, self.timeouts = len(placements), timeouts
        self.broken: str | None = None
        self.ranks: list[_Handle] = []
        args = LearnerArgs(Path(model_dir), adapters, learner, loss, temperature, seed, quantization)
        backend = "gloo" if placements[0].device == "cpu" else "nccl"
        store = make_store(HOST, 0, self.world, True, timeouts.collective_s)
        context = multiprocessing.get_context("spawn")
        try:
            for rank in range(1, self.world):  # the ranks load while rank 0 does
                parent, child = context.Pipe()
                meeting = Rendezvous(store.port, rank, self.world, backend, timeouts.collective_s)
                process = context.Process(target=rank_main, args=(args, placements[rank], meeting, child),
                                          name=f"lora-async-rank{rank}", daemon=True)
                process.start()
                child.close()  # only the rank holds its end, so its death ends the pipe
                self.ranks.append(_Handle(rank, process, parent))
            self.local = args.build(placements[0])
            for handle in self.ranks:
                self._expect(handle, "loaded", timeouts.start_s)
            self.group = Rendezvous(store.port, 0, self.world, backend, timeouts.collective_s).join(store)
            broadcast_weights(self.group, self.local)
        except BaseException:
            self._stop_ranks(polite=False)
            raise
        self.store = store  # the group's rendezvous lives as long as the group
        self.adapters = self.local.adapters

    # ---- rank 0 alone: versions, tensors, logprobs, checkpoint state
    def version(self, adapter: str) -> int:
        return self.local.version(adapter)

    def adapter_tensors(self, adapter: str) -> dict[str, torch.Tensor]:
        return self.local.adapter_tensors(adapter)

    def adapter_version(self, adapter: str) -> AdapterVersion:
        return self.local.adapter_version(adapter)

    def peft_config(self, adapter: str) -> dict:
        return self.local.peft_config(adapter)

    def fits(self, samples: list[TrainSample]) -> bool:
        return self.local.fits(samples)

    def logprobs(self, adapter: str | None, samples: list[TrainSample]) -> list[list[float]]:
        return self.local.logprobs(adapter, samples)

    def snapshot_logprobs(self, version: AdapterVersion, samples: list[TrainSample]) -> list[list[float]]:
        return self.local.snapshot_logprobs(version, samples)

    def state_dict(self, adapter: str) -> dict[str, Any]:
        return self.local.state_dict(adapter)

    # ---- every rank: loads (resume with any number of ranks), and the step
    def load_adapter_tensors(self, adapter: str, tensors: dict[str, torch.Tensor]) -> None:
        self.local.load_adapter_tensors(adapter, tensors)
        self._everywhere("load", adapter, dumps(tensors))

    def load_state_dict(self, adapter: str, state: dict[str, Any]) -> None:
        self.local.load_state_dict(adapter, state)
        self._everywhere("state", adapter, dumps(state))

    def rank_adapter_tensors(self, rank: int, adapter: str) -> dict[str, torch.Tensor]:
        """`adapter`'s weights as rank `rank` holds them (they should equal rank 0's)."""
        if rank == 0:
            return self.local.adapter_tensors(adapter)
        self._check_usable()
        handle = self.ranks[rank - 1]
        self._send(handle, "tensors", adapter)
        return loads(self._expect(handle, "ok", self.timeouts.silence_s))

    def train_step(self, adapter: str, samples: list[TrainSample]) -> StepStats:
        started, cpu_started = time.perf_counter(), time.process_time()
        self._check_usable()
        local = self.local
        trained = local.trainable(samples)
        total_tokens = sum(s.trained_tokens for s in trained)
        if not total_tokens:  # nothing trains: no rank has work and nothing is summed
            return local.train_step(adapter, samples)
        local.begin_step(adapter, samples)
        plan = plan_step(trained, local.cfg.token_budget)
        shares = assign_micro_batches(trained, plan, self.world)
        for handle, share in zip(self.ranks, shares[1:]):
            self._send(handle, "step", adapter, *subset(trained, [plan[i] for i in share]), total_tokens)
        mine = local.accumulate(adapter, trained, [plan[i] for i in shares[0]], total_tokens)
        part = Accumulated()
        part.merge(mine)
        for handle in self.ranks:
            part.merge(self._expect(handle, "ready", self.timeouts.silence_s))
        scale = lr_scale(local.cfg.lr_scale, part.stats)  # from every rank's sequences, so one for all
        for handle in self.ranks:
            self._send(handle, "reduce", scale)
        try:
            loss_sum = all_reduce_step(self.group, local.adapters[adapter].params, mine.loss_sum)
        except RuntimeError as exc:  # a rank died inside it, or it timed out
            dead = [h.death() for h in self.ranks if not h.process.is_alive()]
            self._fail("; ".join(dead) or f"the gradient all-reduce failed: {str(exc).splitlines()[0]}")
        update = local.apply_update(adapter, loss_sum / total_tokens, total_tokens, scale)
        for handle in self.ranks:
            theirs, version = self._expect(handle, "ok", self.timeouts.silence_s)
            if version != local.version(adapter) or theirs.updated != update.updated:
                self._fail(f"{handle.name} diverged: version {version} vs rank 0's {local.version(adapter)}")
        return step_stats(adapter, local.version(adapter), samples, total_tokens, len(plan), part, update, started, cpu_started)

    def close(self) -> None:
        """End the other ranks (asked first; a hung or stopped one is killed). Rank 0's state stays."""
        self._stop_ranks(polite=self.broken is None)
        self.broken = self.broken or "the learner was closed"

    # ---- talking to the ranks
    def _everywhere(self, kind: str, *args: Any) -> None:
        self._check_usable()
        for handle in self.ranks:
            self._send(handle, kind, *args)
        for handle in self.ranks:
            self._expect(handle, "ok", self.timeouts.silence_s)

    def _send(self, handle: _Handle, kind: str, *args: Any) -> None:
        try:
            handle.conn.send((kind, args))
        except OSError:
            self._fail(handle.death())

    def _expect(self, handle: _Handle, kind: str, timeout_s: float) -> Any:
        """The payload of `handle`'s next `kind` message. Progress messages restart the clock; a
        rank that dies, fails or stays silent for `timeout_s` ends the learner."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                message = handle.conn.recv() if handle.conn.poll(POLL_S) else None
            except (EOFError, OSError):
                self._fail(handle.death())
            if message is None:
                if not handle.process.is_alive():
                    self._fail(handle.death())
                if time.monotonic() > deadline:
                    self._fail(f"{handle.name} sent nothing for {timeout_s:.0f} s while rank 0 waited "
                               f"for {kind!r}; taken as hung")
                continue
            got, payload = message
            if got == "progress":
                deadline = time.monotonic() + timeout_s
            elif got == "error":
                self._fail(f"{handle.name} failed: {payload}")
            elif got != kind:
                self._fail(f"{handle.name} answered {got!r} where rank 0 expected {kind!r}")
            else:
                return payload

    def _check_usable(self) -> None:
        if self.broken is not None:
            self._raise(f"the data-parallel learner cannot continue: {self.broken}")
        for handle in self.ranks:
            if not handle.process.is_alive():
                self._fail(handle.death())

    def _fail(self, message: str) -> NoReturn:
        self.broken = message
        self._stop_ranks(polite=False)
        self._raise(message)

    @staticmethod
    def _raise(message: str) -> NoReturn:
        from ..errors import TrainingError  # the CLI reports it in one line

        raise TrainingError(message)

    def _stop_ranks(self, polite: bool) -> None:
        if polite:
            for handle in self.ranks:
                with contextlib.suppress(OSError):
                    handle.conn.send(("close", ()))
        deadline = time.monotonic() + (CLOSE_S if polite else 0.0)
        for handle in self.ranks:
            handle.process.join(max(0.0, deadline - time.monotonic()))
            if handle.process.is_alive():
                handle.process.kill()  # SIGKILL: also ends a stopped (SIGSTOP) or hung rank
                handle.process.join(CLOSE_S)
            handle.conn.close()
        self.ranks = []


__all__ = ["ParallelLearner", "RankTimeouts", "assign_micro_batches", "subset"]
