"""Games in the training loop, against the fakes (tests/fakes.py): seats that see only their own
conversation, trained and frozen seats, a league of past versions kept registered and drawn as
opponents, Elo ratings, held-out win rates, and a resumed run that keeps its pool."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
from rich.console import Console

from lora_async.config import TrainConfig
from lora_async.envs.source import EnvLoadError
from lora_async.generator.types import GenRequest
from lora_async.metrics import read_metrics
from lora_async.orchestrator import train
from lora_async.tasks import make_source

from .fakes import FakeParts

NIM = "lora_async.envs.builtin.nim:make"


def config(tmp_path: Path, **task: object) -> TrainConfig:
    return TrainConfig.model_validate({
        "sampling": {"samples_per_prompt": 4, "max_new_tokens": 16},
        "generator": {"groups_in_flight": 4, "max_model_len": 4096},
        "learner": {"groups_per_step": 2},
        "buffer": {"mode": "async", "max_staleness": 1},
        "run": {"max_steps": 8, "output_dir": str(tmp_path / "out"), "progress": False, "canary_every": 0,
                "chart_every": 0, "eval_at_start": True, "eval_at_end": True, "checkpoint_every": 4},
        "task": {"type": "env", "env": NIM, "max_turns": 6, "heldout": 6, **task},
    })


def moves(request: GenRequest, rng: random.Random) -> str:
    """A player that names a random heap and count: legal or not, as a weak model's would be."""
    return f"take {rng.randint(1, 2)} from {rng.choice('ABC')}"


def run(cfg: TrainConfig, parts: FakeParts, resume: bool = False) -> dict:
    return asyncio.run(train(cfg, resume=resume, console=Console(stderr=True, width=200), parts=parts))


def rows(cfg: TrainConfig, kind: str | None = None) -> list[dict]:
    found = read_metrics(Path(cfg.run.output_dir) / "metrics.jsonl")
    return [r for r in found if r.get("kind") == kind]


def league_parts() -> FakeParts:
    return FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.05, reply=moves)


