"""The engine against Hugging Face transformers on the same weights: logits, greedy tokens, ragged batches."""
from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import hf_class, make_tiny
from dark import OnlineLLM
from dark.engine.attention import DenseCausalAttention

PROMPTS = [
    "hello there",
    "What is the capital of France? Tell me more about its history, please.",
    "Write a haiku about the sea and the wind and a small boat far from home.",
    "1 2 3 4 5 6 7",
]
STEPS = 32


def hf_reference(hf, ids: list[int], steps: int = STEPS) -> tuple[list[int], list[float]]:
    """Greedy tokens and each chosen token's log-probability from transformers."""
    out = hf.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                      pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = [torch.log_softmax(l[0].float(), -1)[t].item() for l, t in zip(out.logits, tokens)]
    return tokens, logprobs


def run_ragged(llm: OnlineLLM, prompts: list[str], steps: int = STEPS, join_after: int = 5) -> list:
    """Start the first request; each later one joins once the previous has produced `join_after` tokens."""
    results, done = [None] * len(prompts), [threading.Event() for _ in prompts]

    def start(i):
        seen = [0]

        def on_output(out):
            seen[0] += len(out.token_ids)
            if seen[0] >= join_after and i + 1 < len(prompts) and results[i + 1] is None and not started[i + 1]:
                started[i + 1] = True
                start(i + 1)
            if out.finished:
                results[i] = out
                done[i].set()
        llm.submit(prompts[i], on_output, max_tokens=steps, ignore_eos=True, logprobs=True)

    started = [True] + [False] * (len(prompts) - 1)
    start(0)
    for ev in done:
        assert ev.wait(120), "a request never finished"
    return results


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "qwen2_vl", "qwen2_5_vl"])
def family_pair(request, tiny_models):
    path = tiny_models[request.param]
    # a small block size and token budget, so prefill runs in chunks across blocks
    llm = OnlineLLM(str(path), block_size=8, max_num_batched_tokens=24, max_num_seqs=4)
    # Qwen2(.5)-VL: the whole vision-language model in transformers (its M-RoPE over text-only positions), against
    # dark's Qwen2 decoder without the vision tower
    hf = hf_class(request.param).from_pretrained(path, dtype=torch.float32).eval()
    yield request.param, llm, hf
    llm.close()


