"""Writes examples/data/code_tests.jsonl: short Python function problems for the `code_tests`
reward (examples/code_tests.toml). Deterministic, standard library only, no network:

    python examples/data/make_code_tests.py

Each record is {"prompt": ..., "answer": <a reference solution>, "tests": [<3-5 asserts>]}; the
asserts run after the model's program, in its namespace. Every problem is a one-line function,
and they come in families: the same function with different constants (`count_above_5(items)`,
`count_above_2(items)`, ...). The last HELDOUT records of the file (the config's `heldout`) are
further members of the same families, never trained on.

Two kinds of family. The embedded SmolLM2-135M-Instruct writes the plain ones (`x * 3 + 1`,
`n % 4 == 0`) right with greedy decoding already; they keep the fenced-code format rewarded. On
most of the others its greedy answer is wrong in the same way for every member (`x + 3` for "x
squared plus 3", `len(s) % 2 == 0` for "how many times 'a' appears", `x <= 2 and x >= 30` for
"between 2 and 30"), while some of its samples at temperature 1 are right (0-19% of them,
family by family; a sample that passes part of the tests scores that part): RL has something to
reinforce, and the held-out members show whether it carried over. (Problems as plain as
`add(a, b)`, `is_even(n)` or `reverse_string(s)` are solved greedily ~0.9 of the time, which
leaves an evaluation nothing to show.)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).with_name("code_tests.jsonl")

SYMBOLS = {"-": "dashes", ",": "commas", " ": "spaces", "+": "plus", ";": "semicolons", "|": "bars",
           ":": "colons", "/": "slashes"}


def literal(test: str) -> str:
    """`assert f(5) == 5 + 7` as `assert f(5) == 12`: the expected side of a test, worked out."""
    if " == " not in test:
        return test
    call, expected = test.split(" == ")
    return f"{call} == {eval(expected)!r}"  # noqa: S307 - our own constant expressions


def check(rec: dict) -> None:
    """The reference solution passes its own tests (the generator's self-test)."""
    namespace: dict = {}
    exec(rec["answer"], namespace)  # noqa: S102 - our own reference code
    for test in rec["tests"]:
        exec(test, namespace)  # noqa: S102


class Family:
    """One function shape: `name(args)` that `says`, solved by `return body`; every text is a
    format string over a member's constants ({k}, or {a} and {b}; {sym}: the name of {k})."""

    def __init__(self, members: list, heldout: int, name: str, args: str, says: str, body: str,
                 tests: list[str]) -> None:
        self.members, self.heldout = members, heldout
        self.name, self.args, self.says, self.body, self.tests = name, args, says, body, tests

    def records(self) -> tuple[list[dict], list[dict]]:
        """(training records, held-out records): the last `heldout` members are held out."""
        out = []
        for member in self.members:
            values = dict(member) if isinstance(member, dict) else {"k": member}
            values.setdefault("sym", SYMBOLS.get(str(values.get("k")), ""))
            name = self.name.format(**values)
            fill = lambda text: text.replace("{f}", name).format(**values)  # noqa: E731
            out.append({"prompt": f"Write a Python function `{name}({self.args})` that {fill(self.says)}.",
                        "answer": f"def {name}({self.args}):\n    return {fill(self.body)}\n",
                        "tests": [literal(fill(test)) for test in self.tests]})
        cut = len(out) - self.heldout
        return out[:cut], out[cut:]


AB = [dict(a=2, b=3), dict(a=3, b=1), dict(a=5, b=2), dict(a=4, b=7), dict(a=6, b=5), dict(a=2, b=9),
      dict(a=7, b=4), dict(a=3, b=8)]
RANGES = [dict(a=2, b=30), dict(a=3, b=10), dict(a=5, b=20), dict(a=0, b=9), dict(a=1, b=50),
          dict(a=10, b=40), dict(a=4, b=70), dict(a=6, b=12)]

# Plain families: solved greedily by the base model. Four members trained on, one held out.
PLAIN = [
    Family(AB[:5], 1, "scale_{a}_plus_{b}", "x", "returns x times {a} plus {b}", "x * {a} + {b}",
           ["assert {f}(0) == {b}", "assert {f}(1) == {a} + {b}", "assert {f}(10) == 10 * {a} + {b}"]),
    Family([3, 4, 5, 7, 6], 1, "divisible_by_{k}", "n", "returns True if n is divisible by {k}, else False",
           "n % {k} == 0",
           ["assert {f}({k} * 3)", "assert not {f}({k} + 1)", "assert {f}(0)", "assert not {f}(1)"]),
    Family([1, 3, 5, 10, 2], 1, "add_{k}_to_each", "items",
           "returns a new list with {k} added to every number in the list items", "[x + {k} for x in items]",
           ["assert {f}([1, 2, 3]) == [1 + {k}, 2 + {k}, 3 + {k}]", "assert {f}([]) == []",
            "assert {f}([0]) == [{k}]"]),
    Family([3, 5, 10, 0, 7], 1, "distance_to_{k}", "x",
           "returns the distance between x and {k} (the absolute value of x minus {k})", "abs(x - {k})",
           ["assert {f}({k}) == 0", "assert {f}({k} + 4) == 4", "assert {f}({k} - 6) == 6"]),
]

# Families with room to learn: greedy gets them wrong, sampling sometimes right. Six members
# trained on, two held out.
HARD = [
    Family([1, 3, 5, 10, 2, 7, 4, 6], 2, "square_plus_{k}", "x", "returns x squared plus {k}",
           "x * x + {k}",
           ["assert {f}(0) == {k}", "assert {f}(3) == 9 + {k}", "assert {f}(-2) == 4 + {k}"]),
    Family(AB, 2, "plus_{a}_times_{b}", "x", "adds {a} to x and then multiplies the result by {b}",
           "(x + {a}) * {b}",
           ["assert {f}(0) == {a} * {b}", "assert {f}(1) == (1 + {a}) * {b}", "assert {f}(-{a}) == 0"]),
    Family(["a", "e", "o", "s", "t", "i", "n", "r"], 2, "count_{k}", "s",
           "returns how many times the letter '{k}' appears in the string s", "s.count('{k}')",
           ["assert {f}('') == 0", "assert {f}('{k}x{k}') == 2", "assert {f}('{k}{k}{k}') == 3",
            "assert {f}('xyz') == 0"]),
    Family([0, 2, 5, 10, 1, 3, 4, 7], 2, "count_above_{k}", "items",
           "returns how many numbers in the list items are greater than {k}", "sum(1 for x in items if x > {k})",
           ["assert {f}([{k}, {k} + 1, {k} - 1, {k} + 5]) == 2", "assert {f}([]) == 0",
            "assert {f}([{k} + 3]) == 1"]),
    Family([1, 2, 3, 4, 5, 0, 6, 10], 2, "sum_from_{k}", "n",
           "returns the sum of the integers from {k} to n, including both", "sum(range({k}, n + 1))",
           ["assert {f}({k}) == {k}", "assert {f}(10) == sum(range({k}, 11))", "assert {f}({k} + 1) == 2 * {k} + 1"]),
    Family(["-", ",", " ", "+", ";", "|", ":", "/"], 2, "join_with_{sym}", "items",
           "returns the strings in the list items joined together with \"{k}\" between them", "'{k}'.join(items)",
           ["assert {f}(['a', 'b', 'c']) == 'a{k}b{k}c'", "assert {f}([]) == ''", "assert {f}(['x']) == 'x'"]),
    Family(RANGES, 2, "between_{a}_and_{b}", "x", "returns True if x is at least {a} and at most {b}, else False",
           "{a} <= x <= {b}",
           ["assert {f}({a})", "assert {f}({b})", "assert not {f}({a} - 1)", "assert not {f}({b} + 1)"]),
    Family([3, 5, 7, 0, 1, 2, 4, 9], 2, "contains_{k}", "items",
           "returns True if the number {k} is in the list items, else False", "{k} in items",
           ["assert {f}([1, {k}, 9 + {k}])", "assert not {f}([])", "assert not {f}([{k} + 1])",
            "assert {f}([{k}])"]),
]


def build() -> tuple[list[dict], list[dict]]:
    train, heldout = [], []
    for family in PLAIN + HARD:
        trained, held = family.records()
        train += trained
        heldout += held
    for rec in train + heldout:
        check(rec)
    prompts = [r["prompt"] for r in train + heldout]
    assert len(set(prompts)) == len(prompts), "duplicate problems"
    # A fixed shuffle within each part; the held-out records stay at the end of the file.
    random.Random(0).shuffle(train)
    random.Random(1).shuffle(heldout)
    return train, heldout


def main() -> None:
    train, heldout = build()
    with OUT.open("w") as f:
        for rec in train + heldout:
            f.write(json.dumps(rec) + "\n")
    print(f"wrote {OUT}: {len(train)} training and {len(heldout)} held-out problems "
          f"(task.heldout = {len(heldout)}: the last {len(heldout)} lines)")


if __name__ == "__main__":
    main()
