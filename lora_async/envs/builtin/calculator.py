"""Multiplication with a calculator tool: a problem the embedded 135M model cannot solve in its
head (about 0.4% of its answers to "What is 59 * 63?" are right) but can with a tool.

The opening shows two worked examples, written "What is a * b?" (a call, the tool's answer, the
final number), then asks "Compute a times b." The reward is 1 for the right final number,
whatever the route; RL has to learn to call the tool with the right expression for the new
wording and to copy its result. Measured on the base model (24 held-out problems): greedy
success 0.42 (always with the tool); sampled at temperature 1, 7% success and 6% of episodes
call the tool. With the question worded like the examples, greedy success is already 1.0. Held-out problems are a fixed
share of all pairs (a hash of the pair), never drawn for training.

    [task]
    type = "env"
    env = "lora_async.envs.builtin.calculator:make"
"""

from __future__ import annotations

import ast
import hashlib
import operator
import random

from ..base import Message, user
from .question import ToolQuestion

LOW, HIGH = 10, 99  # operands: two digits
HELDOUT_PERCENT = 30
EXAMPLES = [(12, 34), (71, 26)]  # worked examples in every opening (with none, no reply calls the tool)
QUESTION = "Compute {a} times {b}."
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
MAX_DIGITS = 12  # larger operands are refused: the tool is for arithmetic, not a DoS


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / and parentheses, e.g. "12 * 34"
    """
    tree = ast.parse(expression.strip(), mode="eval")

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and len(str(node.value)) <= MAX_DIGITS:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    result = value(tree.body)
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def is_heldout(a: int, b: int) -> bool:
    digest = hashlib.blake2s(f"{a}*{b}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % 100 < HELDOUT_PERCENT


class Multiply(ToolQuestion):
    """A product to find with the tool; a subclass changes the tool, the system message and the
    worked examples' call (the sandbox environment)."""

    tools = [calculate]
    SYSTEM = "Use the calculator for arithmetic, then reply with only the final number."
    CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "%d * %d"}}</tool_call>'

    def __init__(self, a: int, b: int) -> None:
        super().__init__()
        self.a, self.b = a, b
        self.answer = a * b

    @classmethod
    def example(cls, a: int, b: int) -> list[Message]:
        return [user(f"What is {a} * {b}?"), {"role": "assistant", "content": cls.CALL % (a, b)},
                {"role": "tool", "content": str(a * b)}, {"role": "assistant", "content": str(a * b)}]

    def reset(self) -> list[Message]:
        shots = [m for pair in EXAMPLES for m in self.example(*pair)]
        return [{"role": "system", "content": self.SYSTEM}, *shots, user(QUESTION.format(a=self.a, b=self.b))]


def draw(kind: type[Multiply], name: str, index: int, split: str) -> Multiply:
    """Problem `index` of the split (`name` seeds the draw): a pure function of its arguments."""
    rng = random.Random(f"{name}:{split}:{index}")
    while True:
        a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
        if is_heldout(a, b) == (split == "eval") and (a, b) not in EXAMPLES:
            return kind(a, b)


def make(index: int, split: str) -> Multiply:
    """Problem `index` of the split: a pure function of its arguments."""
    return draw(Multiply, "calculator", index, split)