def test_full_logits_match_hf(family_pair):
    family, llm, hf = family_pair
    ids = llm.encode(PROMPTS[1])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
        hidden = llm.model.hidden_states(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention(1, len(ids)))
        ours = llm.model.logits(hidden)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_greedy_ragged_batch_matches_hf(family_pair):
    family, llm, hf = family_pair
    outs = run_ragged(llm, PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        tokens, logprobs = hf_reference(hf, llm.encode(prompt))
        assert out.output_ids == tokens, f"{family}: greedy tokens differ for {prompt!r}"
        assert out.finish_reason == "length" and out.completion_tokens == STEPS
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family,rope", [
    ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}),
    # Qwen2.5-VL's long-context setting: yarn over the M-RoPE sections
    ("qwen2_5_vl", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                    "mrope_section": [2, 3, 3]}),
])
def test_scaled_rotary_matches_hf(tokenizer_source, tmp_path, family, rope):
    """Rotary variants transformers computes (llama3, yarn) load (their frequencies were once computed on the meta
    device the model is built on, and failed) and give transformers' logits past the original context."""
    from dark.models.decoder import load_model

    path = make_tiny(family, tmp_path / family, tokenizer_source, rope_scaling=rope)
    ids = list(range(1000, 1200))
    with torch.no_grad():
        ref = hf_class(family).from_pretrained(path, dtype=torch.float32).eval()(torch.tensor([ids])).logits[0]
        model = load_model(path, torch.device("cpu"), torch.float32)
        ours = model.logits(model.hidden_states(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention(1, len(ids))))
    assert model.rotary.scale != 1.0 or family == "llama"
    torch.testing.assert_close(ours, ref.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("theta,hidden,heads", [(1e6, 3584, 28), (1e4, 576, 9), (5e5, 4096, 32)])
def test_default_rotary_is_transformers_bit_for_bit(theta, hidden, heads):
    """The plain rotary's cos and sin, at the shapes of Qwen2.5-7B, SmolLM2 and Llama 3, equal transformers' to the
    bit up to position 32k (its frequencies in fp32 as transformers computes them; exact ones differ by an ulp, which
    was ~2e-3 of angle at 32k)."""
    from types import SimpleNamespace

    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    from dark.models.decoder import Rotary

    config = Qwen2Config(hidden_size=hidden, num_attention_heads=heads, rope_theta=theta)
    ours = Rotary(SimpleNamespace(hf_config=config, head_dim=hidden // heads, family="qwen2"))
    positions = torch.arange(32768)
    cos, sin = Qwen2RotaryEmbedding(config)(torch.zeros(1), positions[None])
    got_cos, got_sin = ours(positions, torch.float32)
    assert torch.equal(got_cos, cos[0]) and torch.equal(got_sin, sin[0])


def check_decode_ahead(llm: OnlineLLM, mode: str, steps: int = 21, prompts: list[str] = PROMPTS) -> None:
    """Decode steps launched ahead (runner.lookahead = mode) against steps launched one after the other: the same
    tokens and log-probabilities on a ragged batch (sequences joining, crossing cache blocks, ending: the step after
    an end is launched ahead without the ended ones) and on one sequence alone; and most steps taken ahead (not
    those after a join)."""
    runner = llm.engine.runner
    runner.lookahead = mode
    used, launched, narrowed = runner.ahead_used, runner.ahead_launched, runner.ahead_narrowed
    ahead = run_ragged(llm, prompts, steps=steps, join_after=3)
    alone = llm.generate(PROMPTS[0], max_tokens=steps + 9, logprobs=True)
    used, launched = runner.ahead_used - used, runner.ahead_launched - launched
    narrowed = runner.ahead_narrowed - narrowed
    runner.lookahead = "never"
    try:
        one_by_one = run_ragged(llm, prompts, steps=steps, join_after=3)
        assert llm.generate(PROMPTS[0], max_tokens=steps + 9, logprobs=True) == alone
    finally:
        runner.lookahead = "graphs"
    for a, b in zip(ahead, one_by_one):
        assert a.output_ids == b.output_ids and len(a.output_ids) == steps
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5)
    # the ragged batch decodes ~steps + 3 * 3 steps, the lone sequence steps + 8; a few are not launched ahead
    assert used > steps + (steps + 9) // 2, (used, launched)
    assert launched - used <= 2 * len(prompts) + 2, (used, launched)  # thrown away: after a join or at the end
    # the first sequences end 3 steps before those that joined: the step after goes on without them
    assert narrowed >= 1, (used, launched, narrowed)


def test_decode_steps_launched_ahead_on_the_fast_path(tiny_models):
    """The fast decode path (kernels, TRITON_INTERPRET=1 on the CPU) with each step launched before the previous
    one's tokens are read back (on the CPU only when told: "always"; the default is CUDA graphs only)."""
    pytest.importorskip("triton")
    with OnlineLLM(str(tiny_models["qwen2"]), block_size=8, max_num_seqs=4, enable_prefix_caching=False) as llm:
        llm.engine.runner.set_fast(True)
        assert llm.engine.runner.lookahead == "graphs" and not llm.engine.runner.use_graphs
        check_decode_ahead(llm, "always", steps=13, prompts=PROMPTS[:3])


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_fast_decode_path_matches_plain_path(tiny_models, family, tmp_path, monkeypatch):
    """Decode steps through the kernels (no CUDA graphs on the CPU; TRITON_INTERPRET=1) give the plain path's
    tokens and log-probabilities on a ragged batch. With the kernels on, the residual adds go into add_rms_norm,
    a single sequence's projections through the GEMV kernel,
    and Qwen2 (as Llama) rotates and stores q/k/v in one launch (qkv_rotary_store) where Qwen3 (per-head q/k
    norms) keeps rotary + store_kv."""
    pytest.importorskip("triton")
    from collections import Counter

    from dark.models.decoder import kernel_module

    calls = Counter()
    for module, name in ((kernel_module("paged_attention"), "qkv_rotary_store"),
                         (kernel_module("paged_attention"), "store_kv"), (kernel_module("norm_rope"), "add_rms_norm"),
                         (kernel_module("gemv"), "gemv")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, _real=real, _name=name, **k: calls.update([_name]) or _real(*a, **k))
    with OnlineLLM(str(tiny_models[family]), data_dir=tmp_path, block_size=8, max_num_batched_tokens=24,
                   max_num_seqs=4) as llm:
        runner = llm.engine.runner
        runner.set_fast(False)
        plain = run_ragged(llm, PROMPTS[:3], steps=6, join_after=2)
        assert not calls
        runner.set_fast(True)
        fast = run_ragged(llm, PROMPTS[:3], steps=6, join_after=2)
        assert runner.fast_steps >= 4, "the decode steps did not take the fast path"
    for p, f in zip(plain, fast):
        assert len(f.output_ids) == 6 and f.output_ids == p.output_ids
        torch.testing.assert_close(torch.tensor(f.logprobs), torch.tensor(p.logprobs), atol=1e-4, rtol=1e-4)
    assert calls["add_rms_norm"] > 0
    assert calls["gemv"] > 0  # the steps with the first request alone: one token's projections through the GEMV
    if family == "qwen3":
        assert calls["store_kv"] > 0 and calls["qkv_rotary_store"] == 0
    else:
        assert calls["qkv_rotary_store"] > 0 and calls["store_kv"] == 0


def test_preemption_keeps_outputs_exact(tiny_models):
    """A cache too small for all requests at once: sequences are preempted, recomputed, and still exact."""
    path = tiny_models["qwen2"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with OnlineLLM(str(path), block_size=8, num_kv_blocks=24, max_num_seqs=4, enable_prefix_caching=False) as llm:
        outs = llm.complete(PROMPTS, max_tokens=STEPS, ignore_eos=True)
        for prompt, out in zip(PROMPTS, outs):
            assert out.token_ids == hf_reference(hf, llm.encode(prompt))[0]
        assert llm.engine.blocks.num_free == 24


def test_smollm_matches_hf_and_names_paris(smollm_path):
    hf = AutoModelForCausalLM.from_pretrained(smollm_path, dtype=torch.float32).eval()
    with OnlineLLM() as llm:
        assert llm.model_path == smollm_path
        prompts = ["What is the capital of France?", "Name three colours."]
        outs = llm.complete(prompts, max_tokens=24, ignore_eos=True, logprobs=True)
        for prompt, out in zip(prompts, outs):
            tokens, logprobs = hf_reference(hf, llm.encode(prompt), 24)
            assert out.token_ids == tokens
            torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(logprobs), atol=2e-3, rtol=1e-3)
        assert "Paris" in llm.generate("What is the capital of France?")
