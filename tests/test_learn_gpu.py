"""Learning beside serving on CUDA (kernels and CUDA graphs on the serving side), on a tiny random Qwen2."""
from __future__ import annotations

import threading

import pytest
import torch

from dark import OnlineLLM
from dark.config import LORA_TARGETS

DEVICE = "cuda" if torch.cuda.is_available() else None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE is None, reason="needs CUDA")]


def relative_distance(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """|got - want| / |want| over all the tensors (one norm, in fp64); want must not be all zeros."""
    num = sum(float((x - y).double().square().sum()) for x, y in zip(got, want))
    den = sum(float(y.double().square().sum()) for y in want)
    assert den > 0, "nothing to compare against: the reference is all zeros"
    return (num / den) ** 0.5


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


def test_batched_transfers_round_trip_on_cuda():
    """The trainer's one-transfer moves (factors and optimizer moments) give back exactly what went in."""
    from dark.learn.trainer import Staging, _state_to_device, _state_to_host, to_device, to_host

    dev = torch.device("cuda")
    staging = Staging()
    host = [torch.randn(16, 40), torch.randn(72, 16), torch.randn(3)]
    moved = to_device(host, dev, staging)
    assert all(m.device.type == "cuda" and m.shape == h.shape and torch.equal(m.cpu(), h) for m, h in zip(moved, host))
    moved[0].add_(1)  # each result owns its storage
    assert torch.equal(moved[1].cpu(), host[1])
    back = to_host(moved, staging)
    assert torch.equal(back[0], host[0] + 1) and torch.equal(back[2], host[2])
    again = to_device(host, dev, staging)  # the staging buffer reused: the earlier results own their storage
    assert torch.equal(back[0], host[0] + 1) and torch.equal(again[1].cpu(), host[1])
    state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(16, 40), "exp_avg_sq": torch.rand(16, 40)}},
             "param_groups": [{"lr": 1e-3, "params": [0]}]}
    on_dev = _state_to_device(state, dev)
    assert on_dev["state"][0]["exp_avg"].device.type == "cuda" and on_dev["state"][0]["step"].device.type == "cpu"
    again = _state_to_host(on_dev["state"])
    for n in ("step", "exp_avg", "exp_avg_sq"):
        assert torch.equal(again[0][n], state["state"][0][n])


def test_moments_travel_while_the_caller_works():
    """MomentsIn: the moments gathered on a helper thread while the caller's stream works arrive exactly, as views of
    one device tensor allocated at take(); the staging buffer is refilled only after that copy is done."""
    import concurrent.futures

    from dark.learn.trainer import MomentsIn, Staging

    dev = torch.device("cuda")
    staging, pool = Staging(), concurrent.futures.ThreadPoolExecutor(1)
    state = {"state": {i: {"step": torch.tensor(float(i)), "exp_avg": torch.randn(64, 300),
                           "exp_avg_sq": torch.rand(300, 64)} for i in range(5)},
             "param_groups": [{"lr": 1e-3, "params": list(range(5))}]}
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        busy = torch.randn(4096, 4096, device=dev)
        moving = MomentsIn(state, dev, staging, pool)
        for _ in range(8):  # the caller's stream keeps working meanwhile
            busy = busy @ busy / 64
        got = moving.take()
        sums = torch.stack([got["state"][i][n].sum() for i in range(5) for n in ("exp_avg", "exp_avg_sq")])
        # a second state through the same buffer right away: it waits for the first copy before refilling
        other = {"state": {0: {"step": torch.tensor(9.0), "exp_avg": torch.full((64, 300), 3.0),
                               "exp_avg_sq": torch.full((300, 64), 4.0)}}, "param_groups": [{"lr": 1e-3, "params": [0]}]}
        got2 = MomentsIn(other, dev, staging, pool).take()
    torch.cuda.synchronize()
    for i in range(5):
        assert got["state"][i]["step"] == state["state"][i]["step"]
        for n in ("exp_avg", "exp_avg_sq"):
            assert got["state"][i][n].device.type == "cuda"
            assert torch.equal(got["state"][i][n].cpu(), state["state"][i][n])
    want = torch.stack([state["state"][i][n].sum() for i in range(5) for n in ("exp_avg", "exp_avg_sq")])
    torch.testing.assert_close(sums.cpu(), want, rtol=1e-4, atol=1e-3)
    assert (got2["state"][0]["exp_avg"] == 3).all() and (got2["state"][0]["exp_avg_sq"] == 4).all()
    pool.shutdown()


