"""The environment interface: what a user writes to train an agent.

One episode is a conversation. The environment opens it (`reset` returns the first messages),
the model replies (a reply may call tools), and the environment answers (`step` returns the
next messages) or ends the episode with a reward. Tools are plain typed Python functions with
docstrings, listed in `Env.tools`; lora-async describes them to the model, parses the calls
from the reply, runs them in a guarded worker and feeds the results back before `step` is
called, so an environment only decides what the conversation means.

    def calculate(expression: str) -> str:
        '''Evaluate an arithmetic expression.

        Args:
            expression: digits and + - * / ( ), e.g. "12 * (3 + 4)"
        '''
        ...

    class Multiply(Env):
        tools = [calculate]

        def __init__(self, a: int, b: int) -> None:
            self.answer = a * b
            self.question = f"What is {a} * {b}?"

        def reset(self) -> list[Message]:
            return [user(self.question)]

        def step(self, reply: Reply) -> StepResult:
            if reply.tool_calls:        # the results are already in the conversation
                return StepResult()
            return StepResult(reward=float(reply.final_number() == self.answer), done=True)

    def make(index: int, split: str) -> Multiply:     # `env = "my_env:make"` in the TOML
        rng = random.Random(f"{split}:{index}")
        return Multiply(rng.randint(10, 99), rng.randint(10, 99))

The factory is called with `(index, split)`; `split` is "train" or "eval". It must be a pure
function of its arguments: every episode of a GRPO group is built from the same index and must
open the same way, and a resumed run rebuilds the same problems. `reset` and `step` may be
plain or `async` methods.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, ClassVar, Literal, Protocol, Union

Message = dict[str, Any]  # {"role": "system" | "user" | "assistant" | "tool", "content": str, ...}
Split = Literal["train", "eval"]
NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


def user(content: str) -> Message:
    return {"role": "user", "content": content}


def system(content: str) -> Message:
    return {"role": "system", "content": content}


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: a tool name and its JSON arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolResult:
    call: ToolCall | None  # None: the call could not be parsed
    content: str  # what the model sees: the tool's return value, or an error message
    error: bool = False


@dataclass(frozen=True)
class Reply:
    """What the model said in one turn."""

    text: str  # the whole reply, decoded (tool-call markup included)
    content: str  # the reply without tool-call markup
    tool_calls: list[ToolCall]
    tool_results: list[ToolResult]  # already answered, in call order (malformed calls included)
    turn: int  # 1 for the first reply
    truncated: bool = False  # the reply hit the turn's token limit

    def final_number(self) -> float | int | None:
        """The last number in the reply text (commas ignored), or None."""
        found = NUMBER_RE.findall(self.content.replace(",", ""))
        if not found:
            return None
        value = float(found[-1])
        return int(value) if value.is_integer() else value


@dataclass
class StepResult:
    """The environment's answer to a reply."""

    messages: list[Message] = field(default_factory=list)  # appended to the conversation
    reward: float = 0.0  # the episode's reward (read when done)
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)  # e.g. {"success": True}; goes to user rewards


class Env:
    """Base class of an environment (subclassing is optional: any object with `reset`, `step`
    and an optional `tools` list fits)."""

    tools: ClassVar[list[Callable[..., Any]]] = []

    def reset(self) -> Union[list[Message], Awaitable[list[Message]]]:
        """The opening messages (a system message here replaces the task's system prompt)."""
        raise NotImplementedError

    def step(self, reply: Reply) -> Union[StepResult, Awaitable[StepResult]]:
        """Answer one reply, or end the episode (`done=True`) with its reward."""
        raise NotImplementedError


class EnvLike(Protocol):
    """What a run calls on an environment: an `Env`, or any object with these methods (`check_env`)."""

    def reset(self) -> Union[list[Message], Awaitable[list[Message]]]: ...

    def step(self, reply: Reply) -> Union[StepResult, Awaitable[StepResult]]: ...


EnvFactory = Callable[[int, Split], EnvLike]


def check_env(env: object, where: str) -> None:
    """Raise TypeError (one line, naming `where`) if `env` does not fit the interface."""
    missing = [name for name in ("reset", "step") if not callable(getattr(env, name, None))]
    if missing:
        raise TypeError(f"{where} returned a {type(env).__name__}, which has no {' or '.join(missing)} method")
    tools = getattr(env, "tools", [])
    if not isinstance(tools, (list, tuple)) or not all(callable(t) for t in tools):
        raise TypeError(f"{where}: {type(env).__name__}.tools must be a list of functions")
