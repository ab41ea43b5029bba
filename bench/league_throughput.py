"""What a league of past versions costs generation: episodes per second of two-seat games against
8 kept versions, against single-seat episodes with the same tokens (bench/RESULTS.md section 24).

    python bench/league_throughput.py [--model smollm2-135m] [--rounds 5] [--episodes 16]

One in-process vLLM engine, sized as a league run sizes it (`EngineSpec.kept`: the pool and its
anchor beyond the staleness window). It registers versions v0..v8 of one adapter, keeping v0..v7
as the league does (`Generator.keep`), so v8 is the newest and 8 past versions stay registered.
Then, in rounds, three arms of `--episodes` episodes played at once, each reply exactly
`--reply` tokens (min = max) and each turn adding the same `--message` tokens to a context:

- league: two seats, `--turns` replies each, alternating; one seat on the newest version, the
  other on a past version (episode i plays v(i mod 8)): 9 versions in the engine's batches;
- mirror: the same two seats, both on the newest version (what the league adds: the versions);
- single: one seat, 2 x `--turns` replies on the newest version, one context (the same sampled
  tokens; its context grows twice as long: more prefill).

The arms alternate within each round (league, mirror, single; then the reverse), so the
machine's drift falls on all. Per arm, the median episodes/s over rounds and its range; the
ratios are paired per round. Also recorded: whether the engine ever restarted (its LoRA ids
stay the registered ones), and the bytes this process wrote to disk during the league arm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import psutil

POOL = 8  # past versions kept, as `league.size = 8` would keep them
ARMS = ("league", "mirror", "single")


def adapters(model_dir: Path, versions: int) -> list[Any]:
    """`versions` random rank-8 LoRAs of the model, as the learner would hand them over."""
    from lora_async.adapter_version import AdapterVersion
    from lora_async.bench.sync import _adapter

    first = _adapter(model_dir, 8)
    return [AdapterVersion("main", v, {k: t * (1.0 + 0.1 * v) for k, t in first.tensors.items()}, first.peft_config)
            for v in range(versions)]


async def episode(generate: Any, arm: str, index: int, turns: int, reply: int, message: list[int],
                  opening: list[int]) -> int:
    """One episode of `arm`; returns the tokens sampled."""
    from lora_async.generator.types import GenRequest

    seats = 1 if arm == "single" else 2
    contexts = [list(opening) + [100 + seat] for seat in range(seats)]
    pinned = index % POOL if arm == "league" else None
    sampled = 0
    for turn in range(turns * 2):
        seat = turn % seats
        version = pinned if seat == 1 else None
        result = await generate(GenRequest(contexts[seat], "main", max_tokens=reply, min_tokens=reply,
                                           temperature=1.0, version=version, seed=index * 1000 + turn))
        assert result.ok, result.error
        ids = result.samples[0].token_ids
        sampled += len(ids)
        contexts[seat] += ids + message
    return sampled


async def arm_round(generator: Any, arm: str, episodes: int, turns: int, reply: int, message: list[int],
                    opening: list[int]) -> tuple[float, int]:
    from lora_async.generator.types import generate_async

    generate = generate_async(generator)
    began = time.perf_counter()
    tokens = await asyncio.gather(*(episode(generate, arm, i, turns, reply, message, opening)
                                    for i in range(episodes)))
    return episodes / (time.perf_counter() - began), sum(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--episodes", type=int, default=16, help="episodes played at once per arm and round")
    parser.add_argument("--turns", type=int, default=4, help="replies per seat (single: twice this, one seat)")
    parser.add_argument("--reply", type=int, default=8, help="tokens per reply (min = max)")
    parser.add_argument("--message", type=int, default=12, help="tokens the game adds after each reply")
    parser.add_argument("--opening", type=int, default=150, help="tokens of each seat's opening (the rules)")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()

    from lora_async.dtypes import resolve_dtype
    from lora_async.generator.engine import EngineSpec, VllmGenerator
    from lora_async.models import resolve_model
    from lora_async.placement import Placement
    from lora_async.staleness import StalenessWindow
    from lora_async.sync.transports import InprocTransport

    model_dir = resolve_model(args.model)
    spec = EngineSpec(model_dir=model_dir, adapters=("main",), window=StalenessWindow(1), max_lora_rank=8,
                      dtype=resolve_dtype("auto", "cpu"), kv_cache_gb=1.0, max_model_len=1024, block_size=32,
                      kept=POOL + 1)
    opening = list(range(1000, 1000 + args.opening))  # the rules and an example game
    message = list(range(2000, 2000 + args.message))
    process = psutil.Process()
    figures: dict[str, list[float]] = {arm: [] for arm in ARMS}
    tokens: dict[str, list[int]] = {arm: [] for arm in ARMS}
    written = []
    with VllmGenerator(spec, Placement("cpu", None)) as generator:
        transport = InprocTransport(generator)
        for version in adapters(model_dir, POOL + 1):
            transport.publish(version)
            if version.version < POOL:
                generator.keep("main", version.version)
        assert generator.live_versions("main") == list(range(POOL + 1)), generator.live_versions("main")
        ids = sorted(generator.engine_lora_ids())
        asyncio.run(arm_round(generator, "league", args.episodes, args.turns, args.reply, message, opening))  # warm-up
        for r in range(args.rounds):
            for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
                before = process.io_counters().write_bytes
                rate, sampled = asyncio.run(arm_round(generator, arm, args.episodes, args.turns, args.reply,
                                                      message, opening))
                if arm == "league":
                    written.append(process.io_counters().write_bytes - before)
                figures[arm].append(rate)
                tokens[arm].append(sampled)
                print(f"round {r} {arm:6s} {rate:6.2f} episodes/s ({sampled} tokens)", flush=True)
        same_engine = sorted(generator.engine_lora_ids()) == ids
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "dtype": spec.dtype,
                              "same_engine_and_versions": same_engine, "league_bytes_written": written}
    for arm in ARMS:
        values = figures[arm]
        result[arm] = {"median": statistics.median(values), "min": min(values), "max": max(values),
                       "tokens": statistics.median(tokens[arm])}
    for other in ("mirror", "single"):
        ratios = [a / b for a, b in zip(figures["league"], figures[other])]
        result[f"league/{other}"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
