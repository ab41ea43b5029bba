"""Model resolution: embedded default, local directories, clear errors."""

import pytest

from lora_async.models import ModelError, build_tiny_model, resolve_model


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ModelError, match="smollm2-135m"):
        resolve_model("no-such-model")


def test_a_name_is_checked_without_building_anything(tmp_path):
    from lora_async.models import ModelNameError, check_model_name

    check_model_name("smollm2-135m")  # embedded: nothing is built by a check
    check_model_name("org/name")  # a hub id is only looked up when the model loads
    with pytest.raises(ModelNameError, match=r"^model\.name: unknown model 'no-such-model-xyz'"):
        check_model_name("no-such-model-xyz")
    with pytest.raises(ModelNameError, match="config.json"):
        check_model_name(str(tmp_path))


def test_local_directory_resolves(tiny_model):
    assert resolve_model(str(tiny_model)) == tiny_model.resolve()


def test_directory_without_config_is_an_error(tmp_path):
    with pytest.raises(ModelError, match="config.json"):
        resolve_model(str(tmp_path))


def test_tiny_model_is_tiny_and_built_once(tokenizer_dir, tmp_path, monkeypatch):
    import json

    import transformers

    path = build_tiny_model(tmp_path / "t", tokenizer_dir)
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    config = json.loads((path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"]) == (2, 128)

    def load(*args, **kwargs):
        raise AssertionError("the built model was built again")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", load)  # the build's first step
    assert build_tiny_model(tmp_path / "t", tokenizer_dir) == path


@pytest.mark.slow
def test_embedded_default_builds_and_answers(capsys):
    """The GGUF -> bf16 HF conversion, with its own greedy self-check (cached after once)."""
    from lora_async.models import greedy_check

    path = resolve_model("smollm2-135m")
    assert (path / "model.safetensors").is_file() and (path / ".complete").is_file()
    assert "Paris" in greedy_check(path, "What is the capital of France?")
