"""Free KV-cache blocks lent to training (dark.engine.loan): the block manager lends a run of free blocks and takes
it back, a loan places tensors without overlap and frees them with the last release, and a checkpointed pass whose
layers keep their activations there gives the gradients of the plain pass without running any projection again in
backward, on a tiny random model on the CPU, through the real engine and trainer."""
from __future__ import annotations

import gc
import math

import pytest
import torch

from dark import OnlineLLM
from dark.config import LORA_TARGETS, LearnConfig, LoraConfig
from dark.engine.attention import KVCache
from dark.engine.block_manager import BlockManager
from dark.engine.loan import KEEP_FREE, KVLender, Loan
from dark.engine.attention import SharedPrefixAttention
from dark.engine.sequence import SamplingParams, Sequence
from dark.learn.trainer import TrainLoRA
from dark.lora.weights import AdapterWeights
from dark.models import train_layer

from test_train_memory import (CONVS, assert_grads_close, grads, hidden_pass, shared_prefix_batch, weights_distance,
                               zero_grads)


def seq_of(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams(max_tokens=4), None, lambda out: None, 4096)


def test_the_block_manager_lends_the_highest_free_run_and_takes_it_back():
    bm = BlockManager(64, 4)
    a = seq_of(list(range(20)))  # 5 blocks, the lowest ids, hashed for prefix reuse once computed
    assert bm.allocate(a)
    a.num_computed = 20
    bm.commit(a)
    assert bm.lend(16, keep_free=8) == 48
    assert all(b not in bm.free for b in range(48, 64)) and bm.num_free == 64 - 5 - 16
    assert bm.lend(16, keep_free=8) == 32          # the next highest run
    assert bm.lend(16, keep_free=12) is None       # 27 free: lending 16 would leave fewer than 12
    bm.free_seq(a)                                 # its blocks free again, still in the prefix cache
    hashed = [b for b in range(5) if bm.hash_of[b] is not None]
    assert hashed and bm.num_free == 32
    assert bm.lend(32, keep_free=0) == 0           # every free block: the run 0..31, prefix entries dropped
    assert all(bm.hash_of[b] is None for b in hashed) and not bm.by_hash
    b = seq_of(list(range(20)))
    assert not bm.allocate(b)                      # nothing free, and nothing cached to reuse
    for start in (0, 32, 48):
        bm.take_back(start, 32 if start == 0 else 16)
    assert bm.num_free == 64
    with pytest.raises(ValueError, match="not lent"):
        bm.take_back(48, 16)
    assert bm.allocate(b) and b.num_computed == 0  # a fresh prefill: the cached keys went with the loan


def test_serving_short_of_blocks_while_some_are_lent_says_so():
    bm = BlockManager(16, 4)
    assert not bm.allocate(seq_of(list(range(80)))) and not bm.short  # too long, but nothing is lent
    start = bm.lend(8, keep_free=4)
    assert bm.lent == 8
    assert not bm.allocate(seq_of(list(range(40)))) and bm.short      # 10 blocks wanted, 8 free: the loan is in the way
    bm.take_back(start, 8)
    assert bm.lent == 0 and not bm.short
    s = seq_of(list(range(40)))
    assert bm.allocate(s)
    start = bm.lend(4, keep_free=0)
    assert not bm.ensure(s, 60) and bm.short                          # a running sequence cannot grow


def test_a_loan_places_tensors_apart_and_frees_them_with_the_last_release():
    cache = KVCache(num_layers=2, num_blocks=32, block_size=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                    device=torch.device("cpu"))
    loan = Loan(cache.data, 8, 16)               # 4 regions of 16 blocks x 4 x 2 x 16 = 2048 elements
    assert loan.nbytes == 4 * 2048 * 4
    first = loan.place([(10, 100), (3, 7)])      # 1000 elements and 21
    second = loan.place([(2000,)])               # too big for a region that holds anything: its own region
    assert first is not None and second is not None
    tensors = first.tensors + second.tensors
    for i, t in enumerate(tensors):
        t.fill_(i + 1)
    for i, t in enumerate(tensors):               # no two overlap, and all of them lie in the lent blocks
        assert bool((t == i + 1).all())
    lent = cache.data[:, :, 8:24]
    assert float(lent.sum()) == sum((i + 1) * t.numel() for i, t in enumerate(tensors))
    assert float(cache.data.sum()) == float(lent.sum())
    assert loan.place([(2049,)]) is None          # larger than any region
    assert loan.place([(1000,)] * 5) is None      # all or nothing: room for four more of 1000 (two empty regions)
    third = loan.place([(1000,)] * 4)             # ... which the failed call left as it was
    assert third is not None
    first.release()
    first.release()                               # once
    assert loan.place([(2048,)]) is None          # the others still live: no region has been emptied
    del second, tensors
    gc.collect()                                  # dropped without a release: released when collected
    assert loan._live == 1
    third.release()                               # every placement released: the next starts from the beginning
    assert loan._live == 0 and loan.place([(2048,)] * 4) is not None
    held = loan.hold(1000)                        # for the loan's life, at the end of the last region
    assert held is not None and held.numel() == 1000
    held.fill_(-1.0)
    assert loan.place([(2048,)] * 4) is None      # placements keep out of it
    everything = loan.place([(2048,)] * 3 + [(1000,)])
    assert everything is not None
    for t in everything.tensors:
        t.fill_(5.0)
    assert bool((held == -1).all())


