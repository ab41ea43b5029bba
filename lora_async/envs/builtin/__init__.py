"""Environments that ship with lora-async; each has a config in examples/.

    calculator   2-digit multiplication with a `calculate` tool (tool use, 2-3 turns)
    guess        guess a number with higher/lower replies (feedback, long-tailed lengths)
"""
