"""The league: which versions it keeps and lets go (the anchor never), how a game draws its
opponent (deterministic per game key), Elo after each game, a step row's figures and a resumed
run's league, which must answer exactly as the one it was saved from."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from lora_async.league import ELO_K, ELO_START, GameResult, League, Pick

KEYS = 2000  # games drawn where a count matters: enough that a 1:20 weight shows both members


def league(pick: Pick = Pick.UNIFORM, size: int = 3, every: int = 1, seed: int = 7) -> League:
    return League("main", size=size, every=every, pick=pick, seed=seed)


def filled(pick: Pick, versions: int, size: int = 8, seed: int = 7) -> League:
    """A league that kept v0 .. v{versions-1}, one per step."""
    out = league(pick, size=size, seed=seed)
    for version in range(versions):
        out.keep(version, version)
    return out


def test_a_version_is_kept_every_few_steps_from_step_zero():
    every3 = league(every=3)
    assert [step for step in range(10) if every3.due(step)] == [0, 3, 6, 9]
    assert all(league(every=1).due(step) for step in range(5))


def test_keep_lets_the_oldest_go_over_size_but_never_the_anchor():
    pool = league(size=2)
    assert pool.keep(0, 0) == [] and pool.keep(1, 1) == []
    assert pool.keep(2, 2) == []  # v0 leaves the pool, but as the anchor it stays registered
    assert [m.version for m in pool.members] == [1, 2] and pool.anchor is not None and pool.anchor.version == 0
    assert pool.kept_versions() == [0, 1, 2]
    assert pool.keep(3, 3) == [1]
    assert pool.keep(5, 5) == [2]
    assert [m.version for m in pool.members] == [3, 5] and pool.kept_versions() == [0, 3, 5]
    assert [m.kept_at for m in pool.members] == [3, 5]


def test_a_kept_version_is_refused_again_and_versions_must_increase():
    pool = league(size=1)
    pool.keep(0, 0)
    pool.keep(2, 1)
    pool.keep(4, 2)  # v2 let go
    for version in (0, 2, 4):
        with pytest.raises(ValueError, match="already kept"):
            pool.keep(version, 3)
    with pytest.raises(ValueError, match="must increase"):
        pool.keep(3, 3)
    assert pool.kept_versions() == [0, 4]


def test_kept_versions_have_no_duplicate_while_the_anchor_is_in_the_pool():
    pool = filled(Pick.UNIFORM, 3)
    assert pool.kept_versions() == [0, 1, 2]
    assert [m.version for m in pool.members] == [0, 1, 2]


def test_an_empty_league_has_nothing_to_draw():
    with pytest.raises(LookupError, match="keep a version first"):
        league().draw(0)


def test_latest_draws_the_newest_member():
    pool = filled(Pick.LATEST, 3)
    assert {pool.draw(key).version for key in range(50)} == {2}
    pool.keep(3, 3)
    assert {pool.draw(key).version for key in range(50)} == {3}


def test_uniform_draws_every_member_and_one_key_always_the_same():
    pool = filled(Pick.UNIFORM, 5)
    counts = Counter(pool.draw(key).version for key in range(KEYS))
    assert set(counts) == {0, 1, 2, 3, 4}
    assert min(counts.values()) > KEYS / 5 / 2  # none starved: each near 1/5 of the games
    assert all(pool.draw(key).version == pool.draw(key).version for key in range(100))
    again = filled(Pick.UNIFORM, 5)  # another process, the same seed: the same opponents
    assert [again.draw(key).version for key in range(100)] == [pool.draw(key).version for key in range(100)]
    reseeded = filled(Pick.UNIFORM, 5, seed=8)
    assert [reseeded.draw(key).version for key in range(100)] != [pool.draw(key).version for key in range(100)]


def test_a_draw_does_not_depend_on_other_draws_before_it():
    pool = filled(Pick.UNIFORM, 5)
    forwards = [pool.draw(key).version for key in range(100)]
    backwards = [pool.draw(key).version for key in reversed(range(100))]
    assert forwards == backwards[::-1]


def losing_league() -> League:
    """A pool of two: the adapter always loses to v0 and always beats v1."""
    pool = filled(Pick.LOSSES, 2)
    for _ in range(20):
        pool.record(0, GameResult.LOSS)
        pool.record(1, GameResult.WIN)
    return pool


def test_losses_draws_the_member_the_adapter_loses_to_far_more_often():
    pool = losing_league()
    counts = Counter(pool.draw(key).version for key in range(KEYS))
    # weights (20 + 1) / 22 and (0 + 1) / 22: about 21 to 1
    assert counts[0] > 10 * counts[1]
    assert counts[1] > 0  # the prior: a member always beaten is still drawn now and then
    assert Counter(losing_league().draw(key).version for key in range(KEYS)) == counts
    uniform = filled(Pick.UNIFORM, 2)
    assert abs(Counter(uniform.draw(key).version for key in range(KEYS))[0] - KEYS / 2) < KEYS / 10


def test_losses_counts_a_draw_as_half_a_loss():
    pool = filled(Pick.LOSSES, 2)
    for _ in range(10):
        pool.record(0, GameResult.DRAW)
        pool.record(1, GameResult.WIN)
    assert [m.not_win_weight for m in pool.members] == [(5 + 1) / 12, (0 + 1) / 12]


def test_a_win_between_equal_ratings_moves_both_by_half_of_k():
    pool = filled(Pick.UNIFORM, 1)
    pool.record(0, GameResult.WIN)
    member = pool.members[0]
    assert ELO_K * 0.5 == 8.0
    assert pool.rating == ELO_START + 8.0 and member.elo == ELO_START - 8.0
    assert (member.games, member.wins, member.draws, member.losses) == (1, 1, 0, 0)


def test_a_loss_moves_the_ratings_the_other_way_by_the_same_amount():
    pool = filled(Pick.UNIFORM, 1)
    pool.record(0, GameResult.WIN)  # 1008 against 992: the adapter is expected to win more often
    pool.record(0, GameResult.LOSS)
    member = pool.members[0]
    expected = 1 / (1 + 10 ** ((992.0 - 1008.0) / 400))
    assert pool.rating == pytest.approx(1008.0 - ELO_K * expected)
    assert pool.rating + member.elo == pytest.approx(2 * ELO_START)  # zero-sum
    assert (member.games, member.wins, member.losses) == (2, 1, 1)


def test_a_draw_between_equal_ratings_changes_no_rating():
    pool = filled(Pick.UNIFORM, 1)
    pool.record(0, GameResult.DRAW)
    assert pool.rating == ELO_START and pool.members[0].elo == ELO_START
    assert pool.members[0].draws == 1


def test_a_new_member_starts_at_the_adapters_rating():
    pool = filled(Pick.UNIFORM, 1)
    pool.record(0, GameResult.WIN)
    pool.keep(1, 1)
    assert pool.members[1].elo == pool.rating == ELO_START + 8.0


def test_a_game_against_a_member_let_go_moves_only_the_adapters_rating():
    pool = league(size=1)
    pool.keep(0, 0)
    pool.keep(1, 1)
    pool.keep(2, 2)  # v1 let go
    pool.record(1, GameResult.WIN)
    assert pool.rating == ELO_START + 8.0
    gone = next(m for m in pool.summary()["members"] if m["version"] == 1)
    assert gone["elo"] == ELO_START and gone["games"] == 0 and gone["in_pool"] is False
    pool.record(0, GameResult.WIN)  # the anchor, out of the pool: still rated (evaluation plays it)
    assert pool.anchor is not None and pool.anchor.games == 1 and pool.anchor.elo < ELO_START
    with pytest.raises(ValueError, match="never kept"):
        pool.record(7, GameResult.WIN)


def test_figures_count_the_win_rate_per_row():
    pool = filled(Pick.UNIFORM, 2)
    pool.record(0, GameResult.WIN)
    pool.record(1, GameResult.LOSS)
    pool.record(1, GameResult.DRAW)
    pool.record(0, GameResult.WIN)
    first = pool.figures()
    assert first["league_win_rate"] == 0.5 and first["league_games"] == 4.0 and first["league_size"] == 2.0
    assert first["league_elo"] == pool.rating
    assert first["league_elo_best_kept"] == max(m.elo for m in pool.members)
    second = pool.figures()
    assert "league_win_rate" not in second and second["league_games"] == 4.0
    pool.record(1, GameResult.WIN)
    assert pool.figures()["league_win_rate"] == 1.0


def test_summary_lists_every_member_ever_kept():
    pool = league(size=1)
    pool.keep(0, 0)
    pool.keep(3, 3)
    pool.keep(6, 6)
    summary = json.loads(json.dumps(pool.summary()))
    assert summary["anchor"] == 0 and summary["rating"] == ELO_START
    assert [(m["version"], m["kept_at"], m["in_pool"]) for m in summary["members"]] == [
        (0, 0, False), (3, 3, False), (6, 6, True)]


def played() -> League:
    """A league partway through a run: members let go, ratings moved, a row's window open."""
    pool = League("main", size=3, every=2, pick=Pick.LOSSES, seed=11)
    results = [GameResult.WIN, GameResult.LOSS, GameResult.DRAW, GameResult.LOSS, GameResult.WIN]
    for step in range(0, 12, 2):
        pool.keep(step, step)
        for game in range(6):
            pool.record(pool.draw(step * 100 + game).version, results[(step + game) % len(results)])
        if step == 6:
            pool.figures()
    return pool


def test_a_restored_league_answers_as_the_one_saved():
    saved = played()
    restored = League.from_state(json.loads(json.dumps(saved.state_dict())), adapter="main")
    assert [restored.draw(key).version for key in range(500)] == [saved.draw(key).version for key in range(500)]
    assert restored.rating == saved.rating and restored.members == saved.members
    assert restored.anchor == saved.anchor and restored.kept_versions() == saved.kept_versions()
    assert restored.summary() == saved.summary()
    assert "league_win_rate" in (figures := saved.figures()) and restored.figures() == figures
    for league_ in (saved, restored):  # and they go on alike
        league_.record(league_.members[0].version, GameResult.WIN)
        assert league_.keep(12, 12) == [6]
    assert restored.state_dict() == saved.state_dict()


def test_a_state_of_another_adapter_is_refused():
    state = played().state_dict()
    with pytest.raises(ValueError, match="of adapter 'main', not 'other'"):
        League.from_state(state, adapter="other")