def fp64_model(tiny_models, family="qwen2"):
    from dark.models.decoder import load_model

    model = load_model(tiny_models[family], torch.device("cpu"), torch.float64)
    weights = AdapterWeights.init(LoraConfig(r=4, target_modules=LORA_TARGETS).validate(),
                                  model.config.projection_shapes(), model.config.num_layers, 0)
    gen = torch.Generator().manual_seed(1)
    params = {k: (a.double().requires_grad_(), (torch.randn(b.shape, generator=gen, dtype=torch.float64) * 0.05)
                  .requires_grad_()) for k, (a, b) in weights.tensors.items()}
    lora = TrainLoRA(params, weights.scaling, {m: o for m, (_, o) in model.config.projection_shapes().items()})
    cache = KVCache(model.config.num_layers, 256, 16, model.config.num_kv_heads, model.config.head_dim,
                    torch.float64, torch.device("cpu"))
    return model, lora, cache


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("blocks", [256, 1])  # room for every layer / for none of them (each checkpoints then)
def test_layers_kept_in_a_loan_give_the_plain_gradients_and_run_no_projection_again(tiny_models, family, blocks,
                                                                                    monkeypatch):
    """In fp64, against autograd through the whole model: the same hidden states and LoRA gradients to 1e-10; in
    backward no F.linear runs (each layer's projections ran once, in the forward), where the recompute of a
    checkpointed layer runs three (q/k/v, o_proj, gate/up); the loan is empty again after backward."""
    model, lora, cache = fp64_model(tiny_models, family)
    loan = Loan(cache.data, 0, blocks)
    plain = hidden_pass(model, lora, seed=2, checkpoint=False)

    linear, in_backward = torch.nn.functional.linear, []
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **k: in_backward.append(1) or linear(*a, **k))

    ids, pos, weight = shared_prefix_batch(model, 5, 2, 9, seed=2)  # hidden_pass's batch, in steps
    zero_grads(lora)
    hidden = model.hidden_states(ids, pos, SharedPrefixAttention(5, 2, 9, torch.device("cpu")), lora,
                                 checkpoint=True, loan=loan)
    loss = (hidden * weight).sum() + model.logits(hidden[-4:], lora).logsumexp(-1).sum()
    in_backward.clear()
    loss.backward()
    kept = loan.placed
    assert kept == (model.config.num_layers if blocks == 256 else 0)
    assert len(in_backward) == (0 if kept else 3 * model.config.num_layers)
    assert loan._live == 0
    torch.testing.assert_close(hidden.detach(), plain[0], rtol=1e-12, atol=1e-12)
    assert_grads_close(grads(lora), plain[2], rtol=1e-10)


@pytest.fixture(scope="module")
def llm(tiny_models, tmp_path_factory):
    with OnlineLLM(str(tiny_models["qwen2"]), data_dir=tmp_path_factory.mktemp("kv-loan")) as llm:
        yield llm


def test_a_job_borrows_free_blocks_trains_the_same_weights_and_gives_them_back(llm):
    """train() with every pass checkpointed, on the real engine: with kv_loan the job borrows blocks (reported),
    keeps its layers there, ends at the weights of the same job without a loan, and every block is free again,
    zeroed, after it."""
    tr, engine = llm.learner.trainer, llm.engine
    model = tr.model
    free = engine.blocks.num_free
    engine.cache.data.fill_(7.0)  # what serving left in free blocks: the loan's blocks come back zeroed
    examples = [{"messages": CONVS[0], "rejected": "blorp"}, {"messages": CONVS[1]}]
    results = {}
    for loan in (False, True):
        cfg = LearnConfig(max_steps=2, min_steps=2, checkpoint_tokens=0, kv_loan=loan).validate()
        items = tr.build_items(examples, [], "sft", cfg)
        start = AdapterWeights.init(LoraConfig().validate(), model.config.projection_shapes(), model.config.num_layers)
        results[loan] = tr.train(start, None, items, cfg)
    assert results[False].kv_loan is None
    report = results[True].kv_loan
    assert report["bytes"] > 0 and report["layers_kept"] >= model.config.num_layers  # sized for the first pass
    assert report["bases_bytes"] > 0  # the protector projected with its bases held in the loan after the first step
    assert results[True].losses == pytest.approx(results[False].losses, rel=1e-6, abs=1e-7)
    assert weights_distance(results[True].weights, results[False].weights, start) < 1e-5
    assert engine.blocks.num_free == free
    per_block = engine.cache.data[0, 0, 0].numel() * 2 * model.config.num_layers
    zeroed = int((engine.cache.data == 0).sum())
    assert zeroed == report["bytes"] // engine.cache.data.element_size() and zeroed % per_block == 0


