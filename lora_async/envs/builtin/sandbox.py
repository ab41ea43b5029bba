"""Multiplication with a Python tool: the calculator's problem (2-digit products, which the
embedded 135M model cannot work out in its head), with a code interpreter as the tool. The
model writes a program in a `run_python` call; it runs in the sandbox (`lora_async.sandbox`: a
fresh interpreter in its own namespaces, with CPU, memory, file-size and wall-clock limits, no
processes, no network, nothing of the host but the interpreter to read, and a small tmpfs to
write), and what it prints is the tool's answer. A
program that fails (an exception, a limit, a refused operation) comes back as a tool error
with its traceback and the reason, so the model can try again.

The opening shows two worked examples, written "What is a * b?" (a call, the tool's answer, the
final number), then asks "Compute a times b." The reward is 1 for the right final number,
whatever the route; RL has to learn to write the program for the new wording and to copy its
result. Held-out problems are a fixed share of all pairs (a hash of the pair), never drawn for
training.

Measured on the base model (24 held-out problems, 2 CPU cores): greedy success 0.12; 62% of
the episodes call the tool, but with a bare expression (`"code": "73 * 50"`), which prints
nothing, and then echo the tool's "(no output: print the result)". Sampled, 8 per problem: 8%
success and 37% of the episodes call the tool at temperature 0.7; 1% and 13% at 1.0. What RL
has to find is `print(a * b)`: `examples/sandbox.toml` goes from 0.09 to 1.00 held-out greedy
success (32 problems) in 7 steps, 10.6 minutes with engine start.

    [task]
    type = "env"
    env = "lora_async.envs.builtin.sandbox:make"
"""

from __future__ import annotations

from ...sandbox import KB, MB, SandboxLimits, run_python as run_sandboxed, sandboxed
from .calculator import Multiply, draw

# The tool's limits. A product takes milliseconds; anything near these is a mistake. The wall
# limit stays under `task.tool_timeout_s` (10 s by default), so the sandbox, not the toolbox,
# cuts a hung program off, and the model reads why.
CPU_S = 2
WALL_S = 5.0
MEMORY_MB = 256
FILE_KB = 64
OUTPUT_CHARS = 2000  # of each stream: a reply's context is short
LIMITS = SandboxLimits(cpu_s=CPU_S, wall_s=WALL_S, memory_bytes=MEMORY_MB * MB, file_bytes=FILE_KB * KB,
                       output_chars=OUTPUT_CHARS)


class ProgramError(RuntimeError):
    """The program failed; the message (reason, output, traceback) is what the model reads."""


@sandboxed
def run_python(code: str) -> str:
    """Run a Python program and return what it prints.

    Args:
        code: a Python program that prints its result, e.g. "print(12 * 34)"
    """
    result = run_sandboxed(code, limits=LIMITS)  # the run's task.sandbox, through the worker's environment
    if not result.ok:
        raise ProgramError(result.text())  # the toolbox hands it back as "error: ..." and counts it
    return result.text()


class Program(Multiply):
    tools = [run_python]
    SYSTEM = ("Use Python for arithmetic: call run_python with a program that prints the result, then reply "
              "with only the final number.")
    CALL = '<tool_call>{"name": "run_python", "arguments": {"code": "print(%d * %d)"}}</tool_call>'


def make(index: int, split: str) -> Multiply:
    """Problem `index` of the split: a pure function of its arguments."""
    return draw(Program, "sandbox", index, split)
