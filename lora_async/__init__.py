"""lora-async: a LoRA-first, lightweight, asynchronous RL trainer for language models.

    from lora_async import load_config, train

    summary = train(load_config("examples/arithmetic.toml", overrides={"run.max_steps": 2}))

`train` runs what `lora-async train` runs (`lora_async.api`); `TrainConfig` builds a config in code.
"""

from .api import train
from .config import ConfigError, TrainConfig, load_config

__version__ = "0.1.0"
__all__ = ["ConfigError", "TrainConfig", "load_config", "train", "__version__"]
