"""The engine against Hugging Face transformers on CUDA: the checks of test_engine.py, plus bf16 and LoRA.

Run on the GPU machine; the tiny models need only a tokenizer folder there:
    DARK_TEST_TOKENIZER=.data/tok python -m pytest -q -m gpu tests/test_engine_gpu.py
"""
from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from dark import OnlineLLM
from dark.engine.attention import DenseCausalAttention
from test_engine import PROMPTS, STEPS, run_ragged

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = "cuda"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_reference(hf, ids: list[int], steps: int = STEPS) -> tuple[list[int], list[float]]:
    """test_engine.hf_reference, with the inputs on the model's device."""
    out = hf.generate(torch.tensor([ids], device=hf.device), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                      pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = [torch.log_softmax(l[0].float(), -1)[t].item() for l, t in zip(out.logits, tokens)]
    return tokens, logprobs


def load_hf(path, dtype):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(CUDA).eval()


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family_pair(request, tiny_models):
    path = tiny_models[request.param]
    llm = OnlineLLM(str(path), device=CUDA, dtype="float32", block_size=8, max_num_batched_tokens=24, max_num_seqs=4)
    hf = load_hf(path, torch.float32)
    yield request.param, llm, hf
    llm.close()


def test_engine_runs_on_cuda(family_pair):
    _, llm, _ = family_pair
    assert llm.engine.device.type == "cuda" and llm.engine.cache.data.is_cuda
    assert all(p.is_cuda for p in llm.model.parameters())


def test_full_logits_match_hf(family_pair):
    family, llm, hf = family_pair
    ids = llm.encode(PROMPTS[1])
    with torch.no_grad():
        ref = hf(torch.tensor([ids], device=CUDA)).logits[0].float()
        hidden = llm.model.hidden_states(torch.tensor(ids, device=CUDA), torch.arange(len(ids), device=CUDA),
                                         DenseCausalAttention(1, len(ids)))
        ours = llm.model.logits(hidden)
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-3)


def test_greedy_ragged_batch_matches_hf(family_pair):
    family, llm, hf = family_pair
    outs = run_ragged(llm, PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        tokens, logprobs = hf_reference(hf, llm.encode(prompt))
        assert out.output_ids == tokens, f"{family}: greedy tokens differ for {prompt!r}"
        assert out.finish_reason == "length" and out.completion_tokens == STEPS
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(logprobs), atol=1e-3, rtol=1e-3)


