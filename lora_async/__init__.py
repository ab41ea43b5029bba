"""lora-async: a LoRA-first, lightweight, asynchronous RL trainer for language models."""

__version__ = "0.1.0"
