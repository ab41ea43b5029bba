"""Everything that touches vLLM itself: `release` (the vLLM release this is written for, and
the check of the installed one), `compat` (every internal used, checked for one vLLM
version; the others import it, never the reverse), `worker` (the extension mixed into vLLM's
worker), `hotswap` (how it registers versions: vLLM's own build, or a retired version's
LoRAModel refilled in place), `swap_plans` (what the refill follows: where each tensor lands in
vLLM's LoRAModel and LoRA slots, learned once per structure), `piecewise` (the one copy into
a slot or a spare, scaled and checked piece by piece), `client` (the typed handle the generator
drives the engine through, and its receiver of versions) and `cpu_lora_ops` (faster CPU LoRA
kernels)."""