def test_preemption_keeps_outputs_exact(tiny_models):
    path = tiny_models["qwen2"]
    hf = load_hf(path, torch.float32)
    with OnlineLLM(str(path), device=CUDA, dtype="float32", block_size=8, num_kv_blocks=24, max_num_seqs=4,
                   enable_prefix_caching=False) as llm:
        outs = llm.complete(PROMPTS, max_tokens=STEPS, ignore_eos=True)
        for prompt, out in zip(PROMPTS, outs):
            assert out.token_ids == hf_reference(hf, llm.encode(prompt))[0]
        assert llm.engine.blocks.num_free == 24


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_bf16_matches_hf_bf16(tiny_models, family):
    """bf16 rounds differently in each implementation: log-probs agree within bf16 tolerance, and greedy
    tokens agree until HF's own top two are closer than that tolerance (a tie either side may break)."""
    path = tiny_models[family]
    hf = load_hf(path, torch.bfloat16)
    with OnlineLLM(str(path), device=CUDA, dtype="bfloat16", block_size=8, max_num_seqs=4) as llm:
        assert llm.model.lm_head.weight.dtype == torch.bfloat16
        ids = llm.encode(PROMPTS[2])
        with torch.no_grad():
            ref = hf(torch.tensor([ids], device=CUDA)).logits[0, -1].float().log_softmax(-1)
            hidden = llm.model.hidden_states(torch.tensor(ids, device=CUDA), torch.arange(len(ids), device=CUDA),
                                             DenseCausalAttention(1, len(ids)))
            ours = llm.model.logits(hidden)[-1].log_softmax(-1)
        torch.testing.assert_close(ours, ref, atol=5e-2, rtol=0)

        steps = 8
        out = llm.complete(PROMPTS[2], max_tokens=steps, ignore_eos=True, logprobs=True)
        gen = hf.generate(torch.tensor([ids], device=CUDA), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        tokens = gen.sequences[0, len(ids):].tolist()
        for i, (logits, t) in enumerate(zip(gen.logits, tokens)):
            top2 = logits[0].float().topk(2).values
            if out.token_ids[i] != t:
                assert float(top2[0] - top2[1]) < 5e-2, f"{family}: greedy token {i} differs without a near tie"
                break
            lp = float(logits[0].float().log_softmax(-1)[t])
            assert abs(out.logprobs[i] - lp) < 5e-2, f"{family}: log-prob of token {i}: {out.logprobs[i]} vs {lp}"


def test_mixed_adapters_match_peft_on_cuda(tiny_models, tmp_path):
    """Two PEFT adapters and none, in one batch on CUDA, each equal to PEFT alone (fp32)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    base = tiny_models["qwen2"]
    folders = {}
    for name, seed, targets in (("a", 1, LORA_TARGETS), ("b", 2, ["q_proj", "v_proj", "down_proj", "lm_head"])):
        torch.manual_seed(seed)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                               LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.mul_(4.0)
        model.save_pretrained(tmp_path / name)
        folders[name] = tmp_path / name
    with OnlineLLM(str(base), device=CUDA, dtype="float32", block_size=8, max_num_seqs=8) as llm:
        for name, folder in folders.items():
            llm.load_adapter(name, folder)
        jobs = [(a, p) for a in ("a", "b", None) for p in PROMPTS[:2]]
        done, results = threading.Event(), {}

        def collect(key):
            def cb(out):
                if out.finished:
                    results[key] = out
                    if len(results) == len(jobs):
                        done.set()
            return cb

        for adapter, prompt in jobs:
            llm.submit(prompt, collect((adapter, prompt)), adapter=adapter, max_tokens=16, ignore_eos=True, logprobs=True)
        assert done.wait(120)
        for adapter, prompt in jobs:
            ref = load_hf(base, torch.float32)
            if adapter is not None:
                ref = PeftModel.from_pretrained(ref, folders[adapter]).eval()
            tokens, logprobs = hf_reference(ref, llm.encode(prompt), 16)
            out = results[(adapter, prompt)]
            assert out.output_ids == tokens, f"adapter {adapter}: tokens differ from PEFT for {prompt!r}"
            torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(logprobs), atol=1e-3, rtol=1e-3)
            if prompt == PROMPTS[0] and adapter is not None:
                # alone: batch-1 decode steps, the GEMV adding the adapter's delta itself
                steps = llm.engine.runner.fast_steps
                finished, got = threading.Event(), []
                llm.submit(prompt, lambda o: o.finished and (got.append(o) or finished.set()), adapter=adapter,
                           max_tokens=16, ignore_eos=True, logprobs=True)
                assert finished.wait(60)
                alone = got[0]
                assert llm.engine.runner.fast_steps - steps >= 14
                assert alone.output_ids == tokens, f"adapter {adapter} alone: tokens differ from PEFT"
                torch.testing.assert_close(torch.tensor(alone.logprobs), torch.tensor(logprobs), atol=1e-3, rtol=1e-3)


def test_graphs_captured_again_after_all_were_dropped(tiny_models):
    """Dropping every captured decode graph (new buffers, set_fast) and capturing again works and gives the same
    tokens: the runner takes a fresh memory pool (capturing into the released pool of the dropped graphs fails)."""
    with OnlineLLM(str(tiny_models["qwen2"]), device=CUDA, dtype="float32", block_size=8, max_num_seqs=4) as llm:
        runner = llm.engine.runner
        assert runner.use_graphs
        first = llm.generate(PROMPTS[:2], max_tokens=12)
        assert runner._graphs
        runner.set_fast(True)  # drops every graph and its pool
        assert not runner._graphs
        assert llm.generate(PROMPTS[:2], max_tokens=12) == first
        assert runner._graphs


def test_decode_steps_launched_ahead_give_the_same_tokens(tiny_models):
    """On CUDA graphs (the default there), decode steps launched before the previous step's tokens are read back
    give the tokens of steps launched one after the other, and most steps of a ragged batch are taken that way."""
    from test_engine import check_decode_ahead

    with OnlineLLM(str(tiny_models["qwen2"]), device=CUDA, dtype="float32", block_size=8, max_num_seqs=4,
                   enable_prefix_caching=False) as llm:
        assert llm.engine.runner.use_graphs and llm.engine.runner.lookahead == "graphs"
        check_decode_ahead(llm, "graphs")


def test_split_gives_two_disjoint_partitions_that_compute():
    """dark.engine.green.split: the two partitions' SMs add up to the device's (none shared), and work queued on
    each stream (ordinary torch operations and a Triton kernel's launch) gives the same values as on the default
    stream. Asking for every SM or none is refused with the reason."""
    from dark.engine.green import split
    from kernels.norm_rope import rms_norm

    total = torch.cuda.get_device_properties(0).multi_processor_count
    part, rest = split(torch.device(CUDA), 24)
    assert part.sms >= 24 and rest.sms >= 1 and part.sms + rest.sms <= total
    x = torch.randn(256, 512, device=CUDA)
    w = torch.randn(512, device=CUDA)
    want = (x @ x.T, rms_norm(x, w, 1e-6))
    for p in (part, rest):
        with torch.cuda.stream(p.stream):
            got = (x @ x.T, rms_norm(x, w, 1e-6))
        p.stream.synchronize()
        torch.testing.assert_close(got, want)
    for bad in (0, total):
        with pytest.raises(ValueError, match="0 < sms"):
            split(torch.device(CUDA), bad)


def test_decoding_in_a_partition_while_learning_gives_the_same_tokens(tiny_models):
    """With serving's partition set (as a learn job does), the engine's steps move to that stream and back, and the
    greedy tokens (graphs replayed there, then on every SM again) are those decoded on every SM."""
    from dark.engine.green import split

    with OnlineLLM(str(tiny_models["qwen2"]), device=CUDA, dtype="float32", block_size=8, max_num_seqs=4) as llm:
        engine = llm.engine
        first = llm.generate(PROMPTS[:3], max_tokens=12)
        serve, _ = split(torch.device(CUDA), 16)
        used = []
        engine.serve_in_partition(serve.stream, lambda: used.append(torch.cuda.current_stream()) or True,
                                  sms=serve.sms)
        assert engine.runner.partition_sms == serve.sms  # kernels sizing grids by SMs plan for the partition's
        assert llm.generate(PROMPTS[:3], max_tokens=12) == first
        assert used and engine.runner._replay_stream == serve.stream
        # captured again on the partition's stream (a graph's kernels run on the SMs it was captured on)
        assert any(key[-1] == serve.stream.cuda_stream for key in engine.runner._graphs)
        engine.serve_in_partition(None)
        assert engine.runner.partition_sms is None
        assert llm.generate(PROMPTS[:3], max_tokens=12) == first
        assert engine.runner._replay_stream == engine.stream


def test_after_the_serving_warm_up_the_first_requests_compile_and_capture_nothing(tiny_models, tmp_path, triton_compiles):
    """The warm-up (on by default on CUDA: dark.engine.warm) compiled every kernel variant and captured every decode
    graph that a first request alone, four at once, one joining another as it decodes, and a first request on an
    adapter of the default LoRA shape need: none of them compiles a Triton kernel or captures a graph (on an H200
    at 7B with an empty Triton cache they waited 2.5 s and 8.3 s without it). bf16, the 7B's head layout."""
    from dark.config import LoraConfig
    from dark.engine.sequence import SamplingParams
    from dark.lora.weights import AdapterWeights

    compiled = triton_compiles
    with OnlineLLM(str(tiny_models["qwen2"]), data_dir=tmp_path, device=CUDA, dtype="bfloat16", max_num_seqs=8) as llm:
        assert llm.warm_serving_seconds > 0 and compiled  # the warm-up compiled what the requests below use
        runner = llm.engine.runner
        graphs, before = set(runner._graphs), len(compiled)
        assert {(1, False, True), (4, False, True), (1, True, True)} <= {k[:3] for k in graphs}
        mc = llm.model.config
        weights = AdapterWeights.init(LoraConfig().validate(), mc.projection_shapes(), mc.num_layers, seed=3)
        for _, (a, b) in weights.tensors.items():
            b.normal_(0, 0.05)
        llm.engine.adapters.publish("skill", 1, weights)
        llm.generate(PROMPTS[0], max_tokens=12)
        llm.generate(PROMPTS[:4], max_tokens=12)
        done, outs = threading.Event(), []
        first = threading.Event()
        llm.submit(PROMPTS[1], lambda o: (first.set(), o.finished and (outs.append(o) or done.set())), max_tokens=30,
                   ignore_eos=True)
        assert first.wait(60)
        joined = llm.generate(PROMPTS[2], max_tokens=6)
        assert done.wait(60) and isinstance(joined, str)
        with_adapter = llm.complete(PROMPTS[0], adapter="skill", max_tokens=12, ignore_eos=True)
        assert with_adapter.adapter == ("skill", 1)
        # prompts of other lengths than the warm-up's own, alone and on the adapter (each a step of its own length;
        # a 256-token prompt on an adapter compiled a kernel variant at 7B that the 55-token one had not)
        ids = llm.encode(" ".join(PROMPTS) * 40)
        for n in (9, 37, 101, 170, 256, 300, 480):
            for adapter in (None, ("skill", 1)):
                done, outs = threading.Event(), []
                llm.engine.add_request(ids[n:2 * n], SamplingParams(max_tokens=2, ignore_eos=True), adapter,
                                       lambda o: o.finished and (outs.append(o) or done.set()))
                assert done.wait(60) and outs[0].error is None
        assert compiled[before:] == [], f"compiled after the warm-up: {compiled[before:]}"
        assert set(runner._graphs) == graphs, f"captured after the warm-up: {set(runner._graphs) - graphs}"
