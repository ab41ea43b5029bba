"""Single-player textarena games as lora-async environments: `lora-async train examples/textarena.toml`.

textarena (`pip install textarena`) has text games behind a gym-like API: `reset(num_players,
seed)`, `get_observation() -> (player, [(sender, text, kind), ...])`, `step(action) -> (done,
info)` and, once done, `close() -> (rewards, game_info)`. `TextArenaGame` maps that onto
`reset() -> messages` and `step(reply) -> StepResult`. Wrapping another library takes the same
three decisions, marked (1) to (3) below:

(1) Seeding: a game is a pure function of (index, split), so that every episode of a group
    plays the same game; train and eval seeds never meet.
(2) Observations: only the text that is new this turn goes to the model; the conversation
    already holds the rest.
(3) Reward: the game's own, for player 0, on its own scale. textarena 0.7.4's single-player
    games give 1 for a win and otherwise the share of the puzzle solved, in [0, 1) (for
    GuessTheNumber: how close the last guess was). `success` is a win. An invalid move is
    the game's call: it warns once (the warning is the next message) and ends the game at the
    second in a row. Give `task.max_turns` room for the game's whole length: an episode the run
    cuts off first scores 0.

Another textarena game is one line, `my_game = game("FrozenLake-v0")`, then `env =
"examples.textarena_env:my_game"`. Another library: keep the shape of `TextArenaGame` and
replace the calls into textarena.

Imported from the repository root as `examples.textarena_env` (run lora-async from there).
"""

from __future__ import annotations

import random
import threading
from typing import Any, Callable

try:
    import textarena
except ImportError:
    raise ImportError("examples/textarena_env.py needs textarena: pip install textarena") from None

from lora_async.envs import Env, Message, Reply, StepResult, user

PLAYER = 0  # the model: the only player of a single-player game
# textarena's games draw from the process-wide `random` module (their reset seeds it), and the
# episodes of a group call reset and step at once, each on its own thread. So each game keeps
# its own generator state and swaps it in under this lock: a game depends on its seed alone.
GLOBAL_RANDOM = threading.Lock()


class TextArenaGame(Env):
    """One game of `game_id` (a textarena id, e.g. "Mastermind-v0"), seeded by `seed`."""

    def __init__(self, game_id: str, seed: int) -> None:
        # (2) "-raw" is the game without textarena's observation wrappers, which re-send the whole
        # history every turn. The action wrapper adds the [brackets] a move needs, if left out.
        self.game = textarena.wrappers.ActionFormattingWrapper(textarena.make(f"{game_id}-raw"))
        self.seed = seed
        self.random_state = random.Random(seed).getstate()

    def reset(self) -> list[Message]:
        self._seeded(lambda: self.game.reset(num_players=1, seed=self.seed))  # (1)
        return [user(self._new_text())]

    def step(self, reply: Reply) -> StepResult:
        done, _ = self._seeded(lambda: self.game.step(reply.content))
        if not done:  # the game's answer: feedback, a new board, or a warning about an invalid move
            return StepResult([user(self._new_text())])
        rewards, game_info = self.game.close()  # (3)
        reward = float(rewards[PLAYER])
        return StepResult(reward=reward, done=True,
                          info={"success": reward >= 1.0, "reason": game_info[PLAYER].get("reason", "")})

    def _new_text(self) -> str:
        """(2) What the game said since the last call (textarena hands each message out once),
        less the echo of the model's own move, which is already in the conversation."""
        _, observations = self.game.get_observation()
        return "\n".join(text for _, text, kind in observations
                         if kind is not textarena.ObservationType.PLAYER_ACTION)

    def _seeded(self, call: Callable[[], Any]) -> Any:
        """(1) Run `call` on this game's own random state, leaving the process's as it was."""
        with GLOBAL_RANDOM:
            outer = random.getstate()
            random.setstate(self.random_state)
            try:
                return call()
            finally:
                self.random_state = random.getstate()
                random.setstate(outer)


def game(game_id: str) -> Callable[[int, str], TextArenaGame]:
    """The factory of one textarena game, for `env = "examples.textarena_env:<name>"`."""

    def factory(index: int, split: str) -> TextArenaGame:
        # (1) train games have even seeds, held-out games odd ones: the splits never share a game
        return TextArenaGame(game_id, 2 * index + int(split == "eval"))

    return factory


make = game("GuessTheNumber-v0")  # 1 to 20 in 10 guesses, told "higher" or "lower"
tower_of_hanoi = game("TowerOfHanoi-v0")  # 3 disks in 14 moves
mastermind = game("Mastermind-v0")  # a 4-digit code in 20 guesses, told black and white pegs
