"""Benchmarks behind `lora-async bench`: figures are recorded in bench/RESULTS.md."""