def test_moments_in_parked_and_out_through_one_staging_buffer(tiny_models, tmp_path):
    """On CUDA the trainer moves factors in, a warm state's moments in (gathered on a helper thread), parks the
    moments between steps and moves everything out through one pinned buffer, each move waiting for the last one's
    asynchronous copy: two jobs in a row train exactly what they train with the moments kept on the device."""
    from dark.config import LearnConfig, LoraConfig
    from dark.lora.weights import AdapterWeights

    with OnlineLLM(str(tiny_models["qwen2"]), data_dir=tmp_path, device=DEVICE, dtype="bfloat16") as llm:
        tr = llm.learner.trainer
        mc = llm.model.config
        examples = [{"prompt": "A greeting in Zoggian", "response": "zog"},
                    {"prompt": "How to say 'hello' in Zoggian?", "response": "zog"}]
        from dark.learn.data import normalize_examples

        out = {}
        for park in (False, True):
            cfg = LearnConfig(max_steps=3, min_steps=3, kl_weight=0.0, park_moments=park).validate()
            items = tr.build_items(normalize_examples(examples, "sft"), [], "sft", cfg)
            start = AdapterWeights.init(LoraConfig().validate(), mc.projection_shapes(), mc.num_layers, seed=1)
            first = tr.train(start, None, items, cfg)
            state = tr.optimizer_state_to_host(first.optimizer_state)
            second = tr.train(first.weights, state, items, cfg)
            out[park] = (first, second, tr.optimizer_state_to_host(second.optimizer_state))
        for x, y in zip(out[False][:2], out[True][:2]):
            assert x.losses == y.losses
            for k in x.weights.tensors:
                assert all(torch.equal(u, v) for u, v in zip(x.weights.tensors[k], y.weights.tensors[k]))
        kept, parked = out[False][2]["state"], out[True][2]["state"]
        for i in kept:
            for n in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(kept[i][n], parked[i][n])


