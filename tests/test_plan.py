"""The memory plan: parameter counts, the activation formula against the tensors autograd really
keeps, monotonicity, knobs, the CLI (`plan`, and `train`'s refusal before anything loads), and
the totals against measured peak RSS on the default model (slow)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lora_async.config import load_config
from lora_async.plan import GIB, Machine, ModelShape, PlanUnavailable, layout, load_shape, plan_run
from lora_async.plan.estimate import MAX_ROW_TOKENS, activation_bytes, learner_items
from lora_async.plan.knobs import find_knobs

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "model_configs"
TWO_24GB = Machine((24 * GIB,) * 2, 64 * GIB, hypothetical=True)


def fixture_shape(name: str) -> ModelShape:
    return ModelShape.from_config(json.loads((FIXTURES / name / "config.json").read_text()), name)


def config(*overrides: str):
    return load_config(None, list(overrides))


# ---------------------------------------------------------------- parameter counts


def test_param_count_matches_the_tiny_model(tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    real = sum(p.numel() for p in model.parameters())
    assert load_shape(str(tiny_model)).total_params == real


def test_param_count_of_the_default_model() -> None:
    """The shipped config of smollm2-135m (no model is built): 134.5M, as the weights file says."""
    assert load_shape("smollm2-135m").total_params == 134_515_008


@pytest.mark.parametrize(("name", "billions"), [("qwen3-8b", 8.19), ("qwen3-14b", 14.77), ("llama-3.1-8b", 8.03)])
def test_published_configs_give_their_published_sizes(name: str, billions: float) -> None:
    assert fixture_shape(name).total_params / 1e9 == pytest.approx(billions, rel=0.02)


def test_unknown_hub_model_cannot_be_planned() -> None:
    with pytest.raises(PlanUnavailable, match="no local config.json"):
        load_shape("nobody-here/not-a-model")


# ---------------------------------------------------------------- the activation formula


BUDGET, PROMPT, COMPLETION = 512, 8, 56  # a full micro-batch of 64-token rows


def tiny_learner(tiny_model: Path, dtype: str, checkpointing: bool = False):
    from lora_async.config import LearnerConfig, LoraConfig, default_loss
    from lora_async.learner import Learner
    from lora_async.placement import Placement

    cfg = LearnerConfig(dtype=dtype, token_budget=BUDGET, gradient_checkpointing=checkpointing)
    return Learner(tiny_model, {"main": (LoraConfig(), 1e-3)}, cfg, default_loss(), Placement("cpu", None), 1.0, 0)


def full_batch() -> list:
    from lora_async.buffer import TrainSample

    return [TrainSample("main", 0, [100 + i] * PROMPT, [200 + i] * COMPLETION, [-1.0] * COMPLETION, 1.0,
                        1.0 if i % 2 else -1.0) for i in range(BUDGET // (PROMPT + COMPLETION))]


def saved_bytes(learner) -> int:
    """Every tensor autograd saves in one learner forward over `full_batch`, counted by storage,
    the model's own weights excluded."""
    import torch

    from lora_async.learner.logprobs import completion_logprobs
    from lora_async.learner.packing import build_micro_batch, plan_step

    samples = full_batch()
    mb = build_micro_batch(samples, plan_step(samples, BUDGET)[0], learner.pad_id, learner.device)
    params = {p.untyped_storage().data_ptr() for p in learner.model.parameters()}
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        completion_logprobs(learner.model, mb, 1.0, 1024)
    return sum(saved.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_activation_formula_matches_what_autograd_keeps(tiny_model: Path, dtype: str) -> None:
    shape = load_shape(str(tiny_model))
    planned = activation_bytes(shape, 4 if dtype == "float32" else 2, set(shape.linears()), BUDGET,
                               PROMPT + COMPLETION, checkpointing=False)
    assert saved_bytes(tiny_learner(tiny_model, dtype)) == pytest.approx(planned, rel=0.1)


def test_gradient_checkpointing_is_on_when_asked(tiny_model: Path) -> None:
    """transformers checkpoints only layers in training mode and the learner stays in eval mode:
    with learner.gradient_checkpointing the layers keep almost nothing, and a step is unchanged."""
    import torch

    plain, ckpt = tiny_learner(tiny_model, "float32"), tiny_learner(tiny_model, "float32", checkpointing=True)
    assert saved_bytes(ckpt) < saved_bytes(plain) / 4
    plain.train_step("main", full_batch())
    ckpt.train_step("main", full_batch())
    after, with_ckpt = plain.adapter_tensors("main"), ckpt.adapter_tensors("main")
    assert all(torch.allclose(after[k], with_ckpt[k], atol=1e-6) for k in after)


def test_the_row_cap_is_the_learners() -> None:
    from lora_async.learner.packing import MAX_ROW_TOKENS as packing_cap

    assert MAX_ROW_TOKENS == packing_cap


def test_cpu_bf16_check_agrees_with_dtypes() -> None:
    from lora_async import dtypes
    from lora_async.placement import cpu_native_bf16

    assert cpu_native_bf16() == dtypes.native_bf16("cpu")


# ---------------------------------------------------------------- monotonicity and layout


def weights(quantization: str, dtype: str = "bfloat16") -> int:
    cfg = config(f"model.quantization={quantization}", f"learner.dtype={dtype}")
    items = learner_items(cfg, fixture_shape("qwen3-8b"), "cuda:0", dtype)
    return next(i.bytes for i in items if i.name.startswith("base weights"))


def test_quantisation_orders_the_weights() -> None:
    nf4, int8, bf16, fp32 = weights("nf4"), weights("int8"), weights("none"), weights("none", "float32")
    assert nf4 < int8 < bf16 < fp32
    assert bf16 == pytest.approx(8.19e9 * 2, rel=0.01)
    shape = fixture_shape("qwen3-8b")  # nf4: ~4.13 bits per quantised weight, the rest (and one layer) at bf16
    packed = nf4 - 2 * (shape.other_params + shape.largest_linear)
    assert packed / shape.linear_params == pytest.approx(0.516, abs=0.001)


@pytest.mark.parametrize("overrides, says", [
    ((), ""),
    (("model.quantization=nf4",), "the learner's nf4 base dequantised to bfloat16"),
    (("model.quantization=int8", "learner.dtype=float32"), "the learner's int8 base dequantised to float32"),
    (("model.quantization=nf4", "generator.base=original"), "the original checkpoint"),
])
def test_the_plan_says_which_base_the_generator_serves(overrides: tuple[str, ...], says: str) -> None:
    """Its memory is a full-precision base's either way; the plan names it, and the disk the
    learner's dequantised copy takes."""
    shape = fixture_shape("qwen3-8b")
    cfg = config("model.name=" + str(FIXTURES / "qwen3-8b"), "model.dtype=bfloat16", *overrides)
    plan = plan_run(cfg, TWO_24GB, shape)
    generator = next(d for d in plan.devices if d.device == "cuda:0")
    weights = next(i for i in generator.items if i.name.startswith("base weights"))
    assert weights.bytes == shape.total_params * 2
    if not says:
        assert plan.served == ""
        return
    assert says in plan.served
    if "dequantised" in says:
        itemsize = 4 if "float32" in says else 2
        assert f"({shape.total_params * itemsize / GIB:.2f} GiB on disk)" in plan.served
        assert "dequantised" in weights.detail
    else:
        assert weights.detail == "unquantised"


def test_checkpointing_lowers_activations() -> None:
    off = plan_run(config("model.name=" + str(FIXTURES / "qwen3-8b")), TWO_24GB)
    on = plan_run(config("model.name=" + str(FIXTURES / "qwen3-8b"), "learner.gradient_checkpointing=true"), TWO_24GB)
    assert on.activations == off.activations and on.activations["on"] < off.activations["off"] / 5
    assert on.devices[0].device == "cuda:1" and on.devices[0].need < off.devices[0].need


def test_activations_grow_with_the_token_budget() -> None:
    needs = [plan_run(config(f"learner.token_budget={t}"), Machine.this()).devices[0].part("learner")
             for t in (512, 1024, 2048)]
    assert needs[0] < needs[1] < needs[2]


@pytest.mark.parametrize(("gpus", "overrides", "generator", "learners"), [
    (0, [], "cpu", ("cpu",)),
    (1, [], "cuda:0", ("cuda:0",)),
    (2, [], "cuda:0", ("cuda:1",)),
    (3, ["learner.devices=['cuda:0', 'cuda:1']"], "cuda:2", ("cuda:0", "cuda:1")),
    (2, ["generator.type='server'", "generator.urls=['http://127.0.0.1:8000']"], None, ("cuda:0",)),
])
def test_layout_follows_placement_rules(gpus: int, overrides: list[str], generator: str | None,
                                        learners: tuple[str, ...]) -> None:
    where = layout(config(*overrides), gpus)
    assert (where.generator, where.learners) == (generator, learners)


def test_two_learner_ranks_each_hold_a_copy() -> None:
    one = plan_run(config("learner.device='cuda:1'"), Machine((80 * GIB,) * 3, 64 * GIB, True))
    two = plan_run(config("learner.devices=['cuda:1', 'cuda:2']"), Machine((80 * GIB,) * 3, 64 * GIB, True))
    rank0 = next(d for d in one.devices if d.device == "cuda:1").need
    assert [d.need for d in two.devices if d.device in ("cuda:1", "cuda:2")] == [rank0, rank0]


# ---------------------------------------------------------------- verdicts and knobs


def test_an_8b_learner_without_checkpointing_needs_a_knob_on_24gb() -> None:
    cfg = config("model.name=" + str(FIXTURES / "qwen3-8b"), "generator.kv_cache_gb=4")
    plan = plan_run(cfg, TWO_24GB)
    assert not plan.fits and [d.device for d in plan.over()] == ["cuda:1"]
    knobs = find_knobs(cfg, TWO_24GB, fixture_shape("qwen3-8b"), plan)
    assert ("learner.gradient_checkpointing=true",) in [k.settings for k in knobs] and all(k.fits for k in knobs)


def test_a_kv_cache_too_small_for_one_sequence_is_a_problem() -> None:
    plan = plan_run(config("generator.kv_cache_gb=0.001"), Machine.this())
    assert not plan.fits and "max_model_len" in plan.problems[0]


# ---------------------------------------------------------------- CLI


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lora_async", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})})


def test_train_refuses_a_run_that_cannot_fit_in_one_line_before_loading(tmp_path: Path) -> None:
    cache, out = tmp_path / "cache", tmp_path / "run"
    done = run_cli("train", "examples/arithmetic.toml", "--set", "generator.kv_cache_gb=100000",
                   "--set", f"run.output_dir='{out}'", env={"LORA_ASYNC_CACHE": str(cache)}, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "cpu needs" in lines[0] and "generator.kv_cache_gb=" in lines[0]
    assert not cache.exists() and not out.exists()  # no model built, no run started


@pytest.mark.slow
def test_force_starts_a_run_the_plan_refuses(tmp_path: Path) -> None:
    """The refusal becomes a warning, and the run really starts: its own start-up lines follow
    (the model resolved, the config written), which a refused run never gets to."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "lora_async", "train", "examples/arithmetic.toml", "--force",
           "--set", "generator.kv_cache_gb=100000", "--set", f"run.output_dir='{out}'"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=REPO,
                            start_new_session=True)
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        assert "starting anyway (--force)" in first and "will not fit" in first
        started = proc.stderr.readline()
        assert started.startswith("model smollm2-135m"), started  # the run's description: past the gate
        assert (out / "config.json").is_file()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_plan_json_for_a_hypothetical_machine() -> None:
    done = run_cli("plan", "examples/arithmetic.toml", "--gpus", "2", "--gpu-memory-gb", "24", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["fits"] and report["layout"] == {"generator": "cuda:0", "learners": ["cuda:1"]}
    assert report["params"] == 134_515_008 and report["dtypes"] == {"learner": "bfloat16", "generator": "bfloat16"}
    learner = next(d for d in report["devices"] if d["device"] == "cuda:1")
    assert learner["need_bytes"] == sum(i["bytes"] for i in learner["items"]) < learner["capacity_bytes"]


def test_plan_exits_2_with_the_verdict_and_knobs() -> None:
    done = run_cli("plan", "examples/arithmetic.toml", "--set", "generator.kv_cache_gb=100000", "--json")
    assert done.returncode == 2
    report = json.loads(done.stdout)
    assert not report["fits"] and report["knobs"] and all(k["fits"] for k in report["knobs"])
    assert done.stderr.strip() == report["verdict"]


def test_plan_of_an_unreadable_model_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    from lora_async.cli.plan import memory_gate

    done = run_cli("plan", "--set", "model.name=nobody-here/not-a-model")
    assert done.returncode == 1 and "cannot plan" in done.stderr
    memory_gate(config("model.name=nobody-here/not-a-model"), force=False)  # a warning, not a refusal
    assert "memory plan skipped" in capsys.readouterr().err
    memory_gate(config("model.name=/nonexistent"), force=False)  # the run's own check will say so
    memory_gate(config("learner.device='cuda:7'"), force=False)
    memory_gate(config("learner.token_budget=512"), force=False)  # fits: nothing to say
    assert capsys.readouterr().err == ""


def test_learner_estimate_for_the_gpu_check() -> None:
    """bench/gpu_check.py puts these beside torch.cuda.max_memory_allocated."""
    from lora_async.plan import learner_estimate

    full, nf4 = (learner_estimate(FIXTURES / "qwen3-8b", dtype="bfloat16", quantization=q, token_budget=2048)
                 for q in ("none", "nf4"))
    assert nf4["learner_gb"] < full["learner_gb"] and full["tensors_gb"] < full["learner_gb"]
    assert full["items_gb"]["base weights, bfloat16"] == pytest.approx(8.19e9 * 2 / GIB, rel=0.01)


# ---------------------------------------------------------------- against measurement


@pytest.mark.slow
@pytest.mark.parametrize("case", ["float32:1024:off", "nf4-float32:512:off"])
def test_plan_within_25_percent_of_measured_peak_rss(case: str) -> None:
    """bench/memory_check.py: one learner step on the default model in a fresh process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("memory_check", REPO / "bench" / "memory_check.py")
    assert spec and spec.loader
    memory_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory_check)
    # What glibc keeps of freed memory varied between otherwise equal runs (a 1024-token float32
    # step peaked at 2.4 GiB in one CI run and 3.5 GiB in others), so the test measures with glibc
    # returning large blocks at once and checks the plan's tensors; the plan's calibrated
    # retention item is compared in bench/RESULTS.md.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    done = subprocess.run([sys.executable, str(REPO / "bench" / "memory_check.py"), "--child", case],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])["peak_mib"]
    assert memory_check.planned_mib(case, tensors_only=True) == pytest.approx(measured, rel=0.25)
