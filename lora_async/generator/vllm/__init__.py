"""Everything that touches vLLM itself: `compat` (every internal used, checked for one vLLM
version), `worker` (the extension mixed into vLLM's worker), `hotswap` (how it registers versions:
vLLM's own build, or a retired version's LoRAModel refilled in place), `client` (the typed handle the
generator drives the engine through) and `cpu_lora_ops` (faster CPU LoRA kernels)."""