def test_checkpointed_layer_inputs_wait_on_the_host(tiny_models, tmp_path):
    """InputsToHost: a checkpointed pass's layer inputs wait for backward in pinned host memory. After the
    forward the device holds none of them (the pass without it holds one [tokens, hidden] tensor a layer), and
    the backward gives the same gradients, bit for bit. And a whole job trains the same weights either way."""
    from dark.config import LearnConfig, LoraConfig
    from dark.engine.attention import SharedPrefixAttention
    from dark.learn.data import normalize_examples
    from dark.learn.offload import InputsToHost
    from dark.learn.trainer import TrainLoRA
    from dark.lora.weights import AdapterWeights

    with OnlineLLM(str(tiny_models["qwen2"]), data_dir=tmp_path, device=DEVICE, dtype="bfloat16") as llm:
        model, mc, dev = llm.model, llm.model.config, torch.device(DEVICE)
        start = AdapterWeights.init(LoraConfig(target_modules=LORA_TARGETS).validate(), mc.projection_shapes(),
                                    mc.num_layers, seed=3)
        params = {k: (a.to(dev).requires_grad_(), (torch.randn_like(b) * 0.05).to(dev).requires_grad_())
                  for k, (a, b) in start.tensors.items()}
        lora = TrainLoRA(params, start.scaling, {m: o for m, (_, o) in mc.projection_shapes().items()})
        tokens = 8192
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, mc.vocab_size, (tokens,), generator=gen).to(dev)
        pos = torch.arange(tokens, device=dev) % 512
        attn = SharedPrefixAttention(0, tokens // 512, 512, dev)
        saved = InputsToHost(dev)
        kept, grads = {}, {}
        for to_host in (False, True):
            for a, b in params.values():
                a.grad = b.grad = None
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            hidden = model.hidden_states(ids, pos, attn, lora.prepared(torch.bfloat16), checkpoint=True,
                                         saved=saved if to_host else None)
            torch.cuda.synchronize()
            torch.empty(1, device=dev)  # the allocator frees blocks whose side-stream use has ended at its next call
            kept[to_host] = torch.cuda.memory_allocated() - before - hidden.numel() * hidden.element_size()
            hidden.float().square().mean().backward()
            # every factor of the layers (the LM head's, in LORA_TARGETS, takes no part in hidden states)
            grads[to_host] = [t.grad.clone() for k, p in params.items() if k[1] != "lm_head" for t in p]
        layer_input = tokens * mc.hidden_size * 2
        assert saved.moved == mc.num_layers * layer_input, (saved.moved, layer_input)
        # every layer's input but the last layer's came back ahead of its backward, on the side stream
        assert saved.prefetched == mc.num_layers - 1, saved.prefetched
        assert kept[False] - kept[True] >= mc.num_layers * layer_input, kept
        # the same gradients (within the rounding of flash attention's atomic adds in backward)
        assert relative_distance(grads[True], grads[False]) < 1e-3

        tr = llm.learner.trainer
        examples = normalize_examples([{"prompt": "A greeting in Zoggian", "response": "zog"}], "sft")
        out = {}
        moved = saved.moved
        for to_host in (False, True):
            cfg = LearnConfig(max_steps=3, min_steps=3, kl_weight=0.0, checkpoint_tokens=0, kv_loan=False,
                              inputs_to_host_tokens=0 if to_host else -1).validate()
            out[to_host] = tr.train(start, None, tr.build_items(examples, [], "sft", cfg), cfg)
        assert tr._inputs_to_host.moved > (moved if tr._inputs_to_host is saved else 0)
        assert out[True].losses == pytest.approx(out[False].losses, rel=1e-3), (out[True].losses, out[False].losses)
        num = sum(float((u - v).square().sum()) for k in start.tensors
                  for u, v in zip(out[True].weights.tensors[k], out[False].weights.tensors[k]))
        den = sum(float((v - s).square().sum()) for k in start.tensors
                  for v, s in zip(out[False].weights.tensors[k], start.tensors[k]))
        assert (num / den) ** 0.5 < 1e-2, (num, den)


def shared_prefix_pass(mc, dev):
    """Random LoRA factors on every projection (B not zero) and a random shared-prefix batch of 940 tokens (40 shared,
    3 x 300) with random weights for a loss on its hidden states: params, the TrainLoRA, ids, positions, the loss's
    weights, the attention."""
    from dark.config import LoraConfig
    from dark.engine.attention import SharedPrefixAttention
    from dark.learn.trainer import TrainLoRA
    from dark.lora.weights import AdapterWeights

    start = AdapterWeights.init(LoraConfig(target_modules=LORA_TARGETS).validate(), mc.projection_shapes(),
                                mc.num_layers, seed=3)
    params = {k: (a.to(dev).requires_grad_(), (torch.randn_like(b) * 0.05).to(dev).requires_grad_())
              for k, (a, b) in start.tensors.items()}
    lora = TrainLoRA(params, start.scaling, {m: o for m, (_, o) in mc.projection_shapes().items()})
    prefix, batch, length = 40, 3, 300
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, mc.vocab_size, (prefix + batch * length,), generator=gen).to(dev)
    pos = torch.tensor(list(range(prefix)) + list(range(prefix, prefix + length)) * batch, device=dev)
    weight = torch.randn(prefix + batch * length, mc.hidden_size, generator=gen).to(dev)
    return params, lora, ids, pos, weight, SharedPrefixAttention(prefix, batch, length, dev)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_hand_written_layer_backward_on_the_kernels(tiny_models, tmp_path, dtype, monkeypatch):
    """dark.models.train_layer on CUDA, where it runs dark's Triton norm, rotary and SiLU kernels and their
    backward kernels, and SDPA's fused attention: the hidden states and LoRA gradients of the reentrant checkpoint
    (autograd through the same kernels' Functions), within the rounding of the dtype, for a shared-prefix batch."""
    from dark.models import train_layer

    with OnlineLLM(str(tiny_models["qwen2"]), data_dir=tmp_path, device=DEVICE, dtype=dtype) as llm:
        model, mc, dev = llm.model, llm.model.config, torch.device(DEVICE)
        assert model.model.layers[0].self_attn.fused  # the kernels' path
        dt = getattr(torch, dtype)
        params, lora, ids, pos, weight, attn = shared_prefix_pass(mc, dev)
        by_hand = []
        counted = train_layer._LayerPass.apply
        monkeypatch.setattr(train_layer._LayerPass, "apply", lambda *a: by_hand.append(1) or counted(*a))
        hidden, grads = {}, {}
        for form in ("1", "0"):
            monkeypatch.setenv("DARK_LAYER_PASS", form)
            for a, b in params.values():
                a.grad = b.grad = None
            h = model.hidden_states(ids, pos, attn, lora.prepared(dt), checkpoint=True)
            (h.float() * weight).sum().backward()
            hidden[form] = h.detach().float()
            grads[form] = [t.grad.clone() for k, p in params.items() if k[1] != "lm_head" for t in p]
            assert len(by_hand) == mc.num_layers  # the hand-written pass ran in every layer, once (form "1")
        torch.testing.assert_close(hidden["1"], hidden["0"])  # the same kernels forward
        assert relative_distance(grads["1"], grads["0"]) < (1e-4 if dtype == "float32" else 2e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layers_kept_in_lent_kv_blocks_on_the_kernels(tiny_models, tmp_path, dtype):
    """dark.engine.loan on CUDA: a checkpointed pass whose layers keep their activations in blocks the engine lent
    gives the hidden states and LoRA gradients of the same pass recomputing every layer (the same kernels on the same
    inputs: equal to the dtype's rounding at most), every layer finds room, and the blocks go back zeroed."""
    from dark.engine.loan import KVLender
    from dark.models import train_layer

    with OnlineLLM(str(tiny_models["qwen2"]), data_dir=tmp_path, device=DEVICE, dtype=dtype) as llm:
        model, mc, dev = llm.model, llm.model.config, torch.device(DEVICE)
        dt = getattr(torch, dtype)
        params, lora, ids, pos, weight, attn = shared_prefix_pass(mc, dev)
        lender = KVLender(llm.engine)
        free = llm.engine.blocks.num_free
        loan = lender.borrow([train_layer.kept_shapes(layer, len(ids)) for layer in model.model.layers], dt)
        assert loan is not None
        hidden, grads = {}, {}
        for use in (None, loan):
            for a, b in params.values():
                a.grad = b.grad = None
            h = model.hidden_states(ids, pos, attn, lora.prepared(dt), checkpoint=True, loan=use)
            (h.float() * weight).sum().backward()
            hidden[use is not None] = h.detach().float()
            grads[use is not None] = [t.grad.clone() for k, p in params.items() if k[1] != "lm_head" for t in p]
        assert loan.placed == mc.num_layers and loan._live == 0
        torch.testing.assert_close(hidden[True], hidden[False], rtol=0, atol=0)
        assert relative_distance(grads[True], grads[False]) < (1e-5 if dtype == "float32" else 1e-2)
        lender.give_back(loan)
        assert llm.engine.blocks.num_free == free
        assert not bool(llm.engine.cache.data[:, :, loan.start:loan.start + loan.count].any())


def test_a_job_with_a_kv_loan_projects_through_a_cuda_graph(tiny_models, tmp_path, monkeypatch):
    """A checkpointed job of several steps on CUDA borrows KV blocks, copies the protector's bases into them once,
    and replays its projection as a CUDA graph captured at the first step: the weights of the same job projecting
    eagerly (DARK_PROTECT_GRAPH=0), every block free again after each; so does a job that gives its loan (and the
    graph with it) back after two steps, serving having run short of blocks."""
    from dark.config import LearnConfig, LoraConfig
    from dark.learn.data import normalize_examples
    from dark.lora.weights import AdapterWeights

    with OnlineLLM(str(tiny_models["qwen2"]), data_dir=tmp_path, device=DEVICE, dtype="bfloat16") as llm:
        tr, mc = llm.learner.trainer, llm.model.config
        free = llm.engine.blocks.num_free
        start = AdapterWeights.init(LoraConfig(target_modules=LORA_TARGETS).validate(), mc.projection_shapes(),
                                    mc.num_layers, seed=3)
        examples = normalize_examples([{"prompt": "A greeting in Zoggian", "response": "zog"},
                                       {"prompt": "How to say 'hello' in Zoggian?", "response": "zog"}], "sft")
        out = {}

        def short_after_two(step, loss):  # serving runs short of blocks: the loan (and the graph) go mid-job
            if step == 2:
                llm.engine.blocks.short = True

        for graph in ("1", "0", "1, given back"):
            monkeypatch.setenv("DARK_PROTECT_GRAPH", graph[0])
            cfg = LearnConfig(max_steps=4, min_steps=4, kl_weight=0.0, checkpoint_tokens=0).validate()
            out[graph] = tr.train(start, None, tr.build_items(examples, [], "sft", cfg), cfg,
                                  short_after_two if "given" in graph else None)
            assert llm.engine.blocks.num_free == free and not llm.engine.blocks.short
        assert out["1"].kv_loan["projection_graph"] and not out["0"].kv_loan["projection_graph"]
        assert out["1"].kv_loan["bases_bytes"] > 0
        assert out["1, given back"].kv_loan["given_back_early"] and not out["1"].kv_loan["given_back_early"]
        for graph in ("1", "1, given back"):
            assert out[graph].losses == pytest.approx(out["0"].losses, rel=1e-3)
            num = sum(float((u - v).square().sum()) for k in start.tensors
                      for u, v in zip(out[graph].weights.tensors[k], out["0"].weights.tensors[k]))
            den = sum(float((v - s).square().sum()) for k in start.tensors
                      for v, s in zip(out["0"].weights.tensors[k], start.tensors[k]))
            assert (num / den) ** 0.5 < 1e-3, (graph, num, den)


def test_a_learned_version_goes_into_its_slot_from_the_device_copy_it_trained(tiny_models, tmp_path):
    """A learn job on CUDA leaves its new version's factors on the device in the slots' layout (AdapterSlots.stage);
    the version's first request loads them from there (no host copy), to the same bits a load from the host copy
    gives, and answers as the version loaded from its saved folder does."""
    with OnlineLLM(str(tiny_models["qwen2"]), data_dir=tmp_path, device=DEVICE, dtype="bfloat16",
                   max_adapter_slots=3) as llm:
        llm.learn([{"prompt": "A greeting in Zoggian", "response": "zog"}], adapter="zog", max_steps=3)
        mgr = llm.engine.adapters
        version = mgr.current("zog")
        staged = mgr._staged[("zog", version)]
        assert staged and all(a.device.type == "cuda" and a.dtype == torch.bfloat16 for a, _ in staged.values())
        answer = llm.generate("A greeting in Zoggian", adapter="zog", max_tokens=6)
        assert mgr._staged == {}  # the first request took them
        slot = mgr._slot_of[("zog", version)]
        other = next(s for s in range(3) if s != slot and mgr.slots.rank[s] == 0)
        mgr.slots.load(other, mgr.weights("zog", version))  # from the host copy
        torch.cuda.synchronize()
        for key in mgr.slots.A:
            assert torch.equal(mgr.slots.A[key][slot], mgr.slots.A[key][other]), key
            assert torch.equal(mgr.slots.B[key][slot], mgr.slots.B[key][other]), key
        mgr.slots.rank[other] = 0
        path = tmp_path / "copy"
        mgr.weights("zog", version).save(path)
        assert llm.load_adapter("zog-copy", path) == 1
        assert llm.generate("A greeting in Zoggian", adapter="zog-copy", max_tokens=6) == answer
