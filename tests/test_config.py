"""Config loading: defaults, overrides, one-line errors naming the dotted field, migration of old keys."""

import os
import json
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

from lora_async.config import (
    ConfigError, HttpSync, InprocSync, NcclSync, RayGeneratorConfig, RaySync, ServerGeneratorConfig, ShmSync,
    TrainConfig, VllmGeneratorConfig,
    dump_config, load_config, vllm_rank,
)

from .conftest import REPO


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_every_shipped_example_parses():
    examples = sorted((REPO / "examples").glob("*.toml"))
    assert examples
    for path in examples:
        assert isinstance(load_config(path), TrainConfig)


def test_overrides_apply_with_toml_types(tmp_path):
    cfg = load_config(None, ["learner.lr=1e-4", "run.max_steps=3", "run.output_dir=/tmp/x",
                             "task.ops=[\"+\", \"-\"]", "lora.target_modules=[\"q_proj\"]",
                             "sampling.temperature=0.5", "run.log_interval_s=0"])
    assert cfg.learner.lr == 1e-4 and cfg.run.max_steps == 3 and cfg.run.output_dir == "/tmp/x"
    assert cfg.task.ops == ["+", "-"] and cfg.lora.target_modules == ["q_proj"]
    assert cfg.sampling.temperature == 0.5 and cfg.adapter_specs[0].sampling.temperature == 0.5
    assert cfg.run.log_interval_s == 0


def test_lora_rank_is_rounded_for_vllm():
    cfg = load_config(None, ["lora.rank=12"])
    assert cfg.max_lora_rank == 16
    assert [vllm_rank(r) for r in (1, 2, 8, 9, 300)] == [1, 8, 8, 16, 320]


def test_eval_max_tokens_falls_back_to_sampling():
    assert load_config(None, ["sampling.max_new_tokens=20"]).adapter_specs[0].eval_max_tokens == 20
    assert load_config(None, ["sampling.max_new_tokens=20",
                              "run.eval_max_tokens=40"]).adapter_specs[0].eval_max_tokens == 40


@pytest.mark.parametrize("text, field", [
    ("[lora]\nrnak = 8\n", "lora.rnak"),
    ("[learner]\nlr = \"fast\"\n", "learner.lr"),
    ("[lora]\nrank = 0\n", "lora.rank"),
    ("[buffer]\nstale_policy = \"keep\"\n", "buffer.stale_policy"),
    ("[task]\ntype = \"chess\"\n", "task.type: unknown 'chess' (use 'arithmetic', 'jsonl', 'dataset', 'reasoning-gym' or 'env')"),
    ("[task]\ntype = \"jsonl\"\n", "task.path: required"),
    ("[task]\ntype = \"jsonl\"\npath = \"missing.jsonl\"\n", "task.path: file not found"),
    ("[sampling]\nmax_new_tokens = 5000\n[generator]\nmax_model_len = 1024\n",
     "sampling.max_new_tokens (5000) must be below generator.max_model_len"),
    ("[run\n", "not valid TOML"),
    ("[generator]\ntype = \"server\"\n", "generator.urls: required for generator.type = \"server\""),
    ("[generator]\ntype = \"server\"\nurls = []\n", "generator.urls"),
    ("[generator]\ntype = \"server\"\nurls = [\"ftp://x\"]\n",
     "generator.urls: 'ftp://x' is not a server base URL"),
    ("[generator]\ntype = \"tpu\"\n", "generator.type: unknown 'tpu' (use 'vllm', 'server' or 'ray')"),
    ("[generator]\ntype = \"ray\"\nreplicas = 0\n", "generator.replicas"),
    ("[ray]\naddress = \"auto\"\n", "ray: [ray] is used only with generator.type = \"ray\""),
    ("[generator]\ntype = \"ray\"\n[sync]\ntransport = \"shm\"\n",
     "sync.transport: 'shm' needs the engine in its own process"),
    ("[sync]\ntransport = \"ray\"\n",
     "sync.transport: 'ray' needs engine replicas on Ray (generator.type = \"ray\")"),
    ("[sync]\ntransport = \"shm\"\n",
     "sync.transport: 'shm' needs the engine in its own process (generator.engine_process = \"separate\")"),
    ("[generator]\nengine_process = \"separate\"\n[sync]\ntransport = \"inproc\"\n",
     "sync.transport: 'inproc' needs the engine in this process (generator.engine_process = \"same\")"),
    ("[generator]\ntype = \"server\"\nurls = [\"http://h:1\"]\n[sync]\ntransport = \"shm\"\n",
     "sync.transport: 'shm' needs the engine in its own process"),
    ("[generator]\nengine_process = \"separate\"\n[sync]\ntransport = \"http\"\n",
     "sync.transport: 'http' needs remote servers (generator.type = \"server\")"),
    ("[sync]\ntransport = \"carrier-pigeon\"\n",
     "sync.transport: unknown 'carrier-pigeon' (use 'inproc', 'shm', 'nccl', 'cuda-ipc', 'http' or 'ray')"),
    ("[sync]\ncheckum = true\n", "sync.transport: required (one of 'inproc', 'shm'"),
    ("[run]\nlog_interval_s = -1\n", "run.log_interval_s"),
    ("[generator]\nmax_batched_tokens = 100\n", "generator.max_batched_tokens"),
])
def test_config_errors_name_the_field(tmp_path, text, field):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    message = str(err.value)
    assert field in message and "\n" not in message and str(tmp_path / "c.toml") in message


