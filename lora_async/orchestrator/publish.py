"""Publishing: each step's new version goes to the generator in the background, in order; then
the step's metrics line is written (with its sync time) and, every few versions, the canary
checks that what vLLM serves is what the learner trained.
"""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

from ..adapter_version import AdapterVersion
from ..buffer import TrainSample
from ..errors import TrainingError
from ..generator.types import GenRequest, PublishStats
from ..generator.validate import AdapterError
from ..handoff import PackError
from .frozen import check_pinned, keep_if_named, publish_frozen
from .periodic import save_snapshot
from .state import AdapterRun, Run

MAX_REJECTED_IN_A_ROW = 3  # transfers of one adapter refused in a row before the run stops
REJECTED_VERSION = (AdapterError, PackError)  # a refused version, not a broken engine or transport
CANARY_WARN_NATS = 0.5  # mean |generator - learner| logprob on the probe that means "not applied"
CANARY_TOKENS = 16


async def publish_initial(run: Run) -> None:
    """Hand every adapter's starting version to the generator; wait until each is servable. A
    resumed run's frozen opponents go first, oldest first (`frozen.py`)."""
    await publish_frozen(run, run.restored_frozen)
    check_pinned(run)
    for adapter in run.adapters.values():
        version = await run.in_learner(run.learner.adapter_version, adapter.name)
        if (adapter.name, version.version) not in run.frozen:  # a kept version is registered already
            await asyncio.to_thread(run.transport.publish, version)
            await keep_if_named(run, adapter, version)
        adapter.admission.version_published(version.version)
        if run.config.run.save_every:
            save_snapshot(run, adapter, version, run.wall_s)
    await run.notify()


def held_back(run: Run, adapter: AdapterRun, version: AdapterVersion | None) -> AdapterVersion | None:
    """The version to hand the generator after a step: the new one, or with `buffer.fixed_lag = k`
    the one k versions older (None until there is one). The generator then serves k versions
    behind the learner, and admission (`admission.py`), counting those k as unpublished, starts
    groups only while the learner waits: every sample trains at lag k. The held versions are
    not checkpointed; a resumed run serves its newest version at first."""
    lag = run.config.buffer.fixed_lag
    if lag is None or version is None:
        return version
    adapter.held.append(version)
    return adapter.held.popleft() if len(adapter.held) > lag else None


async def publish_and_record(run: Run, adapter: AdapterRun, version: AdapterVersion | None,
                             row: dict[str, Any], previous: asyncio.Task | None) -> None:
    """Register a new version (after the previous one), then write its step's metrics line."""
    if previous is not None:
        await previous
    if version is not None:
        stats = await deliver(run, adapter, version, row)
        if stats is not None:
            await keep_if_named(run, adapter, version)  # a game's frozen opponent: before a newer one can retire it
            adapter.admission.version_published(version.version)
            await run.notify()
            row.update(sync_ms=stats.ms, sync_wait_ms=stats.wait_ms, sync_bytes=stats.bytes,
                       sync_transport=stats.transport)
    run.metrics.step(row)
    every = run.config.run.canary_every
    if (version is not None and every and version.version % every == 0
            and adapter.admission.published == version.version):
        await canary(run, adapter, version)


async def deliver(run: Run, adapter: AdapterRun, version: AdapterVersion, row: dict[str, Any]) -> PublishStats | None:
    """Publish `version`; a refused transfer (corrupted, bad values) is sent again at once.

    Waiting for the next step instead could leave the served version too far behind the learner
    for any rollout to be admissible, and then no next step would come. The live versions keep
    serving meanwhile. MAX_REJECTED_IN_A_ROW refusals mean something systematic: the run fails."""
    while True:
        try:
            stats = await asyncio.to_thread(run.transport.publish, version)
        except REJECTED_VERSION as exc:
            adapter.counters.rejected_versions += 1
            adapter.rejected_in_a_row += 1
            row.setdefault("sync_error", str(exc)[:300])
            run.console.print(f"[red]{version.served_name} refused ({exc}); "
                              f"v{adapter.admission.published} keeps serving[/]")
            if adapter.rejected_in_a_row >= MAX_REJECTED_IN_A_ROW:
                run.fail(TrainingError(f"{adapter.name}: {adapter.rejected_in_a_row} transfers in a row refused; "
                                       f"last: {exc}"))
                return None
        except Exception as exc:
            run.fail(TrainingError(f"publishing {version.served_name} failed: {exc}"))
            raise
        else:
            adapter.rejected_in_a_row = 0
            return stats


async def canary(run: Run, adapter: AdapterRun, version: AdapterVersion) -> None:
    """Invariant 7: what vLLM serves under version k is what the learner trained as version k.

    vLLM samples a probe on version k; the learner scores it with a snapshot of version k (the
    tensors that were published), so the check is exact even while the learner moves on.
    """
    prompt_ids = await adapter.source.probe_prompt(run.tokenizer)
    if prompt_ids is None:
        return
    result = await run.generate(GenRequest(prompt_ids, adapter.name, n=1, max_tokens=CANARY_TOKENS,
                                           temperature=adapter.spec.sampling.temperature))
    if not result.ok or not result.samples or not result.samples[0].token_ids:
        return
    if result.version != version.version:
        return  # a newer version was published meanwhile; the next canary will compare
    sample = result.samples[0]
    probe_sample = TrainSample(adapter.name, version.version, prompt_ids, sample.token_ids, sample.logprobs, 0.0)
    learner_lp = (await run.in_learner(run.learner.snapshot_logprobs, version, [probe_sample]))[0]
    diff = statistics.fmean(abs(a - b) for a, b in zip(learner_lp, sample.logprobs))
    run.metrics.event({"kind": "canary", "adapter": adapter.name, "step": adapter.step,
                       "version": version.version, "canary_mismatch": diff, "tokens": len(sample.token_ids)})
    if diff > CANARY_WARN_NATS:
        adapter.counters.canary_warnings += 1
        run.console.print(f"[red]canary: generator and learner disagree by {diff:.2f} nats/token on "
                          f"{version.served_name}: the served adapter may not be what was trained[/]")
