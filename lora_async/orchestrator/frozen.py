"""Frozen versions: a game's opponents from the past, kept registered beside the live ones.

Two kinds, both named by a game task (`envs.games`): the versions a league keeps (every
`league.every` versions, up to `league.size`, and v0 as the anchor) and the pinned versions the
games name (`self@v0`, `other@v3`). Each is kept right after it is published, before a newer
version could push it out of the staleness window (`Generator.keep`): no file is written and
the engine is not restarted; a league costs a LoRA slot per member (`EngineSpec.kept`).

The run holds each kept version's tensors (the `AdapterVersion` the learner handed over, a CPU
copy of its own), so a checkpoint can write them (`checkpoint.py`, `frozen/`), and a resumed
run publishes them again, oldest first, before the adapters' current versions: the same pool,
the same ratings (the leagues' state is in the checkpoint too).
"""

from __future__ import annotations

import asyncio

from ..adapter_version import AdapterVersion, served_name
from ..errors import TrainingError
from ..generator.types import CannotKeep
from ..generator.validate import AdapterError
from ..handoff import PackError
from .state import AdapterRun, Run


def pinned_versions(run: Run) -> set[tuple[str, int]]:
    """Every (adapter, version) a game of this run names as a frozen opponent."""
    return {pin for adapter in run.adapters.values() for pin in adapter.source.pinned()}


def check_pinned(run: Run) -> None:
    """Before training: a game's training opponent `<adapter>@v<k>` is registered already (v0, or
    a version a resumed run kept), and no pinned version was passed without being kept. A
    held-out opponent may come later: its games are played from when it is published."""
    for adapter in run.adapters.values():
        opponents = getattr(adapter.spec.task, "opponents", "self")
        name, _, version = opponents.partition("@v")
        if version and int(version) > run.learner.version(adapter.name if name == "self" else name):
            raise TrainingError(f"{adapter.spec.task_path}.opponents: {opponents!r} is not published yet: a "
                                "training opponent must exist when the run starts (v0, or a version a resumed "
                                "run kept); to play past versions as they come, use opponents = 'league'")
    for name, version in sorted(pinned_versions(run)):
        current = run.learner.version(name)
        if version < current and (name, version) not in run.frozen:
            raise TrainingError(f"{served_name(name, version)} is a frozen opponent of this run, but {name} is at "
                                f"v{current} and v{version} was not kept (the config named it only now): name a "
                                "version this run keeps")


async def keep_if_named(run: Run, adapter: AdapterRun, version: AdapterVersion) -> None:
    """`version` of `adapter` is registered: keep it if a game names it, or its league is due
    (and let go of what the league lets go of)."""
    key = (adapter.name, version.version)
    if key in run.frozen:
        return  # restored and kept already (a resumed run)
    league = adapter.source.league
    let_go: list[int] = []
    pins = pinned_versions(run)
    wanted = key in pins
    # due; or a pool left empty (its kept versions could not be registered again on resume)
    if (league is not None and (league.due(version.version) or not league.members)
            and version.version not in league.kept_versions()):
        let_go = league.keep(version.version, adapter.step)
        wanted = True
    if wanted:
        try:
            await asyncio.to_thread(run.generator.keep, adapter.name, version.version)
        except CannotKeep as exc:  # a held-out opponent on servers or Ray (the config refuses a training one)
            run.console.print(f"[yellow]{exc}: held-out games against it are left out[/]")
            return
        run.frozen[key] = version
    for old in let_go:
        if (adapter.name, old) not in pins:
            await asyncio.to_thread(run.generator.let_go, adapter.name, old)
            run.frozen.pop((adapter.name, old), None)


async def publish_frozen(run: Run, versions: list[AdapterVersion]) -> None:
    """A resumed run's kept versions, oldest first per adapter, each kept as it is registered. One
    the engine refuses (damaged weights) is shown and left out: its league goes on without it,
    and games that name it are left out of evaluations (a training opponent: `check_pinned`)."""
    for version in sorted(versions, key=lambda v: (v.adapter, v.version)):
        try:
            await asyncio.to_thread(run.transport.publish, version)
        except (AdapterError, PackError) as exc:  # what `publish.deliver` counts as a refused version
            run.console.print(f"[red]{version.served_name}, a kept opponent, was refused ({exc}); the run goes on "
                              "without it[/]")
            continue
        await asyncio.to_thread(run.generator.keep, version.adapter, version.version)
        run.frozen[(version.adapter, version.version)] = version
    for adapter in run.adapters.values():  # a member not registered again (unreadable, refused) is drawn no more
        league = adapter.source.league
        if league is None:
            continue
        for number in league.kept_versions():
            if (adapter.name, number) not in run.frozen:
                league.drop(number)
