"""The reasoning-gym task: procedural problems of reasoning-gym datasets, scored by their own scorers.

reasoning-gym (the `tasks` extra, imported only here and only when a run asks for it) generates
each dataset's entries from a seed and an index: `{question, answer, metadata}`. This module
owns which entry is a run's training problem `index`, the held-out split, and how a completion
becomes the answer a dataset's `score_answer` reads.

- Training: problem `index` draws a dataset by weight, then an entry of it, both from a random
  generator seeded by (run seed, index): the same problem for the same seed and index, so a
  resumed run goes on where it stopped. Training datasets are created with the run seed and
  `size` entries (their own `size` setting, else `TRAIN_SIZE`); entries repeat only by chance.
- Held-out: `heldout` distinct questions drawn by weight from the same datasets created with
  `heldout_seed` (entries taken in order). A training draw whose question is held out is
  skipped (the next draw of the same generator is taken), so no held-out question is trained on.
- Scoring: the answer read from a completion (`extract_answer`) and the entry, rebuilt from the
  problem (question, answer, and the metadata carried in `Problem.fields`), go to the
  `score_answer` of the dataset that made it (`ReasoningGymScorer`, a `rewards.RewardFunction`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import random
import re
from types import ModuleType
from typing import Any, Sequence

from ..config import ReasoningGymDataset, ReasoningGymTask
from ..errors import error_line
from ..guarded import call_guarded
from ..rewards import Batch, Rewards
from ..rewards.functions import FunctionScores, checked
from .problems import Problem, RewardStats, TaskDataError

# Entries a training dataset is created with when its settings do not say `size`. Most datasets
# make entry i from `Random(seed + i)` on demand, so this is only a range to draw from; a few
# build their entries up front (acre) or cap `size` (word_ladder at 20,000).
TRAIN_SIZE = 10_000
# Training draws of one index that may land on held-out questions before it gives up: only a
# problem space that the held-out split nearly covers gets there (lower `task.heldout`).
MAX_DRAWS = 1_000
# Held-out draws per wanted problem at most: small problem spaces run out of distinct questions,
# and the split is then smaller than `heldout` (`describe` says how large it is).
HELDOUT_TRIES = 20
# Settings lora-async sets itself: the seed is the run's (training) or `heldout_seed` (held-out).
OWN_SETTINGS = ("seed",)
# A label before the answer on the last line, removed by extract="last_line": the line's start
# up to the first "is" or colon after the word "answer" ("Answer: 7", "The final answer to the
# problem is 7."; small models answer in such sentences). It needs the word "answer" and then a
# colon or "is", so an answer that is the word "answer" stays.
ANSWER_LABEL = re.compile(r"^[^\n]*?\banswer\b[^:\n]*?(?:\bis\b\s*:?|:)\s*", re.IGNORECASE)
INSTALL_HINT = "pip install 'lora-async[tasks]'"


def extract_answer(completion: str, extract: str, tag: str = "answer") -> str:
    """What the scorer reads of a completion:
    - "last_line": its last non-empty line, stripped; a line that labels its answer ("Answer: X",
      "The final answer to the problem is X.") gives only X, without the sentence's final period;
    - "tag": the text inside its last <tag>...</tag>, stripped ("" when there is none);
    - "full": all of it, stripped."""
    if extract == "full":
        return completion.strip()
    if extract == "tag":
        found = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", completion, re.DOTALL)
        return found[-1].strip() if found else ""
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    if not lines:
        return ""
    answer, labelled = ANSWER_LABEL.subn("", lines[-1], count=1)
    answer = answer.strip()
    return answer[:-1].rstrip() if labelled and answer.endswith(".") else answer


def default_system_prompt(extract: str, tag: str) -> str:
    """A system message asking for the answer in the form `extract` reads."""
    if extract == "tag":
        return f"Give the final answer inside <{tag}></{tag}>, for example <{tag}>42</{tag}>."
    if extract == "full":
        return "Reply with only the final answer."
    return "Give only the final answer on the last line."


def load_library(where: str) -> ModuleType:
    """reasoning-gym, or a `TaskDataError` saying how to install it."""
    try:
        import reasoning_gym
    except ImportError:
        raise TaskDataError(f'{where}.type = "reasoning-gym" needs reasoning-gym: {INSTALL_HINT}') from None
    return reasoning_gym


def dataset_names(library: ModuleType) -> list[str]:
    return sorted(library.factory.DATASETS)


def create_dataset(library: ModuleType, name: str, spec: ReasoningGymDataset, seed: int, where: str,
                   size: int | None = None) -> Any:
    """One dataset with its settings; an unknown name or setting, or a setting it refuses, is a
    `TaskDataError` naming `{where}.datasets.<name>[.<setting>]`."""
    field = f"{where}.datasets.{name}"
    names = dataset_names(library)
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
        hint = f" (did you mean {' or '.join(close)}?)" if close else " (reasoning_gym.factory.DATASETS lists them)"
        raise TaskDataError(f"{field}: not a reasoning-gym dataset{hint}")
    settings = spec.settings
    config_cls = library.factory.DATASETS[name][1]
    known = [f.name for f in dataclasses.fields(config_cls)]
    for key in settings:
        if key in OWN_SETTINGS:
            raise TaskDataError(f"{field}.{key}: set by lora-async (run.seed for training, {where}.heldout_seed "
                                "for held-out problems); remove it")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else "its settings: " + ", ".join(k for k in known
                                                                                          if k not in OWN_SETTINGS)
            raise TaskDataError(f"{field}.{key}: not a setting of {name} ({hint})")
    kwargs = {"size": TRAIN_SIZE, **settings} if size is None else {**settings, "size": size}
    try:
        return library.create_dataset(name, seed=seed, **kwargs)
    except Exception as exc:  # the dataset's own validation: AssertionError, ValueError, TypeError...
        raise TaskDataError(f"{field}: {error_line(exc)}") from None


def check_reasoning_gym(config: ReasoningGymTask, where: str) -> None:
    """Before any model loads: reasoning-gym is installed, every name is one of its datasets, and
    each dataset takes its settings and makes a problem with them (`TaskDataError` otherwise)."""
    library = load_library(where)
    for name, spec in config.datasets.items():
        dataset = create_dataset(library, name, spec, 0, where, size=1)  # one problem is made, not `size`
        try:
            # The size a run uses, checked by the config alone (word_ladder caps it); building that
            # many can take minutes (acre makes its entries up front).
            settings = library.factory.DATASETS[name][1](**{"size": TRAIN_SIZE, **spec.settings})
            if hasattr(settings, "validate"):
                settings.validate()
            dataset[0]
        except Exception as exc:
            raise TaskDataError(f"{where}.datasets.{name}: {error_line(exc)}") from None


class ReasoningGymScorer:
    """`rewards.RewardFunction`: each completion scored by the `score_answer` of the dataset that
    made its problem, on a thread of its own (`guarded.call_guarded`: scorers are plain Python,
    some slow), so the event loop goes on and one scorer never waits behind another.
    A scorer that raises or runs past `timeout_s` scores 0 and its error is counted; an empty
    answer scores 0 without asking the scorer."""

    name = "reasoning_gym"

    def __init__(self, datasets: dict[str, Any], extract: str, tag: str, timeout_s: float) -> None:
        self.datasets, self.extract, self.tag, self.timeout_s = datasets, extract, tag, timeout_s
        self.spec = f"reasoning-gym (extract={extract})"

    def describe(self, fields: Sequence[str]) -> str:
        read = {"last_line": "the last non-empty line", "tag": f"the last <{self.tag}>...</{self.tag}>",
                "full": "the whole completion"}[self.extract]
        return f"reward: each dataset's score_answer reads {read}"

    async def score(self, batch: Batch) -> FunctionScores:
        outcomes = await asyncio.gather(*(self._one(batch, completion) for completion in batch.completions))
        values: list[float | None] = [value for value, _, _ in outcomes]
        return FunctionScores(values, [error for _, error, _ in outcomes],
                              timeouts=sum(timed_out for _, _, timed_out in outcomes))

    async def _one(self, batch: Batch, completion: str) -> tuple[float, str | None, bool]:
        """(score, error, timed out) of one completion."""
        answer = extract_answer(completion, self.extract, self.tag)
        if not answer:
            return 0.0, None, False
        name = str(batch.fields.get("dataset"))
        dataset = self.datasets.get(name)
        if dataset is None:
            return 0.0, f"{self.spec}: the problem names no dataset of this task ({name!r})", False
        entry = {"question": batch.prompt, "answer": batch.answer, "metadata": batch.fields.get("metadata", {})}
        # On a thread of its own: a scorer past its time runs on, and only its result is dropped.
        result = await call_guarded(dataset.score_answer, answer, entry, timeout_s=self.timeout_s,
                                    what=f"{name}.score_answer")
        if result.timed_out:
            return 0.0, f"{self.spec}: {name}.score_answer took over {self.timeout_s:g}s", True
        if not result.ok:
            raised = error_line(result.exception) if result.exception is not None else result.message
            return 0.0, f"{self.spec}: {name}.score_answer raised {raised}", False
        value, error = checked(f"{self.spec}: {name}.score_answer", result.value)
        return (0.0, error, False) if error is not None or value is None else (value, None, False)

    def close(self) -> None:
        pass


class ReasoningGymProblems:
    """`problems.Task` over the configured reasoning-gym datasets (see the module docstring)."""

    name = "reasoning-gym"

    def __init__(self, config: ReasoningGymTask, seed: int, where: str = "task") -> None:
        self.config, self.seed, self.where = config, seed, where
        library = load_library(where)
        self.names = list(config.datasets)
        self.weights = [config.datasets[n].weight for n in self.names]
        self.system_prompt: str | None = (config.system_prompt if config.system_prompt is not None
                                          else default_system_prompt(config.extract, config.tag))
        self.stats = RewardStats()
        self._train = {n: create_dataset(library, n, s, seed, where) for n, s in config.datasets.items()}
        held = {n: create_dataset(library, n, s, config.heldout_seed, where) for n, s in config.datasets.items()}
        self._heldout = self._draw_heldout(held)
        self._heldout_questions = {p.text for p in self._heldout}
        scorer = ReasoningGymScorer(self._train, config.extract, config.tag, config.reward_timeout_s)
        self.rewards = Rewards([scorer], None, self.stats)

    @staticmethod
    def _problem(index: int, name: str, entry: dict[str, Any]) -> Problem:
        return Problem(index, str(entry["question"]), str(entry["answer"]),
                       {"dataset": name, "metadata": entry.get("metadata", {})})

    def _draw_heldout(self, datasets: dict[str, Any]) -> list[Problem]:
        """`heldout` distinct questions, datasets drawn by weight, each dataset's entries in order."""
        rng = random.Random(f"heldout:{self.config.heldout_seed}")
        taken = dict.fromkeys(self.names, 0)
        found: list[Problem] = []
        seen: set[str] = set()
        for _ in range(self.config.heldout * HELDOUT_TRIES):
            if len(found) >= self.config.heldout:
                break
            open_names = [n for n in self.names if taken[n] < len(datasets[n])]
            if not open_names:
                break
            name = rng.choices(open_names, [self.config.datasets[n].weight for n in open_names])[0]
            entry = datasets[name][taken[name]]
            taken[name] += 1
            if entry["question"] not in seen:
                seen.add(entry["question"])
                found.append(self._problem(len(found), name, entry))
        return found

    def train_problem(self, index: int) -> Problem:
        rng = random.Random(f"{self.seed}:{index}")
        for _ in range(MAX_DRAWS):
            name = rng.choices(self.names, self.weights)[0]
            dataset = self._train[name]
            entry = dataset[rng.randrange(len(dataset))]
            if entry["question"] not in self._heldout_questions:
                return self._problem(index, name, entry)
        raise TaskDataError(f"{self.where}.heldout: training problem {index}: {MAX_DRAWS} draws in a row were "
                            f"held-out questions; the held-out split covers nearly all problems: lower {self.where}.heldout "
                            "or widen the datasets' settings")

    def heldout(self) -> list[Problem]:
        return list(self._heldout)

    def describe(self) -> str:
        parts = []
        for name, spec in self.config.datasets.items():
            settings = "".join(f", {k}={v!r}" for k, v in spec.settings.items())
            parts.append(f"{name} (weight {spec.weight:g}{settings})")
        return (f"reasoning-gym: {'; '.join(parts)}; {len(self._heldout)} held out (seed {self.config.heldout_seed}); "
                + self.rewards.describe([]))

    def close(self) -> None:
        self.rewards.close()
