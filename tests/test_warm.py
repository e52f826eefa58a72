"""The serving warm-up (dark.engine.warm): throwaway requests before the model serves, which leave nothing behind."""
from __future__ import annotations

import logging
import re

import pytest

from dark import OnlineLLM
from dark.engine.warm import WARM_ADAPTER, prefill_lengths
from dark.errors import InvalidRequestError

PROMPTS = ["Say hi", "Count to three", "Name a colour"]


def _state(llm) -> dict:
    mgr, blocks = llm.engine.adapters, llm.engine.blocks
    return {"adapters": [a["name"] for a in llm.adapters()], "registry": mgr.names(),
            "slot_refs": list(mgr._refs), "free_blocks": blocks.num_free, "lent": blocks.lent,
            "running": len(llm.engine._by_id), "jobs": llm.store.list_jobs()}


def test_serving_warm_up_runs_requests_with_and_without_an_adapter_and_keeps_nothing(tiny_models, tmp_path, caplog):
    model = str(tiny_models["qwen2"])
    with OnlineLLM(model, data_dir=tmp_path / "plain", warm_serving=False) as plain:
        assert plain.warm_serving_seconds is None
        expected = plain.generate(PROMPTS, max_tokens=8)
    with caplog.at_level(logging.INFO, logger="dark.llm"):
        llm = OnlineLLM(model, data_dir=tmp_path / "warm", warm_serving=True)
    with llm:
        assert llm.warm_serving_seconds > 0
        said = [r.getMessage() for r in caplog.records if "serving warmed up" in r.getMessage()]
        # 1, 2, 4 and 8 at once, one sampled, one joining another as it decodes (18 requests), and a prompt of each
        # length in prefill_lengths, twice (the second time on the throwaway adapter)
        lengths = prefill_lengths(llm.engine)
        assert len(said) == 1 and re.search(rf"\({2 * (18 + len(lengths))} throwaway requests", said[0]), said
        state = _state(llm)
        assert state["adapters"] == [] and WARM_ADAPTER not in state["registry"] and state["registry"] == []
        assert state["slot_refs"] == [0] * llm.engine.config.max_adapter_slots
        assert state["free_blocks"] == llm.engine.cache.num_blocks and state["lent"] == 0
        assert state["running"] == 0 and state["jobs"] == []
        # the model answers as one that never warmed up
        assert llm.generate(PROMPTS, max_tokens=8) == expected


def test_serving_warm_up_uses_a_stored_adapter_and_leaves_it_as_it_was(tiny_models, tmp_path):
    model = str(tiny_models["qwen2"])
    data = tmp_path / "data"
    with OnlineLLM(model, data_dir=data) as llm:
        llm.learn([{"prompt": "A greeting in Zoggian", "response": "zog"}], adapter="zog", max_steps=2)
        versions = llm.adapter_versions("zog")
        answer = llm.generate("A greeting in Zoggian", adapter="zog", max_tokens=6)
    with OnlineLLM(model, data_dir=data, warm_serving=True) as llm:
        assert llm.warm_serving_seconds > 0
        mgr = llm.engine.adapters
        # the stored adapter's current version served the warm-up's adapter requests (it sits in a slot now)
        assert mgr.names() == ["zog"] and ("zog", mgr.current("zog")) in mgr._slot_of
        assert llm.adapter_versions("zog") == versions and list(mgr._refs) == [0] * len(mgr._refs)
        assert llm.generate("A greeting in Zoggian", adapter="zog", max_tokens=6) == answer


def test_a_failed_serving_warm_up_is_logged_and_the_model_still_serves(tiny_models, tmp_path, caplog):
    # a context limit shorter than the warm-up's prompt (55 tokens with the template): its first request is refused
    with caplog.at_level(logging.ERROR, logger="dark.llm"):
        llm = OnlineLLM(str(tiny_models["qwen2"]), data_dir=tmp_path / "d", warm_serving=True, max_model_len=40)
    with llm:
        assert llm.warm_serving_seconds is None
        assert any("serving warm-up failed" in r.getMessage() for r in caplog.records)
        assert WARM_ADAPTER not in llm.engine.adapters.names()
        assert isinstance(llm.generate("Hi", max_tokens=3), str)


def test_warm_serving_setting_is_checked(tiny_models, tmp_path):
    with pytest.raises(InvalidRequestError, match="warm_serving"):
        OnlineLLM(str(tiny_models["qwen2"]), data_dir=tmp_path / "bad", warm_serving="yes")


def test_the_warm_up_prefill_lengths_give_the_lora_kernels_every_launch_shape(tiny_models, tmp_path):
    """One prompt length per row count of the LoRA kernels' block table over every step size the kernels take (their
    grids and compile-time constants follow from it), each length shorter than the context limit."""
    from dark.lora.slots import KERNEL_MAX_TOKENS
    from kernels.lora import segment_rows

    for slots, limit in ((8, 0), (3, 0), (32, 0), (8, 100)):
        with OnlineLLM(str(tiny_models["qwen2"]), data_dir=tmp_path / f"{slots}-{limit}", max_adapter_slots=slots,
                       max_model_len=limit, warm_serving=False) as llm:
            lengths = prefill_lengths(llm.engine)
            top = min(KERNEL_MAX_TOKENS, llm.engine.max_model_len - 2)
            want = {segment_rows(n, slots) for n in range(2, top + 1)}
            assert sorted({segment_rows(n, slots) for n in lengths}) == sorted(want)
            assert len(lengths) == len(want) and max(lengths) < llm.engine.max_model_len - 1