def test_a_league_keeps_past_versions_registered_and_plays_them(tmp_path):
    cfg = config(tmp_path, opponents="league", league={"every": 2, "size": 2, "pick": "uniform"})
    parts = league_parts()
    summary = run(cfg, parts)
    generator = parts.fake_generator
    league = summary["league"]
    kept = sorted(m["version"] for m in league["members"] if m["in_pool"])
    # every 2 versions, 2 at most, and v0 (the anchor, also the held-out opponent `self@v0`) stays
    assert kept == [6, 8] and league["anchor"] == 0
    assert generator.kept == {("main", 0), ("main", 6), ("main", 8)}
    assert [m["version"] for m in league["members"]] == [0, 2, 4, 6, 8]
    # the opponents' requests named a kept version and carry no rollout tag (a step never stops
    # them); the trained seat's asked for the newest, on the rollout tag
    pinned = [r for r in generator.requests if r.version is not None]
    assert {0, 2, 4, 6} <= {r.version for r in pinned} <= {0, 2, 4, 6, 8} and all(r.tag is None for r in pinned)
    assert all(r.tag == "rollout" for r in generator.requests if r.version is None and r.temperature > 0)
    # games against a member since let go moved only the adapter's rating
    assert league["games"] > 0 and 0 < sum(m["games"] for m in league["members"]) <= league["games"]
    assert all(m["games"] > 0 for m in league["members"] if m["version"] < 8)
    train_rows = rows(cfg)
    assert all("league_elo" in r and r["league_size"] >= 1 for r in train_rows)
    evals = rows(cfg, "eval")
    assert {"vs_self_v0/win", "vs_self_v0/draw", "vs_self_v0/loss", "vs_random/win", "vs_expert/loss"} <= set(evals[0])
    assert all(r["accuracy"] == r["vs_self_v0/win"] for r in evals)
    # the plot has the league's row: the Elo line and the win rate by opponent (the same run less
    # the league's figures draws one row less)
    import matplotlib.image

    from lora_async.plot import LEAGUE_PANEL_HEIGHT, plot_runs

    plain = tmp_path / "plain"
    plain.mkdir()
    kept = [{k: v for k, v in r.items() if not k.startswith(("league_", "vs_"))}
            for r in read_metrics(Path(cfg.run.output_dir) / "metrics.jsonl")]
    (plain / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    heights = [matplotlib.image.imread(plot_runs([run_dir], tmp_path / f"{run_dir.name}.png")).shape[0]
               for run_dir in (Path(cfg.run.output_dir), plain)]
    assert heights[0] - heights[1] == round(LEAGUE_PANEL_HEIGHT * 110)


def test_each_seat_sees_only_its_own_conversation(tmp_path):
    """A trained seat's sample holds its own opening, its replies and the game's messages to it:
    never the other seat's opening."""
    cfg = config(tmp_path, opponents="scripted:random", seat="first")
    parts = league_parts()
    summary = run(cfg, parts)
    assert summary["steps"] == 8
    samples = [s for t in parts.fake_learner.trained for s in t.samples]
    assert samples
    for s in samples:
        text = bytes(s.prompt_ids + s.completion_ids).decode()
        assert "You move first" in text and "Your opponent moves first" not in text
        assert s.reward in (-1.0, 0.0, 1.0)  # an invalid move, a game lost, a game won
    # the scripted player drew nothing from the generator: every request was the trained seat's
    assert all(version is not None for _, version, _, _ in parts.fake_generator.served)


def test_a_resumed_run_keeps_the_pool_and_the_ratings(tmp_path):
    cfg = config(tmp_path, opponents="league", league={"every": 2, "size": 3})
    first = league_parts()
    run(cfg, first)
    checkpoint = json.loads((tmp_path / "out" / "checkpoints" / "step-000008" / "state.json").read_text())
    saved = checkpoint["leagues"]["main"]
    frozen = sorted(p.name for p in (tmp_path / "out" / "checkpoints" / "step-000008" / "frozen").iterdir())
    assert frozen == ["main@v0.safetensors", "main@v4.safetensors", "main@v6.safetensors", "main@v8.safetensors"]

    more = cfg.model_copy(update={"run": cfg.run.model_copy(update={"max_steps": 10, "eval_at_start": False})})
    second = league_parts()
    summary = run(more, second, resume=True)
    published = [e for e in second.events if e.startswith("publish")]
    # the kept versions first, oldest first, then the current one (v8 is both: kept once)
    assert published[:4] == ["publish main@v0", "publish main@v4", "publish main@v6", "publish main@v8"]
    assert "publish main@v8" not in published[4:]
    league = summary["league"]
    resumed = {m["version"]: m for m in league["members"]}
    for member in saved["history"]:  # the same members; the ones still in the pool played on from their ratings
        if not member["version"] in {4, 6, 8}:
            assert resumed[member["version"]] == {**member, "in_pool": False}
    assert {("main", 0), ("main", 10)} <= second.fake_generator.kept


def test_a_single_seat_environment_refuses_a_games_fields(tmp_path):
    cfg = config(tmp_path, env="lora_async.envs.builtin.guess:make", opponents="base")
    with pytest.raises(EnvLoadError, match=r"task.opponents: .* single-seat"):
        make_source(cfg.adapter_specs[0], cfg, 0)


def test_an_unknown_scripted_player_is_one_line_naming_the_field(tmp_path):
    cfg = config(tmp_path, opponents="scripted:grandmaster")
    with pytest.raises(EnvLoadError, match=r"task.opponents: .* no scripted player 'grandmaster'"):
        make_source(cfg.adapter_specs[0], cfg, 0)


def digits(request: GenRequest, rng: random.Random) -> str:
    return f"The number is {rng.randint(1, 9)}."


def test_two_adapters_of_a_fleet_cooperate_each_training_on_its_own_seat(tmp_path):
    """Relay, the example's fleet: each adapter trains its own seat with the other adapter's
    newest version frozen in the partner seat; both share the reward."""
    from lora_async.config import load_config

    REPO = Path(__file__).resolve().parents[1]
    cfg = load_config(REPO / "examples" / "relay.toml")
    run_config = cfg.run.model_copy(update={"max_steps": 4, "output_dir": str(tmp_path / "out"), "progress": False,
                                            "canary_every": 0, "chart_every": 0, "time_budget_s": None})
    cfg = cfg.model_copy(update={"run": run_config})
    parts = FakeParts(["sender", "receiver"], gen_delay=lambda: 0.01, step_s=0.05, reply=digits)
    summary = run(cfg, parts)
    assert summary["steps"] == 8
    by_adapter: dict[str, list] = {}
    for t in parts.fake_learner.trained:
        by_adapter.setdefault(t.adapter, []).extend(t.samples)
    for adapter, seat_text in (("sender", "The secret number is"), ("receiver", "Reply with only the number")):
        samples = by_adapter[adapter]
        assert samples and all(seat_text in bytes(s.prompt_ids).decode() for s in samples)
    # the partner's requests: the other adapter's newest version, never on the rollout tag
    partner = [r for r in parts.fake_generator.requests if r.tag is None and r.temperature > 0]
    assert {r.adapter for r in partner} == {"sender", "receiver"} and all(r.version is None for r in partner)
    evals = [r for r in rows(cfg, "eval") if r["adapter"] == "receiver"]
    assert evals and {"vs_sender/win", "vs_copy/draw"} <= set(evals[0])
    # a cooperative game has no winner: its accuracy is the share of rounds the pair got right
    assert all(r["vs_copy/draw"] == 1.0 for r in evals)


def test_the_engine_and_the_memory_plan_count_a_leagues_lora_slots(tmp_path):
    """A league of 8 keeps 9 versions beyond the staleness window (the pool and v0): the engine
    sizes its LoRA slots for them, and `lora-async plan` counts them."""
    from lora_async.generator.spec import EngineSpec
    from lora_async.plan.estimate import generator_items
    from lora_async.plan.shapes import load_shape

    league = config(tmp_path, opponents="league", league={"size": 8})
    plain = config(tmp_path, opponents="scripted:random", eval_opponents=["scripted:random"])
    from lora_async.envs.games import kept_versions

    guess = config(tmp_path, env="lora_async.envs.builtin.guess:make")  # single-seat: keeps none
    assert [kept_versions(c) for c in (league, plain, guess)] == [9, 0, 0]
    specs = [EngineSpec.from_config(c, tmp_path, "cpu", kept=kept_versions(c)) for c in (league, plain)]
    assert specs[0].max_loras - specs[1].max_loras == 9 and specs[0].max_cpu_loras - specs[1].max_cpu_loras == 9
    shape = load_shape("smollm2-135m")
    slots = [next(i for i in generator_items(c, c.generator, shape, "cpu", "bfloat16", 24 << 30)[0]
                  if i.name.startswith("LoRA slots")) for c in (league, plain)]
    assert slots[0].bytes > slots[1].bytes and "max_loras" in slots[0].detail


def test_a_kept_opponent_that_cannot_be_read_again_is_left_out_and_the_run_goes_on(tmp_path):
    cfg = config(tmp_path, opponents="league", league={"every": 2, "size": 3})
    run(cfg, league_parts())
    damaged = tmp_path / "out" / "checkpoints" / "step-000008" / "frozen" / "main@v4.safetensors"
    damaged.unlink()  # hard-linked from the checkpoint before: a copy of its own, then damaged
    damaged.write_bytes(b"not a safetensors file")
    more = cfg.model_copy(update={"run": cfg.run.model_copy(update={"max_steps": 10, "eval_at_start": False})})
    parts = league_parts()
    summary = run(more, parts, resume=True)
    assert summary["steps"] == 10
    assert "publish main@v4" not in parts.events and ("main", 4) not in parts.fake_generator.kept
    league = summary["league"]
    assert [m["in_pool"] for m in league["members"] if m["version"] == 4] == [False]
    assert all(r.version != 4 for r in parts.fake_generator.requests)  # never drawn again


GAMES = '''
from lora_async.envs import user
from lora_async.envs.game import Game, Move


def flaky_player(game, seat, rng):
    raise RuntimeError("the scripted player broke")


class Coin(Game):
    """Each seat says heads or tails once; the first seat wins on "take"; game `index` odd raises."""

    seats = ("first", "second")
    players = {"flaky": flaky_player}

    def __init__(self, index):
        self.index, self.moves = index, 0

    def reset(self):
        return {seat: [user(f"game {self.index}, you are {seat}")] for seat in self.seats}

    def to_move(self):
        return self.seats[self.moves % 2]

    def step(self, seat, reply):
        if self.index % 2:
            raise RuntimeError("the game exploded")
        self.moves += 1
        if self.moves == 2:
            won = "first" if reply.content.startswith("take") else "second"
            return Move(done=True, rewards={won: 1.0}, winner=won)
        return Move({"second": [user(f"they said {reply.content}")]})


def make(index, split):
    return Coin(index)
'''


@pytest.fixture
def game_module(tmp_path, monkeypatch):
    (tmp_path / "fake_games.py").write_text(GAMES)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "fake_games:make"
    import sys

    sys.modules.pop("fake_games", None)


def test_a_game_that_raises_or_a_scripted_player_that_raises_is_counted_and_the_run_goes_on(tmp_path, game_module):
    cfg = config(tmp_path, env=game_module, opponents="self", eval_opponents=["scripted:flaky", "base"])
    summary = run(cfg, league_parts())
    assert summary["steps"] == 8 and summary["env_errors"] > 0 and summary["reward_errors"] > 0
    evals = rows(cfg, "eval")
    # every held-out game against the broken player, and every odd game, broke: counted, not results;
    # the base's even games were played, and give the accuracy (the first opponent with games)
    for e in evals:
        assert e["vs_flaky/env_errors"] == 6 and "vs_flaky/win" not in e
        assert e["vs_base/env_errors"] == 3 and e["vs_base/win"] + e["vs_base/draw"] + e["vs_base/loss"] == 1.0
        assert e["accuracy"] == e["vs_base/win"]


def test_a_two_player_textarena_game_trains_against_past_versions(tmp_path, monkeypatch):
    """examples/textarena_env.py's TextArenaMatch (TicTacToe) in the loop: each seat sees what
    textarena addresses to its player, and the games end with textarena's rewards."""
    pytest.importorskip("textarena")
    REPO = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(REPO)  # `examples.textarena_env` is imported from the repository root
    monkeypatch.syspath_prepend(str(REPO))
    cfg = config(tmp_path, env="examples.textarena_env:two_player", max_turns=8, opponents="league",
                 league={"every": 2, "size": 2})

    def squares(request: GenRequest, rng: random.Random) -> str:
        return f"[{rng.randint(0, 8)}]"

    summary = run(cfg, FakeParts(["main"], gen_delay=lambda: 0.01, step_s=0.05, reply=squares))
    assert summary["steps"] == 8 and summary["env_errors"] == 0 and summary["league"]["games"] > 0
    evals = rows(cfg, "eval")
    assert all(abs(e["vs_self_v0/win"] + e["vs_self_v0/draw"] + e["vs_self_v0/loss"] - 1.0) < 1e-9 for e in evals)