def test_a_model_whose_layers_keep_nothing_borrows_nothing(tiny_models, tmp_path):
    """Qwen3's q/k norms send its layers through the reentrant checkpoint, which keeps nothing in a loan: a
    checkpointed job there takes no blocks from serving."""
    with OnlineLLM(str(tiny_models["qwen3"]), data_dir=tmp_path) as q3:
        tr = q3.learner.trainer
        cfg = LearnConfig(max_steps=1, min_steps=1, checkpoint_tokens=0).validate()
        lent = []
        result = tr.train(AdapterWeights.init(LoraConfig().validate(), q3.model.config.projection_shapes(),
                                              q3.model.config.num_layers), None,
                          tr.build_items([{"messages": CONVS[0]}], [], "sft", cfg), cfg,
                          lambda step, loss: lent.append(q3.engine.blocks.lent))
        assert result.steps == 1 and result.kv_loan is None and lent == [0]


def test_a_job_gives_its_loan_back_when_serving_runs_short(llm):
    """Serving short of blocks while a loan is out (the block manager's flag, as a failed allocation sets it): the
    job gives the blocks back before its next step, checkpoints from there, and ends at the weights of a job without
    a loan."""
    tr, engine = llm.learner.trainer, llm.engine
    model = tr.model
    free = engine.blocks.num_free
    examples = [{"messages": CONVS[0]}, {"messages": CONVS[1]}]
    results, lent = {}, []

    def on_step(step, loss):
        lent.append(engine.blocks.lent)
        if step == 1 and engine.blocks.lent:
            engine.blocks.short = True  # what a request finding too few free blocks leaves behind

    for loan in (False, True):
        cfg = LearnConfig(max_steps=3, min_steps=3, checkpoint_tokens=0, kv_loan=loan).validate()
        items = tr.build_items(examples, [], "sft", cfg)
        start = AdapterWeights.init(LoraConfig().validate(), model.config.projection_shapes(), model.config.num_layers)
        lent.clear()
        results[loan] = tr.train(start, None, items, cfg, on_step)
    assert lent[0] > 0 and lent[1:] == [0, 0]  # lent for the first step only
    assert results[True].kv_loan["given_back_early"] and not engine.blocks.short
    assert engine.blocks.num_free == free
    assert weights_distance(results[True].weights, results[False].weights, start) < 1e-5


@pytest.mark.parametrize("tokens", [64, 160])  # the tiny model's CPU cache: 256 blocks, 192 of them lendable
def test_a_loan_sized_with_held_tensors_keeps_every_layer_beside_them(llm, tokens):
    """borrow(..., held): room for the tensors held for the job (the protector's bases, at the regions' ends) and
    for every layer's kept tensors of the pass it was sized for (at their starts), the one beside the other."""
    engine = llm.engine
    lender = KVLender(engine)
    layers = [train_layer.kept_shapes(layer, tokens) for layer in llm.model.model.layers]
    held = [math.prod(layers[0][-1]) // 3, 5000, 70_000, 123]
    loan = lender.borrow(layers, engine.cache.data.dtype, held)
    assert loan is not None
    try:
        assert all(loan.hold(n) is not None for n in held)
        placed = [loan.place(shapes) for shapes in layers]
        assert all(p is not None for p in placed)
    finally:
        lender.give_back(loan)


def test_serving_keeps_its_share_while_blocks_are_lent(llm):
    """A loan never takes the last KEEP_FREE of the cache, and requests served while blocks are lent give the
    tokens they give without a loan."""
    engine = llm.engine
    lender = KVLender(engine)
    total = len(engine.blocks.ref)
    shapes = train_layer.kept_shapes(llm.model.model.layers[0], 64)
    want = llm.generate("Say hello.", max_tokens=12, temperature=0.0)
    loan = lender.borrow([shapes] * llm.model.config.num_layers, engine.cache.data.dtype)
    assert loan is not None
    assert engine.blocks.num_free >= KEEP_FREE * total
    huge = [[(engine.blocks.num_free * lender.per_block + 1,)]]  # more than every free block's region holds
    assert lender.borrow(huge, engine.cache.data.dtype) is None
    assert lender.borrow([shapes], torch.float16) is None        # not the cache's dtype
    assert llm.generate("Say hello.", max_tokens=12, temperature=0.0) == want
    lender.give_back(loan)
    assert engine.blocks.num_free == total
