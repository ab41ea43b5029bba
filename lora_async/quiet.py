"""The start-up chatter of the libraries lora-async drives (vLLM, Triton, torch, transformers,
bitsandbytes), hidden unless `run.engine_log = true`.

Only progress bars, library warnings and INFO/WARNING log lines are silenced; errors stay
visible. A user's own setting of any of these environment variables wins. Call it before
torch is imported (the CLI does), since some of them are read once, at import.
"""

from __future__ import annotations

import logging
import os
import warnings

QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",  # vLLM's own logger (engine processes inherit it)
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' "Loading weights" bars
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # torch's C++ warnings (vLLM's CPU worker: "NUMA binding ...")
    # child processes (an engine core of its own, `vllm serve`) do not inherit warning filters
    "PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning",
}
NOISY_MODULES = r"(vllm|triton|torch|transformers|peft|bitsandbytes|pydantic)(\..*)?$"
# bitsandbytes: "Failed to load CPU gemm_4bit_forward from kernels-community"; vllm: warnings logged
# at import, before vLLM configures its own logging from VLLM_LOGGING_LEVEL ("Triton is installed ...")
QUIET_LOGGERS = ("bitsandbytes", "vllm")


def quiet_start(engine_log: bool) -> None:
    if engine_log:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        return
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    for category in (FutureWarning, DeprecationWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category, module=NOISY_MODULES)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
