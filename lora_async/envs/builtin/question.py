"""A question answered with tools (the calculator, sandbox and programs environments): the
model may call tools for as many turns as the episode allows, and the episode ends with the
first reply that calls none. The reward is 1 for the right final number, whatever the route."""

from __future__ import annotations

from typing import Any

from ..base import Env, Reply, StepResult


class ToolQuestion(Env):
    """A subclass sets `answer` and may add to the episode's `info` (`details`)."""

    answer: int

    def __init__(self) -> None:
        self.calls = 0

    def details(self) -> dict[str, Any]:
        return {}

    def step(self, reply: Reply) -> StepResult:
        if reply.tool_calls or any(r.call is None for r in reply.tool_results):
            self.calls += len(reply.tool_calls)
            return StepResult()  # the results (or the parse errors) are the next message
        right = reply.final_number() == self.answer
        return StepResult(reward=float(right), done=True,
                          info={"success": right, "answer": self.answer, "used_tool": self.calls > 0,
                                **self.details()})
