"""Shared fixtures: the embedded SmolLM2 (converted once per session) and tiny random models of each family
(Llama, Qwen2, Qwen3, and Qwen2-VL and Qwen2.5-VL, whose language model dark runs as a Qwen2)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch


def pytest_configure(config):
    # one conversion of the embedded model per test session, outside the user's own cache
    if "DARK_HOME" not in os.environ:
        os.environ["DARK_HOME"] = str(Path(config.rootpath) / ".data" / "test-home")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not torch.cuda.is_available():
        # Triton kernels run in its interpreter on the CPU; it reads this once, when it is first imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    from dark.models.loader import resolve_model

    return resolve_model(None, "cpu")


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512)
# the vision towers, as small as they build: dark never loads them, but their weights are in the checkpoints
TINY_VISION = {"qwen2_5_vl": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                  fullatt_block_indexes=[0], window_size=28),
               "qwen2_vl": dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)}
# its M-RoPE: the three sections (temporal, height, width) split head_dim // 2 = 8 rotary frequencies
TINY_MROPE = {"type": "mrope", "mrope_section": [2, 3, 3]}


def hf_class(family: str):
    """The transformers class of a family's checkpoints (Qwen2-VL's and Qwen2.5-VL's are no AutoModelForCausalLM)."""
    import transformers

    return transformers.AutoModelForImageTextToText if family in TINY_VISION else transformers.AutoModelForCausalLM


def make_tiny(family: str, folder: Path, tokenizer_from: Path, seed: int = 0, **overrides) -> Path:
    """Save a tiny random model of a family, with the SmolLM2 tokenizer, as a Hugging Face folder (save_pretrained's
    defaults). A Qwen2(.5)-VL gets the overrides in its text_config, but tie_word_embeddings, and a tiny vision tower."""
    import transformers
    from transformers import AutoTokenizer

    cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
           "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
           "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration")}[family]
    cls = tuple(getattr(transformers, name) for name in cls)
    extra = {"head_dim": 16} if family == "qwen3" else {}
    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if family in TINY_VISION:
        tie = overrides.pop("tie_word_embeddings", False)
        cfg = cls[0](text_config={**TINY, "rope_scaling": dict(TINY_MROPE), **overrides, **ids},
                     vision_config=TINY_VISION[family], tie_word_embeddings=tie)
    else:
        cfg = cls[0](**{**TINY, **extra, **overrides}, **ids)
    torch.manual_seed(seed)
    model = cls[1](cfg)
    with torch.no_grad():  # random norms and biases, so a switch that is wired wrong shows up
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tokenizer_source(request) -> Path:
    """Where the tiny models take their tokenizer: $DARK_TEST_TOKENIZER (a folder of SmolLM2 tokenizer files,
    for machines without the embedded GGUF, such as the GPU machine), else the converted embedded SmolLM2."""
    override = os.environ.get("DARK_TEST_TOKENIZER")
    if override:
        return Path(override).expanduser().resolve()
    return request.getfixturevalue("smollm_path")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tokenizer_source) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama": make_tiny("llama", root / "llama", tokenizer_source, tie_word_embeddings=True),
        "qwen2": make_tiny("qwen2", root / "qwen2", tokenizer_source, tie_word_embeddings=False),
        "qwen3": make_tiny("qwen3", root / "qwen3", tokenizer_source, tie_word_embeddings=False),
        "qwen2_vl": make_tiny("qwen2_vl", root / "qwen2_vl", tokenizer_source, tie_word_embeddings=True),
        "qwen2_5_vl": make_tiny("qwen2_5_vl", root / "qwen2_5_vl", tokenizer_source, tie_word_embeddings=False),
    }


@pytest.fixture(scope="module")
def browser():
    """A headless chromium for a browser test module (which calls browser_support.require_chromium first).

    Module scope, not session: Playwright's sync API keeps an event loop running in this thread while it is
    open, and later modules call asyncio.run().
    """
    from browser_support import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS
    from playwright import sync_api

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def triton_compiles(monkeypatch) -> list[str]:
    """The names of the Triton kernels compiled while the test runs, in order (JITFunction._do_compile wrapped).
    Every kernel's in-process cache is emptied first, so that what an earlier test of the same process compiled
    is compiled (from Triton's disk cache) and counted again, as in a fresh process."""
    import gc

    from triton.runtime.jit import JITFunction

    for obj in gc.get_objects():
        if isinstance(obj, JITFunction) and hasattr(obj, "device_caches"):
            obj.device_caches.clear()
    names: list[str] = []
    real = JITFunction._do_compile

    def logged(fn, *args, **kw):
        names.append(fn.fn.__name__)
        return real(fn, *args, **kw)

    monkeypatch.setattr(JITFunction, "_do_compile", logged)
    return names
