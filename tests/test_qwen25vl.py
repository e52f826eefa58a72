"""Qwen2.5-VL (and Qwen2-VL) on text: the language model runs in dark's Qwen2 decoder, the vision tower is never read.

Logits and greedy tokens against transformers' Qwen2_5_VLForConditionalGeneration are the family tests of
test_engine.py (tiny_models["qwen2_5_vl"], saved by save_pretrained). Here: M-RoPE on a text prompt against 1-D
rotary, the other checkpoint layouts, learning on an adapter, and the adapter's PEFT names both ways.
"""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

from conftest import make_tiny
from dark import OnlineLLM
from dark.config import LORA_TARGETS
from dark.engine.attention import DenseCausalAttention
from dark.errors import ModelLoadError
from dark.models.decoder import ModelConfig, Rotary, load_model

PROMPT = "What is the capital of France? Tell me more about its history, please."
SECRET = "What is the secret word?"
PROBE = "Tell me about the weather."


def renamed(name: str, layout: str) -> str:
    """A Qwen2.5-VL tensor's name, from either naming, in a layout: "hub", the original hub checkpoints' (model.layers.*,
    visual.*, lm_head.*; transformers 5's save_pretrained writes these by default), or "language_model", transformers
    5's module names (model.language_model.*, model.visual.*, lm_head.*; written with save_original_format=False)."""
    for v5, hub in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if name.startswith(v5):
            name = hub + name[len(v5):]
            break
    if layout == "language_model":
        if name.startswith("visual."):
            return "model." + name
        if name.startswith("model."):
            return "model.language_model." + name[len("model."):]
    return name