@pytest.mark.parametrize("text, message", [
    ("[generator]\nurls = [\"http://h:1\"]\n",
     "generator.urls: not a setting of generator.type = \"vllm\" (check the spelling or the type)"),
    ("[generator]\ntype = \"server\"\nurls = [\"http://h:1\"]\nengine_process = \"same\"\n",
     "generator.engine_process: not a setting of generator.type = \"server\""),
    ("[generator]\ntype = \"ray\"\ncpus = \"0\"\n",
     "generator.cpus: not a setting of generator.type = \"ray\""),
    ("[generator]\nengine_process = \"separate\"\n[sync]\ntransport = \"shm\"\nbackend = \"gloo\"\n",
     "sync.backend: not a setting of sync.transport = \"shm\" (check the spelling or the type)"),
    ("[task]\npath = \"x.jsonl\"\n", "task.path: not a setting of task.type = \"arithmetic\""),
    ('[[adapters]]\nname = "a"\n[adapters.task]\ntype = "jsonl"\npath = "x"\npth = "x"\n',
     "adapters.0.task.pth: not a setting of adapters.0.task.type = \"jsonl\""),
])
def test_unknown_key_names_the_union_member(tmp_path, text, message):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert str(err.value).startswith(f"{tmp_path / 'c.toml'}: {message}")
    assert "\n" not in str(err.value) and ".vllm." not in str(err.value) and ".shm." not in str(err.value)


def test_union_tags_never_show_in_the_dotted_path(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, '[[adapters]]\nname = "a"\n[adapters.task]\ntype = "jsonl"\n'))
    assert "adapters.0.task.path: required" in str(err.value) and "jsonl.path" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "[generator]\nengine_process = \"separate\"\n[sync]\n"
                                    "transport = \"shm\"\nchecksum = \"maybe\"\n"))
    assert ": sync.checksum: " in str(err.value)


@pytest.mark.parametrize("text, old, new", [
    ("[generator]\nbackend = \"server\"\n", "generator.backend", "generator.type"),
    ("[generator]\nmax_new_tokens = 16\n", "generator.max_new_tokens", "sampling.max_new_tokens"),
    ("[generator]\ntemperature = 0.7\n", "generator.temperature", "sampling.temperature"),
    ("[generator]\ntop_p = 0.9\n", "generator.top_p", "sampling.top_p"),
    ("[generator]\nsamples_per_prompt = 4\n", "generator.samples_per_prompt", "sampling.samples_per_prompt"),
    ("[sync]\ntransport = \"auto\"\n", "sync.transport: 'auto' is gone", "leave out [sync]"),
    ('[[adapters]]\nname = "a"\n[[adapters]]\nname = "b"\n[adapters.generation]\nmax_new_tokens = 7\n',
     "adapters.1.generation", "adapters.1.sampling"),
])
def test_old_keys_fail_with_the_change_to_make(tmp_path, text, old, new):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 'c.toml'}: {old}") and new in message and "\n" not in message


def test_old_keys_given_with_set_fail_the_same_way():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["generator.temperature=0.5"])
    assert str(err.value) == ("<defaults> (with --set): generator.temperature: moved to [sampling] "
                              "(sampling.temperature)")


def test_missing_config_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("/no/such/file.toml")


