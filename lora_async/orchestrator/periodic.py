"""What happens every few steps and at the ends of a run: checkpoints (with the adapter store),
held-out evaluations, and the live chart."""

from __future__ import annotations

import asyncio

from ..adapter_version import AdapterVersion
from ..checkpoint import RunState, save_checkpoint
from ..rollout import EvalResult
from .state import AdapterRun, Run


async def after_step(run: Run, adapter: AdapterRun) -> None:
    """The step's periodic work: a checkpoint waits; evals and the chart run in the background."""
    rc = run.config.run
    if rc.checkpoint_every and adapter.step % rc.checkpoint_every == 0:
        await checkpoint(run)
    if rc.eval_every and adapter.step % rc.eval_every == 0:
        run.in_background(eval_event(run, adapter, "periodic", after=adapter.publishing))
    if rc.chart_every and run.global_step % rc.chart_every == 0 and not run.charting:
        run.in_background(redraw_chart(run))


async def checkpoint(run: Run) -> None:
    """An atomic checkpoint of every adapter (and the adapter store's newest versions).

    Groups in flight or buffered are not saved: their prompts are skipped on resume, and the task
    stream continues from the next undrawn problem."""
    # Every step up to here has its metrics line on disk before the checkpoint names it.
    await asyncio.gather(*(a.publishing for a in run.adapters.values() if a.publishing is not None),
                         return_exceptions=True)
    state = RunState(step=run.global_step, steps={n: a.step for n, a in run.adapters.items()},
                     next_problem={n: a.next_problem for n, a in run.adapters.items()}, wall_s=run.wall_s,
                     counters={n: a.counters.as_dict() for n, a in run.adapters.items()},
                     auto=run.auto.to_json() if run.auto is not None else None,
                     leagues={n: league.state_dict() for n, a in run.adapters.items()
                              if (league := a.source.league) is not None} or None)
    await run.in_learner(save_checkpoint, run.out_dir, state, run.learner, list(run.frozen.values()))
    for adapter in run.adapters.values():
        await save_adapter(run, adapter, final=False)


def save_snapshot(run: Run, adapter: AdapterRun, version: AdapterVersion, wall_s: float) -> None:
    """`run.save_every`: this version of the adapter in the store, stamped with its step and the
    training clock at the step's end, written in the background (the tensors are the learner's
    copy for the hand-off; nothing writes to them)."""
    info = {"step": adapter.step, "wall_s": round(wall_s, 3), "reward_mean": adapter.last_reward, "snapshot": True}
    run.in_background(asyncio.to_thread(run.store.save, adapter.name, version.version, version.tensors,
                                         version.peft_config, info, False))


async def save_adapter(run: Run, adapter: AdapterRun, final: bool) -> None:
    learner = run.learner
    version = learner.version(adapter.name)
    info = {"step": adapter.step, "wall_s": round(run.wall_s, 2), "reward_mean": adapter.last_reward}
    tensors = await run.in_learner(learner.adapter_tensors, adapter.name)
    await asyncio.to_thread(run.store.save, adapter.name, version, tensors, learner.peft_config(adapter.name),
                            info, final)


async def eval_event(run: Run, adapter: AdapterRun, when: str, after: asyncio.Task | None = None) -> EvalResult:
    """Held-out greedy accuracy of the adapter's servable version (an `eval` metrics line)."""
    if after is not None:
        await after  # evaluate the version this step produced, once it is servable
    with run.metrics.stage(f"eval {adapter.name}", adapter.source.heldout_size) as progress:
        result = await adapter.source.evaluate(run.generate, run.tokenizer, adapter.name, done=progress.advance)
        progress.outcome(f"accuracy {result.accuracy:.2f} (n={result.n}, step {adapter.step})")
    row = {"kind": "eval", "when": when, "adapter": adapter.name, "step": adapter.step, "version": result.version,
           "wall_s": round(run.wall_s, 3), "accuracy": result.accuracy, "mean_reward": result.mean_reward,
           "n": result.n, **result.extra}
    run.evals.append(row)
    run.metrics.event(row)
    return result


async def evaluate_all(run: Run, when: str) -> None:
    await asyncio.gather(*(eval_event(run, a, when) for a in run.adapters.values()))


async def redraw_chart(run: Run) -> None:
    """The live view: OUT/chart.png, redrawn every few steps (a failure only warns)."""
    from ..plot import plot_runs

    run.charting = True
    try:
        await asyncio.to_thread(plot_runs, [run.out_dir], run.out_dir / "chart.png", str(run.out_dir))
    except Exception as exc:
        run.console.print(f"[yellow]chart not redrawn: {exc}[/]")
    finally:
        run.charting = False
