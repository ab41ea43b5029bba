"""The ranks of a data-parallel learner (`parallel.py`): what every rank builds and runs.

Rank 0 is `ParallelLearner` in the orchestrator's process; ranks 1..N-1 run `rank_main` in
spawned processes and answer rank 0's commands over a pipe (a step, loads, their weights). The
collectives here run on every rank in the same order, in a process group of our own.
"""

from __future__ import annotations

import contextlib
import io
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..buffer import TrainSample
from ..config import LearnerConfig, LoraConfig, LossConfig
from ..placement import Placement, pin_current_thread
from ..process_groups import broadcast, make_group, make_store
from .learner import Learner
from .step import Update

if TYPE_CHECKING:
    import torch.distributed as dist

HOST = "127.0.0.1"  # every rank runs on this machine


@dataclass(frozen=True)
class LearnerArgs:
    """What every rank builds its `Learner` from (pickled to the spawned ranks)."""

    model_dir: Path
    adapters: dict[str, tuple[LoraConfig, float]]
    learner: LearnerConfig
    loss: LossConfig
    temperature: float | dict[str, float]
    seed: int
    quantization: str

    def build(self, placement: Placement) -> Learner:
        return Learner(self.model_dir, self.adapters, self.learner, self.loss, placement, self.temperature,
                       self.seed, self.quantization)


@dataclass(frozen=True)
class Rendezvous:
    """Where a rank finds the others: rank 0's TCP store and the group's shape."""

    port: int
    rank: int
    world: int
    backend: str  # "gloo" or "nccl"
    timeout_s: float

    def join(self, store: dist.TCPStore | None = None) -> Any:
        """This rank's member of the group (rank 0 passes its master store; the others connect)."""
        if store is None:
            store = make_store(HOST, self.port, self.world, False, self.timeout_s)
        return make_group(store, self.rank, self.world, self.backend, self.timeout_s)


# ---- the collectives (every rank runs these, in the same order)

def _split(flat: torch.Tensor, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [piece.view_as(p) for piece, p in zip(flat.split([p.numel() for p in params]), params)]


def broadcast_weights(group: Any, learner: Learner) -> None:
    """Rank 0's adapter weights onto every rank, one flat buffer per adapter."""
    for state in learner.adapters.values():
        flat = torch.cat([p.detach().reshape(-1) for p in state.params])
        broadcast(group, flat)
        with torch.no_grad():
            for p, piece in zip(state.params, _split(flat, state.params)):
                p.copy_(piece)


def all_reduce_step(group: Any, params: list[torch.nn.Parameter], loss_sum: float) -> float:
    """Sum every rank's LoRA gradients and loss in one flat all-reduce; each gradient becomes a
    view of the sum (a rank without micro-batches contributes zeros). Returns the summed loss."""
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    loss = torch.tensor([loss_sum], dtype=grads[0].dtype, device=grads[0].device)
    flat = torch.cat([g.reshape(-1) for g in grads] + [loss])
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
    group.allreduce([flat], options).wait()
    for p, grad in zip(params, _split(flat[:-1], params)):
        p.grad = grad
    return float(flat[-1])


def dumps(value: Any) -> bytes:
    """Tensors as bytes for a pipe (pickled tensors would go through shared-memory handles)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def loads(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)


# ---- ranks 1..N-1

class WorkerRank:
    """A worker rank: runs rank 0's commands on its learner until told to close."""

    def __init__(self, learner: Learner, group: Any, conn: Connection) -> None:
        self.learner, self.group, self.conn = learner, group, conn

    def serve(self) -> None:
        handlers: dict[str, Callable[..., Any]] = {"step": self.step, "load": self.load, "state": self.state,
                                                   "tensors": self.tensors}
        while True:
            kind, args = self.conn.recv()
            if kind == "close":
                return
            self.conn.send(("ok", handlers[kind](*args)))

    def step(self, adapter: str, samples: list[TrainSample], plan: list[list[list[int]]],
             total_tokens: int) -> tuple[Update, int]:
        learner = self.learner
        learner.begin_step(adapter, samples)
        part = learner.accumulate(adapter, samples, plan, total_tokens, lambda: self.conn.send(("progress", None)))
        self.conn.send(("ready", part))
        # rank 0's go: every rank is ready, so the all-reduce starts together; with the step's
        # learning-rate factor, which rank 0 computed from every rank's sequences
        _, (scale,) = self.conn.recv()
        loss_sum = all_reduce_step(self.group, learner.adapters[adapter].params, part.loss_sum)
        update = learner.apply_update(adapter, loss_sum / total_tokens, total_tokens, scale)
        return update, learner.version(adapter)

    def load(self, adapter: str, blob: bytes) -> None:
        self.learner.load_adapter_tensors(adapter, loads(blob))

    def state(self, adapter: str, blob: bytes) -> None:
        self.learner.load_state_dict(adapter, loads(blob))

    def tensors(self, adapter: str) -> bytes:
        return dumps(self.learner.adapter_tensors(adapter))


def rank_main(args: LearnerArgs, placement: Placement, rendezvous: Rendezvous, conn: Connection) -> None:
    """Entry point of a spawned rank (spawn: a fresh interpreter, no CUDA or OpenMP state inherited)."""
    # Ctrl-C reaches the whole process group; rank 0 decides when the run stops, and ends us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        pin_current_thread(placement)  # this process's cores (and thread count) or its GPU
        learner = args.build(placement)
        conn.send(("loaded", None))
        group = rendezvous.join()
        broadcast_weights(group, learner)
        WorkerRank(learner, group, conn).serve()
    except EOFError:  # rank 0 is gone
        return
    except BaseException as exc:
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(exc).__name__}: {exc}".splitlines()[0]))
        raise SystemExit(1) from None


__all__ = ["HOST", "LearnerArgs", "Rendezvous", "WorkerRank", "all_reduce_step", "broadcast_weights", "dumps", "loads",
           "rank_main"]
