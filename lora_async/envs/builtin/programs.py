"""Questions whose programs need a loop: primes below n, divisors of n, the sum of a range, the
multiples of k up to n, with the sandbox's `run_python` tool. The embedded 135M model cannot
answer them in its head; it has to write a program with a loop (a generator over a `range`) for
a question worded unlike the two worked examples it is shown, and answer with what it printed.

The opening shows two worked examples of the question's own kind (a call with the program, the
tool's answer, the final number), then asks the question in other words. The reward is 1 for
the right final number, whatever the route. Held-out problems are a fixed share of each kind's
draws (a hash of the question), never drawn for training; the kinds take turns by index.

Measured on the base model (100 held-out problems, greedy, 64 tokens a reply): success 0.32,
78% of the episodes call the tool. By kind (40 each): the sum of a range 0.78, divisors 0.33,
primes 0.00 (the number goes into both ranges of the example's program), multiples 0.00
(`sum(i for ...)` instead of counting). With the question worded as in the examples the base
model already scores 0.62; with one worked example and a free rewording, 0.02.

    [task]
    type = "env"
    env = "lora_async.envs.builtin.programs:make"
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from typing import Any, Callable

from ..base import Message, user
from .question import ToolQuestion
from .sandbox import run_python

HELDOUT_PERCENT = 30
SYSTEM = ("Use Python for any computation: call run_python with a program that prints the result, then reply "
          "with only the final number.")


def is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n ** 0.5) + 1))


@dataclass(frozen=True)
class Kind:
    """One kind of question: how it is drawn, asked in the example and in the task, solved."""

    name: str
    draw: Callable[[random.Random], tuple[int, ...]]
    example: str  # the worked example's wording
    question: str  # the task's wording (unlike the example's)
    program: str  # the worked example's program
    answer: Callable[..., int]


KINDS = (
    Kind("primes_below", lambda r: (r.randint(30, 400),),
         "How many primes are there below {0}?", "How many primes are smaller than {0}?",
         "print(sum(all(k % d for d in range(2, k)) for k in range(2, {0})))",
         lambda n: sum(is_prime(k) for k in range(2, n))),
    Kind("divisors", lambda r: (r.randint(60, 3000),),
         "How many divisors does {0} have?", "How many divisors has the number {0}?",
         "print(sum({0} % d == 0 for d in range(1, {0} + 1)))",
         lambda n: sum(n % d == 0 for d in range(1, n + 1))),
    Kind("range_sum", lambda r: (r.randint(2, 60), r.randint(100, 900)),
         "What is the sum of the integers from {0} to {1}?", "What is the sum of the numbers from {0} to {1}?",
         "print(sum(range({0}, {1} + 1)))", lambda a, b: sum(range(a, b + 1))),
    Kind("multiples", lambda r: (r.randint(100, 999), r.randint(3, 9)),
         "How many numbers from 1 to {0} are multiples of {1}?", "How many multiples of {1} are there from 1 to {0}?",
         "print(sum(1 for i in range(1, {0} + 1) if i % {1} == 0))", lambda n, k: n // k),
)
# The worked example of each kind: fixed numbers, never asked.
EXAMPLE_ARGS: dict[str, list[tuple[int, ...]]] = {"primes_below": [(50,), (120,)], "divisors": [(84,), (1000,)],
                "range_sum": [(3, 120), (17, 450)], "multiples": [(200, 7), (640, 3)]}


def call(program: str) -> str:
    return '<tool_call>' + json.dumps({"name": "run_python", "arguments": {"code": program}}) + '</tool_call>'


def is_heldout(kind: Kind, args: tuple[int, ...]) -> bool:
    digest = hashlib.blake2s(f"{kind.name}:{args}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % 100 < HELDOUT_PERCENT


class LoopQuestion(ToolQuestion):
    """One question; the episode ends with the first reply that calls no tool."""

    tools = [run_python]

    def __init__(self, kind: Kind, args: tuple[int, ...]) -> None:
        super().__init__()
        self.kind, self.args = kind, args
        self.answer = kind.answer(*args)

    def reset(self) -> list[Message]:
        kind = self.kind
        example = [m for shown in EXAMPLE_ARGS[kind.name] for m in (
                   user(kind.example.format(*shown)),
                   {"role": "assistant", "content": call(kind.program.format(*shown))},
                   {"role": "tool", "content": str(kind.answer(*shown))},
                   {"role": "assistant", "content": str(kind.answer(*shown))})]
        return [{"role": "system", "content": SYSTEM}, *example, user(kind.question.format(*self.args))]

    def details(self) -> dict[str, Any]:
        return {"kind": self.kind.name}


def make(index: int, split: str) -> LoopQuestion:
    """Problem `index` of the split: the kinds in turn, each drawn from a seed of the index (a
    pure function of its arguments)."""
    kind = KINDS[index % len(KINDS)]
    rng = random.Random(f"programs:{split}:{index}")
    while True:
        args = kind.draw(rng)
        if is_heldout(kind, args) == (split == "eval") and args not in EXAMPLE_ARGS[kind.name]:
            return LoopQuestion(kind, args)
