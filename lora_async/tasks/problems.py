"""The problem-set interface of single-turn tasks, and chat-template rendering."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from ..rollout import RewardStats  # the counters every rollout source keeps (re-exported: tasks.RewardStats)


@dataclass(frozen=True)
class Problem:
    index: int  # position in the training stream (or in the held-out list)
    prompt: str  # the user message
    answer: str  # the reference the reward compares against
    # The record's other fields (JSONL tasks), passed to user rewards by name. Left out of the
    # hash, which a dict cannot take part in.
    fields: dict[str, Any] = field(default_factory=dict, hash=False)


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

    def rewards(self, problem: Problem, completions: list[str]) -> list[float]:
        """Score each completion of one problem. Never raises: failures score 0 and count."""

    def close(self) -> None: ...


def render_prompt(tokenizer: Any, prompt: str, system_prompt: str | None) -> list[int]:
    """Token ids of the chat-formatted prompt, ending where the assistant starts."""
    messages = [{"role": "user", "content": prompt}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    text = (f"{system_prompt}\n\n" if system_prompt else "") + prompt + "\n"
    return list(tokenizer(text)["input_ids"])
