"""Environments that ship with lora-async; each has a config in examples/.

    calculator   2-digit multiplication with a `calculate` tool (tool use, 2-3 turns)
    sandbox      the same with a `run_python` code interpreter (programs run in lora_async.sandbox)
    programs     questions whose programs need a loop (primes, divisors, ranges, multiples), same tool
    guess        guess a number with higher/lower replies (feedback, long-tailed lengths)
    nim          a two-seat game: Nim on small heaps, with scripted players (self-play, a league)
    relay        a cooperative two-seat game: one seat is told a number, the other must say it

`question.ToolQuestion` is what calculator, sandbox and programs share: a question answered with tools.
"""