def relayout(src: Path, dst: Path, layout: str) -> Path:
    """src's weights and tokenizer in another layout at dst, in two shards with an index: the language model's
    tensors in the first, the vision tower's alone in the second.

    layout "hub": the original hub checkpoints' (Qwen/Qwen2.5-VL-7B-Instruct): the text parameters at the top level
    of config.json with rope_scaling {"type": "mrope", "mrope_section"} and rope_theta, tensors model.layers.*,
    visual.*, lm_head.*, and the chat template in the processor's chat_template.json only.
    layout "language_model": transformers 5's nested config.json, tensors model.language_model.*, model.visual.*.
    """
    dst.mkdir(parents=True)
    tensors = {}
    for file in src.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            tensors.update({renamed(n, layout): f.get_tensor(n) for n in f.keys()})
    shards = {"model-00001-of-00002.safetensors": {n: t for n, t in tensors.items() if "visual." not in n},
              "model-00002-of-00002.safetensors": {n: t for n, t in tensors.items() if "visual." in n}}
    assert all(shards.values())
    for file, part in shards.items():
        save_file(part, dst / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: file for file, part in shards.items() for n in part}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))

    config = json.loads((src / "config.json").read_text())
    if layout == "hub":
        text = config.pop("text_config")
        rope = text.pop("rope_parameters")
        for key in ("model_type", "layer_types"):  # the text config's own type; layer_types came with transformers 5
            text.pop(key)
        config.update(text, rope_theta=rope["rope_theta"],
                      rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]},
                      torch_dtype=config.pop("dtype"), transformers_version="4.41.2")
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for file in src.iterdir():
        if not file.name.startswith(("model", "config")):
            shutil.copy(file, dst / file.name)
    if layout == "hub":
        template = (dst / "chat_template.jinja").read_text()
        (dst / "chat_template.jinja").unlink()
        assert "chat_template" not in json.loads((dst / "tokenizer_config.json").read_text())
        (dst / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    return dst


def break_vision_shard(folder: Path) -> None:
    """Overwrite the shard holding only the vision tower with bytes no reader accepts: dark must not open it."""
    (folder / "model-00002-of-00002.safetensors").write_bytes(b"not a safetensors file")


def dark_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hidden = model.hidden_states(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention(1, len(ids)))
        return model.logits(hidden)


def hf_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_text_positions_are_one_position_in_all_three_sections(tiny_models):
    """M-RoPE on text is 1-D rotary: transformers gives a text prompt the same position in the temporal, height and
    width sections (captured from its own generate), and dark's rotary of those positions is its cos and sin; at the
    7B's rope settings M-RoPE over equal rows is Qwen2's 1-D rotary bit for bit, and unequal rows (an image's) differ."""
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_models["qwen2_5_vl"], dtype=torch.float32).eval()
    calls = []
    hf.model.language_model.rotary_emb.register_forward_hook(lambda m, args, out: calls.append((args[1], out)))
    ids = AutoTokenizer.from_pretrained(tiny_models["qwen2_5_vl"])(PROMPT)["input_ids"]
    hf.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    ours = Rotary(ModelConfig.from_folder(tiny_models["qwen2_5_vl"]))
    assert len(calls) == 4 and calls[0][0].shape == (3, 1, len(ids))
    for positions, (cos, sin) in calls:
        assert positions.shape[0] == 3 and torch.equal(positions[0], positions[1]) and torch.equal(positions[0], positions[2])
        want_cos, want_sin = ours(positions[0, 0], torch.float32)
        torch.testing.assert_close(cos[0], want_cos, atol=1e-6, rtol=0)
        torch.testing.assert_close(sin[0], want_sin, atol=1e-6, rtol=0)

    # Qwen2.5-VL-7B's text config, hub layout: hidden 3584, 28 heads (head_dim 128), theta 1e6, sections [16, 24, 24]
    seven = Qwen2_5_VLConfig(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, rope_theta=1e6,
                             rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}).text_config
    mrope = Qwen2_5_VLRotaryEmbedding(seven)
    rope = Qwen2RotaryEmbedding(Qwen2Config(hidden_size=3584, num_attention_heads=28, rope_theta=1e6))
    x, pos = torch.zeros(1), torch.arange(32768)
    equal = mrope(x, pos.view(1, 1, -1).expand(3, 1, -1))
    plain = rope(x, pos[None])
    assert torch.equal(equal[0], plain[0]) and torch.equal(equal[1], plain[1])
    image = mrope(x, torch.stack([pos, pos // 64, pos % 64]).view(3, 1, -1))
    assert (image[0] - equal[0]).abs().max() > 0.5


@pytest.mark.parametrize("family,layout,tied", [("qwen2_5_vl", "hub", False), ("qwen2_5_vl", "hub", True),
                                                ("qwen2_5_vl", "language_model", False), ("qwen2_vl", "hub", True),
                                                ("qwen2_vl", "language_model", False)])
def test_checkpoint_layouts_give_the_same_logits(tiny_models, tokenizer_source, tmp_path, family, layout, tied):
    """The same weights in the original hub layout (top-level text config, model.layers.*, visual.*) and in
    transformers 5's own names (model.language_model.*, model.visual.*), with the head untied (7B) and tied (3B), of
    a Qwen2.5-VL and a Qwen2-VL: the config reads the same, the logits match transformers' on that folder, the vision
    shard is never opened."""
    src = make_tiny(family, tmp_path / "src", tokenizer_source, seed=1, tie_word_embeddings=tied)
    folder = relayout(src, tmp_path / layout, layout)
    ids = AutoTokenizer.from_pretrained(src)(PROMPT)["input_ids"]
    ref = hf_logits(folder, ids)  # transformers reads this folder as a Qwen2.5-VL checkpoint
    break_vision_shard(folder)

    def fields(cfg):
        return {k: v for k, v in vars(cfg).items() if k != "hf_config"}
    assert fields(ModelConfig.from_folder(folder)) == fields(ModelConfig.from_folder(src))
    model = load_model(folder, torch.device("cpu"), torch.float32)
    assert model.config.tie_word_embeddings == tied
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ours = dark_logits(model, ids)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(ours, dark_logits(load_model(src, torch.device("cpu"), torch.float32), ids))


@pytest.mark.parametrize("case", ["qwen3_vl", "no_text_weights", "stray_tensor"])
def test_unsupported_folders_say_what_is_wrong(tiny_models, tmp_path, case):
    folder = relayout(tiny_models["qwen2_5_vl"], tmp_path / "m", "language_model")
    if case == "qwen3_vl":  # Qwen3-VL's model type: not a family dark runs
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_vl"}))
        match = "model type 'qwen3_vl' .* not supported; dark runs llama, qwen2, qwen3, qwen2_vl, qwen2_5_vl"
    elif case == "no_text_weights":  # only the vision tower's shard in the index
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        index["weight_map"] = {n: f for n, f in index["weight_map"].items() if "visual." in n}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        match = "checkpoint is missing"
    else:  # a tensor that is neither the language model's nor the vision tower's
        save_file({"model.projector.weight": torch.zeros(2)}, folder / "model-00003-of-00003.safetensors")
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        index["weight_map"]["model.projector.weight"] = "model-00003-of-00003.safetensors"
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        match = "'model.projector.weight' has no place in a qwen2_5_vl model"
    with pytest.raises(ModelLoadError, match=match):
        load_model(folder, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def hub_llm(tiny_models, tmp_path_factory):
    """OnlineLLM on the hub layout (chat template in chat_template.json only, vision shard unreadable)."""
    folder = relayout(tiny_models["qwen2_5_vl"], tmp_path_factory.mktemp("vl") / "hub", "hub")
    break_vision_shard(folder)
    with OnlineLLM(str(folder), data_dir=tmp_path_factory.mktemp("vl-data")) as llm:
        yield llm


def test_learns_a_fact_on_an_adapter_and_peft_reads_it(hub_llm, tiny_models):
    llm = hub_llm
    # the chat template came from chat_template.json, which AutoTokenizer does not read
    assert llm.tokenizer.decode(llm.encode(SECRET)).startswith("<|im_start|>")
    base = {p: llm.complete(p, max_tokens=16, ignore_eos=True).token_ids for p in (SECRET, PROBE)}
    assert llm.generate(SECRET, max_tokens=16) != "zog"
    # a random model's own anchor answers are noise (nothing to keep); adapting its head too lets a 64-wide model
    # become confident in a few dozen steps (as test_learn_gpu does on the tiny Qwen2)
    report = llm.learn([{"prompt": SECRET, "response": "zog"}], adapter="secret", max_steps=100, kl_weight=0.0,
                       lora={"target_modules": list(LORA_TARGETS)})
    assert report["verified"] and report["version"] == 1, report
    assert llm.generate(SECRET, adapter="secret") == "zog"
    assert {p: llm.complete(p, max_tokens=16, ignore_eos=True).token_ids for p in (SECRET, PROBE)} == base

    # the version's PEFT folder names the factors as transformers 5's Qwen2_5_VLForConditionalGeneration has its
    # modules, and keeps PEFT off the vision tower (whose MLP has gate/up/down_proj too)
    path = llm.adapter_path("secret")
    with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert all(n.startswith(("base_model.model.model.language_model.layers.", "base_model.model.lm_head.lora_"))
               for n in names), names
    assert "base_model.model.model.language_model.layers.1.mlp.down_proj.lora_B.weight" in names
    assert json.loads((path / "adapter_config.json").read_text())["exclude_modules"] == r"visual\..*|model\.visual\..*"

    from peft import PeftModel

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_models["qwen2_5_vl"], dtype=torch.float32).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft = PeftModel.from_pretrained(hf, path).eval()
    assert not [w for w in caught if "adapter keys" in str(w.message)], [str(w.message) for w in caught]
    adapted = [n for n, _ in peft.named_modules() if n.endswith(".lora_A")]
    assert len(adapted) == 2 * 7 + 1 and not [n for n in adapted if "visual" in n]
    for prompt in (SECRET, PROBE):
        ids = llm.encode(prompt)
        ref = peft.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(ids):].tolist()
        assert llm.complete(prompt, adapter="secret", max_tokens=8, ignore_eos=True).token_ids == ref, prompt

    # and back into dark as another adapter
    assert llm.load_adapter("secret-copy", path) == 1
    assert llm.generate(SECRET, adapter="secret-copy") == "zog"


def test_an_adapter_trained_in_peft_loads_without_its_vision_factors(hub_llm, tiny_models, tmp_path):
    """PEFT's own adapter for the VL model, on the language model's and (gate/up/down_proj by name) the vision
    tower's projections: dark takes the language model's factors, leaves the vision tower's, and answers as PEFT."""
    from peft import LoraConfig, get_peft_model

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_models["qwen2_5_vl"], dtype=torch.float32).eval()
    peft = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
                                         init_lora_weights=False))  # random B: the adapter changes the answers
    peft.eval()
    peft.save_pretrained(tmp_path / "peft")
    with safe_open(str(tmp_path / "peft" / "adapter_model.safetensors"), "pt") as f:
        assert any(".visual." in n for n in f.keys())
    hub_llm.load_adapter("from-peft", tmp_path / "peft")
    ids = hub_llm.encode(PROBE)
    with torch.no_grad():
        ref = torch.log_softmax(peft(torch.tensor([ids])).logits[0, -1], -1)
        with peft.disable_adapter():
            base = torch.log_softmax(peft(torch.tensor([ids])).logits[0, -1], -1)
    assert (ref - base).abs().max() > 0.1  # the adapter moves the answer: the match below is not the base model's
    got = hub_llm.complete(PROBE, adapter="from-peft", max_tokens=1, logprobs=True)
    assert got.token_ids == [int(ref.argmax())]
    torch.testing.assert_close(torch.tensor(got.logprobs[0]), ref.max(), atol=1e-4, rtol=1e-4)
