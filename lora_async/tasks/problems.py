"""The problem-set interface of single-turn tasks, and chat-template rendering."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import UserError
from ..rewards import Batch, Prompt, Rewards
from ..rollout import RewardStats  # the counters every rollout source keeps (re-exported: tasks.RewardStats)
from ..tokenizer import Tokenizer, token_ids


class TaskDataError(UserError, ValueError):
    """A task's data that cannot be used as configured: a missing split or column, a library
    that is not installed, a generator setting it refuses, a bad JSONL record. One line naming
    the dotted field (or the file and line); `train` exits with code 2 (the preflight finds most,
    before any model loads)."""


@dataclass(frozen=True)
class Problem:
    index: int  # position in the training stream (or in the held-out list)
    prompt: Prompt  # the user message, or a chat (a record whose prompt is a list of messages)
    answer: str  # the reference the reward compares against
    # The record's other fields (JSONL tasks), passed to user rewards by name. Left out of the
    # hash, which a dict cannot take part in.
    fields: dict[str, Any] = field(default_factory=dict, hash=False)

    def batch(self, completions: list[str], completion_ids: list[list[int]] | None = None) -> Batch:
        """Completions of this problem, as its rewards score them."""
        return Batch(self.prompt, self.answer, completions, completion_ids or [], self.fields)

    @property
    def text(self) -> str:
        """The prompt for display: the text, or a chat's last user message."""
        if isinstance(self.prompt, str):
            return self.prompt
        return next((m.get("content", "") for m in reversed(self.prompt) if m.get("role") == "user"), "")


class Task(Protocol):
    name: str
    system_prompt: str | None
    stats: RewardStats

    def train_problem(self, index: int) -> Problem:
        """The index-th training problem; the same for the same seed and index."""

    def heldout(self) -> list[Problem]:
        """The fixed evaluation split; never returned by train_problem."""

    def describe(self) -> str:
        """One startup line: what the task is and which fields its reward gets."""

    @property
    def rewards(self) -> Rewards:
        """The task's reward functions (`rewards.Rewards`): `await rewards.score(problem.batch(...))`.
        Never raises: failures score 0 and count in `stats`."""

    def close(self) -> None: ...


def render_prompt(tokenizer: Tokenizer, prompt: Prompt, system_prompt: str | None) -> list[int]:
    """Token ids of the chat-formatted prompt, ending where the assistant starts. A chat prompt
    keeps its own system message, if it has one."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt is not None and not any(m.get("role") == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    if getattr(tokenizer, "chat_template", None):
        return token_ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    text = "\n\n".join(m["content"] for m in messages) + "\n"
    return list(tokenizer(text)["input_ids"])