@pytest.mark.parametrize("args", [
    ["train", "CFG"],
    ["train", "--set", "learner.lr=-1"],
    ["train", "--set", "generator.temperature=0.5"],
    ["train", "/no/such/file.toml"],
    ["eval", "CFG"],
    ["train", "--set", "model.name=no-such-model-xyz"],
    ["eval", "--set", "model.name=no-such-model-xyz"],
])
def test_cli_config_errors_exit_2_with_one_line(tmp_path, args):
    cfg = write(tmp_path, "[learner]\nlr = \"fast\"\n")
    args = [str(cfg) if a == "CFG" else a for a in args]
    done = subprocess.run([sys.executable, "-m", "lora_async", *args], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:")
    if any("model.name" in a for a in args):
        assert "model.name" in lines[0] and "no-such-model-xyz" in lines[0]


def test_help_does_not_import_torch():
    """`lora-async --help` answers without the heavy imports (torch, vLLM) that make it slow."""
    code = ("import sys; from lora_async.cli import app; "
            "from typer.testing import CliRunner; r=CliRunner().invoke(app, ['--help']); "
            "assert r.exit_code == 0, r.output; "
            "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, 'heavy import'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_config_package_does_not_import_torch():
    code = "import sys, lora_async.config; assert 'torch' not in sys.modules and 'vllm' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


FLEET_ENTRY = '[[adapters]]\nname = "{name}"\n[adapters.task]\ntype = "{task}"\n'


@pytest.mark.parametrize("text, field", [
    (FLEET_ENTRY.format(name="a", task="arithmetic") * 2, "adapters.1.name: duplicate adapter name 'a'"),
    (FLEET_ENTRY.format(name="a", task="arithmetic") + "[adapters.lora]\nrank = 1024\n", "adapters.0.lora.rank"),
    (FLEET_ENTRY.format(name="a", task="poetry"), "adapters.0.task.type: unknown 'poetry'"),
    (FLEET_ENTRY.format(name="bad name", task="arithmetic"), "adapters.0.name"),
    ("[task]\ndigits = 2\n" + FLEET_ENTRY.format(name="a", task="arithmetic"), "task: give either"),
    ('[[adapters]]\nname = "a"\n', "adapters.0.task"),
    ("adapters = []\n", "adapters: a fleet needs at least one"),
    (FLEET_ENTRY.format(name="a", task="arithmetic") + "[adapters.sampling]\nmax_new_tokens = 2000\n",
     "adapters.0.sampling.max_new_tokens (2000) must be below generator.max_model_len"),
    (FLEET_ENTRY.format(name="a", task="arithmetic") + "[adapters.sampling]\ntop_p = 2\n",
     "adapters.0.sampling.top_p"),
])
def test_fleet_config_errors_name_the_entry(tmp_path, text, field):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert field in str(err.value) and "\n" not in str(err.value)


def test_fleet_specs_resolve_overrides(tmp_path):
    text = ("[lora]\nrank = 8\n[learner]\nlr = 1e-3\n[sampling]\ntemperature = 0.7\nmax_new_tokens = 20\n"
            + FLEET_ENTRY.format(name="a", task="arithmetic")
            + '[[adapters]]\nname = "b"\nweight = 2\nlr = 5e-4\n[adapters.lora]\nrank = 16\n'
              '[adapters.sampling]\nmax_new_tokens = 7\n[adapters.task]\nops = ["-"]\n')
    cfg = load_config(write(tmp_path, text))
    a, b = cfg.adapter_specs
    assert (a.name, a.lora.rank, a.lr, a.weight) == ("a", 8, 1e-3, 1.0)
    assert (a.sampling.max_new_tokens, a.sampling.temperature) == (20, 0.7)
    assert (b.name, b.lora.rank, b.lr, b.weight, b.task.ops) == ("b", 16, 5e-4, 2.0, ["-"])
    # b sets only max_new_tokens: the rest is the top-level [sampling], not SamplingConfig's defaults.
    assert (b.sampling.max_new_tokens, b.sampling.temperature, b.sampling.samples_per_prompt) == (7, 0.7, 8)
    assert (a.eval_max_tokens, b.eval_max_tokens) == (a.sampling.max_new_tokens, 7)  # eval follows each override
    # Nothing is written back into the fields.
    assert cfg.sampling.max_new_tokens == 20 and cfg.adapters[1].sampling.temperature == 1.0
    assert cfg.max_lora_rank == 16 and cfg.adapter_names == ["a", "b"]


def test_dumped_config_loads_back_to_the_same_run(tmp_path):
    text = ("[sampling]\ntemperature = 0.7\n[generator]\nengine_process = \"separate\"\n"
            + FLEET_ENTRY.format(name="a", task="arithmetic") + "[adapters.sampling]\nmax_new_tokens = 7\n")
    cfg = load_config(write(tmp_path, text))
    again = TrainConfig.model_validate(json.loads(dump_config(cfg)))
    assert again.adapter_specs == cfg.adapter_specs and again.adapter_specs[0].sampling.temperature == 0.7
    assert again.sync_config == cfg.sync_config == ShmSync()


@pytest.mark.parametrize("sections, generator, home, sync", [
    ({}, VllmGeneratorConfig, "same", InprocSync()),
    ({"generator": {"engine_process": "separate"}}, VllmGeneratorConfig, "separate", ShmSync()),
    ({"generator": {"type": "server", "urls": ["http://127.0.0.1:8000/"]}}, ServerGeneratorConfig, "server",
     HttpSync()),
    ({"generator": {"type": "ray", "replicas": 4}}, RayGeneratorConfig, "ray", RaySync()),
])
def test_sync_defaults_follow_the_engine_home(sections, generator, home, sync):
    config = TrainConfig(**sections)
    assert type(config.generator) is generator and config.generator.engine_home == home
    assert config.sync is None and config.sync_config == sync and config.sync_config.needs == home
    assert all(not u.endswith("/") for u in getattr(config.generator, "urls", []))


@pytest.mark.parametrize("sync", [
    {"transport": "nccl", "backend": "gloo", "timeout_s": 5.0},
    {"transport": "shm", "checksum": False},
    {"transport": "cuda-ipc", "timeout_s": 9.0},
])
def test_an_explicit_sync_table_is_returned_as_given(sync):
    config = TrainConfig(generator={"engine_process": "separate"}, sync=sync)
    assert config.sync_config is config.sync
    assert config.sync_config.model_dump(include=set(sync)) == sync
    if sync["transport"] == "nccl":
        assert isinstance(config.sync_config, NcclSync) and config.sync_config.checksum is True


def test_every_field_has_a_one_line_description_and_numbers_have_bounds():
    import annotated_types

    import lora_async.config as config

    bounds = (annotated_types.Ge, annotated_types.Gt, annotated_types.Le, annotated_types.Lt)
    sections = [obj for obj in vars(config).values()
                if isinstance(obj, type) and issubclass(obj, config.Section) and obj.model_fields]
    assert config.TrainConfig in sections and config.HttpSync in sections
    numeric = 0
    for section in sections:
        for name, info in section.model_fields.items():
            where = f"{section.__name__}.{name}"
            assert info.description and "\n" not in info.description, where
            if (set(get_args(info.annotation)) - {type(None)} or {info.annotation}) <= {int, float}:
                numeric += 1
                assert any(isinstance(m, bounds) for m in info.metadata), f"{where} has no bounds"
    assert numeric > 30


def test_train_quiets_the_libraries_before_anything_imports_torch():
    """torch reads TORCH_CPP_LOG_LEVEL once, at import: set later, vLLM's CPU worker still prints
    its C++ `NUMA binding` warning into every log (`make demo > log`)."""
    code = ("import os, sys; import lora_async.preflight as p\n"
            "def spy(cfg):\n"
            "    print(os.environ.get('TORCH_CPP_LOG_LEVEL'), 'torch' in sys.modules); raise SystemExit(0)\n"
            "p.preflight = spy\n"
            "from lora_async.cli.app import app; app(['train'])\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert done.stdout.split() == ["ERROR", "False"], done.stderr


@pytest.mark.parametrize("generator, ray, where", [
    ({"type": "vllm"}, {}, "cpu cores 0-1"),
    ({"type": "vllm", "engine_process": "separate"}, {}, "cpu cores 0-1 (engine in its own process)"),
    ({"type": "server", "urls": ["http://a:1", "http://b:2/"]}, {}, "vllm serve at http://a:1, http://b:2"),
    ({"type": "ray", "replicas": 3}, {}, "3 replicas on a local Ray"),
    ({"type": "ray"}, {"address": "auto"}, "2 replicas on the running Ray cluster"),
    ({"type": "ray"}, {"address": "ray://h:10001"}, "2 replicas on the Ray cluster at ray://h:10001"),
])
def test_each_generator_type_says_where_it_runs(generator, ray, where):
    sync = {"transport": "shm"} if generator.get("engine_process") == "separate" else None
    config = TrainConfig.model_validate({"generator": generator, "ray": ray, **({"sync": sync} if sync else {})})
    assert config.generator.describe_where("cpu cores 0-1", config.ray.address) == where
