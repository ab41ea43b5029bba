"""Config loading: defaults, overrides, one-line errors naming the dotted field."""

import subprocess
import sys
from pathlib import Path

import pytest

from lora_async.config import ConfigError, TrainConfig, load_config, vllm_rank

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
                             "task.ops=[\"+\", \"-\"]", "lora.target_modules=[\"q_proj\"]"])
    assert cfg.learner.lr == 1e-4 and cfg.run.max_steps == 3 and cfg.run.output_dir == "/tmp/x"
    assert cfg.task.ops == ["+", "-"] and cfg.lora.target_modules == ["q_proj"]


def test_slots_are_derived_from_the_config():
    cfg = load_config(None, ["buffer.max_staleness=2", "lora.rank=12"])
    assert cfg.max_loras == 1 * (2 + 1) + 1
    assert cfg.max_lora_rank == 16
    assert [vllm_rank(r) for r in (1, 2, 8, 9, 300)] == [1, 8, 8, 16, 320]


@pytest.mark.parametrize("text, field", [
    ("[lora]\nrnak = 8\n", "lora.rnak"),
    ("[learner]\nlr = \"fast\"\n", "learner.lr"),
    ("[lora]\nrank = 0\n", "lora.rank"),
    ("[buffer]\nstale_policy = \"keep\"\n", "buffer.stale_policy"),
    ("[task]\ntype = \"chess\"\n", "task"),
    ("[task]\ntype = \"jsonl\"\n", "task.path"),
    ("[generator]\nmax_new_tokens = 5000\nmax_model_len = 1024\n", "max_new_tokens"),
    ("[task]\ntype = \"jsonl\"\npath = \"missing.jsonl\"\n", "task.path"),
    ("[run\n", "not valid TOML"),
    ("[generator]\nbackend = \"server\"\n", "generator.urls: backend 'server' needs"),
    ("[generator]\nurls = [\"ftp://x\"]\n", "generator.urls"),
    ("[sync]\ntransport = \"shm\"\n", "sync.transport: 'shm' crosses a process boundary"),
    ("[generator]\nengine_process = \"separate\"\n[sync]\ntransport = \"inproc\"\n", "sync.transport"),
    ("[generator]\nbackend = \"server\"\nurls = [\"http://h:1\"]\n[sync]\ntransport = \"shm\"\n",
     "sync.transport"),
    ("[sync]\ntransport = \"carrier-pigeon\"\n", "sync.transport"),
])
def test_config_errors_name_the_field(tmp_path, text, field):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    message = str(err.value)
    assert field in message and "\n" not in message and str(tmp_path / "c.toml") in message


def test_missing_config_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("/no/such/file.toml")


@pytest.mark.parametrize("args", [
    ["train", "CFG"],
    ["train", "--set", "learner.lr=-1"],
    ["train", "/no/such/file.toml"],
    ["eval", "CFG"],
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


def test_help_is_fast_and_does_not_import_torch():
    code = ("import sys, time; t=time.time(); from lora_async.cli import app; "
            "from typer.testing import CliRunner; r=CliRunner().invoke(app, ['--help']); "
            "assert r.exit_code == 0, r.output; "
            "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, 'heavy import'; "
            "print(time.time()-t)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.strip()) < 2.0


FLEET_ENTRY = '[[adapters]]\nname = "{name}"\n[adapters.task]\ntype = "{task}"\n'


@pytest.mark.parametrize("text, field", [
    (FLEET_ENTRY.format(name="a", task="arithmetic") * 2, "adapters.1.name: duplicate adapter name 'a'"),
    (FLEET_ENTRY.format(name="a", task="arithmetic") + "[adapters.lora]\nrank = 1024\n", "adapters.0.lora.rank"),
    (FLEET_ENTRY.format(name="a", task="poetry"), "adapters.0.task"),
    (FLEET_ENTRY.format(name="bad name", task="arithmetic"), "adapters.0.name"),
    ("[task]\ndigits = 2\n" + FLEET_ENTRY.format(name="a", task="arithmetic"), "task: give either"),
    ('[[adapters]]\nname = "a"\n', "adapters.0.task"),
])
def test_fleet_config_errors_name_the_entry(tmp_path, text, field):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert field in str(err.value) and "\n" not in str(err.value)


def test_fleet_specs_resolve_overrides(tmp_path):
    text = ("[lora]\nrank = 8\n[learner]\nlr = 1e-3\n"
            + FLEET_ENTRY.format(name="a", task="arithmetic")
            + '[[adapters]]\nname = "b"\nweight = 2\nlr = 5e-4\n[adapters.lora]\nrank = 16\n'
              '[adapters.generation]\nmax_new_tokens = 7\n[adapters.task]\nops = ["-"]\n')
    cfg = load_config(write(tmp_path, text))
    a, b = cfg.adapter_specs
    assert (a.name, a.lora.rank, a.lr, a.weight) == ("a", 8, 1e-3, 1.0)
    assert (b.name, b.lora.rank, b.lr, b.weight, b.max_new_tokens, b.task.ops) == ("b", 16, 5e-4, 2.0, 7, ["-"])
    assert cfg.max_lora_rank == 16 and cfg.max_loras == 2 * (cfg.buffer.max_staleness + 1) + 1


@pytest.mark.parametrize("sections, transport", [
    ({}, "inproc"),
    ({"generator": {"engine_process": "separate"}}, "shm"),
    ({"generator": {"engine_process": "separate"}, "sync": {"transport": "nccl", "backend": "gloo"}}, "nccl"),
    ({"generator": {"backend": "server", "urls": ["http://127.0.0.1:8000/"]}}, "http"),
])
def test_sync_transport_auto_follows_the_generator(sections, transport):
    from lora_async.config import TrainConfig

    config = TrainConfig(**sections)
    assert config.sync.resolved(config.generator) == transport
    assert all(not u.endswith("/") for u in config.generator.urls)
