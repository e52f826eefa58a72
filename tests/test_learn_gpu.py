"""Learning beside serving on CUDA (kernels and CUDA graphs on the serving side), on a tiny random Qwen2."""
from __future__ import annotations

import threading

import pytest
import torch

from dark import OnlineLLM
from dark.config import LORA_TARGETS

DEVICE = "cuda" if torch.cuda.is_available() else None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE is None, reason="needs CUDA")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_learn_while_serving_on_cuda(tiny_models, tmp_path, dtype):
    with OnlineLLM(str(tiny_models["qwen2"]), device=DEVICE, dtype=dtype, data_dir=tmp_path) as llm:
        probe = "Tell me about the weather."
        base = llm.complete(probe, max_tokens=16, ignore_eos=True).token_ids
        streamed = []
        reader = threading.Thread(target=lambda: streamed.extend(
            llm.stream("Write a long text.", max_tokens=400, ignore_eos=True)))
        reader.start()
        # a random model's own anchor answers are noise (nothing to keep); adapting its head lets a 64-wide
        # model become confident in a few dozen steps
        report = llm.learn([{"prompt": "What is the secret word?", "response": "zog"}], adapter="s", max_steps=100,
                           kl_weight=0.0, lora={"target_modules": list(LORA_TARGETS)})
        reader.join()
        assert report["verified"] and report["version"] == 1, report
        assert llm.generate("What is the secret word?", adapter="s") == "zog"
        assert llm.complete(probe, max_tokens=16, ignore_eos=True).token_ids == base  # the base is untouched
        assert len(streamed) > 0
