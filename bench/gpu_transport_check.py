"""The GPU half of the transports, torch only (the GPU machine has no vLLM).

A sender process packs an r=8 all-linear adapter of SmolLM2-135M's shapes on cuda:0 and hands
it to a receiver process on the same host by (a) a CUDA IPC handle (receiver on cuda:0) and (b)
an NCCL broadcast over a dedicated process group (receiver on cuda:1; skipped on one GPU, where
NCCL refuses two ranks), both through the same code the vLLM worker extension calls
(`lora_async.handoff.receive`). The receiver checks every tensor bit for bit and reports timings.

    python bench/gpu_transport_check.py [--only cuda-ipc|nccl]   # one JSON line per transport
"""

from __future__ import annotations

import json
import pickle
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lora_async.adapter_version import AdapterVersion  # noqa: E402
from lora_async.handoff.packed import layout  # noqa: E402
from lora_async.handoff.receive import CollectiveReceiver, receive_ipc  # noqa: E402
from lora_async.process_groups import broadcast, make_group, make_store  # noqa: E402
from lora_async.sync.pack import pack  # noqa: E402

HIDDEN, INTER, LAYERS, RANK, REPS = 576, 1536, 30, 8, 20
SHAPES = {"q_proj": (HIDDEN, HIDDEN), "k_proj": (192, HIDDEN), "v_proj": (192, HIDDEN), "o_proj": (HIDDEN, HIDDEN),
          "gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN), "down_proj": (HIDDEN, INTER)}


def adapter(version: int, device: str) -> AdapterVersion:
    g = torch.Generator(device="cpu").manual_seed(version)
    tensors = {}
    for layer in range(LAYERS):
        for name, (out_f, in_f) in SHAPES.items():
            block = "self_attn" if name[0] in "qkvo" else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, in_f, generator=g).to(device)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, RANK, generator=g).to(device)
    return AdapterVersion("gpu", version, tensors, {"r": RANK})


def receiver(kind: str, port: int, inbox: mp.Queue, outbox: mp.Queue) -> None:
    device = "cuda:1" if kind == "nccl" else "cuda:0"  # NCCL refuses two ranks on one GPU
    torch.cuda.set_device(torch.device(device))
    group = CollectiveReceiver("127.0.0.1", port, 1, 2, "nccl", 60, device) if kind == "nccl" else None
    while True:
        item = inbox.get()
        if item is None:
            return
        meta, handle = item
        began = time.perf_counter()
        tensors = group.receive(meta) if group is not None else receive_ipc(handle, meta, device)
        torch.cuda.synchronize()
        done_at = time.perf_counter()  # CLOCK_MONOTONIC: the sender's clock too
        elapsed = (done_at - began) * 1000
        expected = adapter(meta.version, "cpu")
        ok = all(torch.equal(tensors[k].cpu(), v.to(torch.bfloat16)) for k, v in expected.tensors.items())
        outbox.put((elapsed, ok, done_at))


def run(kind: str) -> dict:
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    store = make_store("127.0.0.1", 0, 2, True, 60) if kind == "nccl" else None  # port 0: a free one
    child = ctx.Process(target=receiver, args=(kind, store.port if store else 0, inbox, outbox))
    child.start()
    group = make_group(store, 0, 2, "nccl", 60) if store is not None else None
    totals, recv, oks = [], [], []
    buffer = None
    for version in range(REPS):
        version_tensors = adapter(version, "cuda:0")
        torch.cuda.synchronize()
        began = time.perf_counter()
        metas = layout(version_tensors.tensors, torch.bfloat16)
        if buffer is None:  # one device buffer, reused (the sender's side of every transport)
            buffer = torch.empty(metas[-1].offset + metas[-1].nbytes + 64, dtype=torch.uint8, device="cuda:0")
        packed = pack(version_tensors, torch.bfloat16, out=buffer, metas=metas)
        torch.cuda.synchronize()
        meta = packed.meta  # a PackMeta: the queue pickles it
        if group is not None:
            inbox.put((meta, None))
            broadcast(group, packed.buffer)
        else:
            from torch.multiprocessing.reductions import reduce_tensor

            inbox.put((meta, pickle.dumps(reduce_tensor(packed.buffer))))
        elapsed, ok, done_at = outbox.get(timeout=120)  # the sender keeps `buffer` alive until this
        totals.append((done_at - began) * 1000)  # pack to received, without the receiver's bit check
        recv.append(elapsed)
        oks.append(ok)
    inbox.put(None)
    child.join(60)
    return {"transport": kind, "bytes": int(packed.nbytes), "versions": REPS, "all_bit_exact": all(oks),
            "p50_ms_total": statistics.median(totals[1:]), "p50_ms_receive": statistics.median(recv[1:]),
            "device": torch.cuda.get_device_name(0), "torch": torch.__version__}


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    kinds = sys.argv[sys.argv.index("--only") + 1:][:1] if "--only" in sys.argv else ["cuda-ipc", "nccl"]
    for kind in kinds:
        if kind == "nccl" and torch.cuda.device_count() < 2:
            # measured on one H200: "Duplicate GPU detected : rank 0 and rank 1 both on CUDA device"
            print(json.dumps({"transport": kind, "skipped": "one GPU: NCCL refuses two ranks on one device"}),
                  flush=True)
            continue
        print(json.dumps(run(kind)), flush=True)
