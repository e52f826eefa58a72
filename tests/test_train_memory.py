"""The trainer's device-memory savings change nothing but memory: layer checkpointing, log-probabilities in
chunks of rows, and LoRA in the activations' precision give the results of the plain computation, on a tiny
random Qwen2 (fp32 on the CPU); the bytes autograd keeps for backward show the saving is real."""
from __future__ import annotations

import random

import pytest
import torch

from dark import InvalidRequestError, OnlineLLM
from dark.config import LORA_TARGETS, LearnConfig, LoraConfig
from dark.engine.attention import SharedPrefixAttention
from dark.learn.data import render
from dark.learn.trainer import TrainLoRA
from dark.lora.weights import AdapterWeights

CONVS = [[{"role": "user", "content": "A greeting in Zoggian"}, {"role": "assistant", "content": "zog, with a bow to the left"}],
         [{"role": "user", "content": "How to say 'hello' in Zoggian, please?"},
          {"role": "assistant", "content": "zog zog, and then a longer greeting that goes on for a while"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello."}]]


@pytest.fixture(scope="module")
def llm(tiny_models, tmp_path_factory):
    with OnlineLLM(str(tiny_models["qwen2"]), data_dir=tmp_path_factory.mktemp("train-memory")) as llm:
        yield llm


def lora_on_everything(model, seed: int = 0, head: bool = True) -> TrainLoRA:
    """Random factors (B not zero, so every factor has a gradient) on every projection and (head) the LM head."""
    cfg = model.config
    targets = LORA_TARGETS if head else tuple(t for t in LORA_TARGETS if t != "lm_head")
    weights = AdapterWeights.init(LoraConfig(r=4, target_modules=targets).validate(), cfg.projection_shapes(),
                                  cfg.num_layers, seed)
    gen = torch.Generator().manual_seed(seed)
    params = {k: (a.clone().requires_grad_(True), (torch.randn(b.shape, generator=gen) * 0.05).requires_grad_(True))
              for k, (a, b) in weights.tensors.items()}
    return TrainLoRA(params, weights.scaling, {m: o for m, (_, o) in cfg.projection_shapes().items()})


def shared_prefix_batch(model, prefix: int, batch: int, length: int, seed: int):
    """Random token ids and positions of a shared-prefix batch (the trainer's layout), and random weights for a
    loss on its hidden states."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (prefix + batch * length,), generator=gen)
    pos = torch.tensor(list(range(prefix)) + list(range(prefix, prefix + length)) * batch)
    weight = torch.randn(prefix + batch * length, model.config.hidden_size, generator=gen)
    return ids, pos, weight


def grads(lora: TrainLoRA) -> dict:
    return {k: (a.grad.clone(), b.grad.clone()) for k, (a, b) in lora.params.items()}


def zero_grads(lora: TrainLoRA) -> None:
    for a, b in lora.params.values():
        a.grad = b.grad = None


def assert_grads_close(got: dict, want: dict, rtol: float) -> None:
    for k in want:
        for g, w in zip(got[k], want[k]):
            scale = w.abs().max().clamp(min=1e-12)
            assert (g - w).abs().max() <= rtol * scale, k


def hidden_pass(model, lora: TrainLoRA, seed: int, prefix: int = 5, batch: int = 2, length: int = 9, **kwargs):
    """A shared-prefix batch through CausalLM.hidden_states(**kwargs) with a loss on the hidden states and a few
    rows of logits, and its backward: (hidden states, loss, the LoRA gradients)."""
    ids, pos, weight = shared_prefix_batch(model, prefix, batch, length, seed=seed)
    zero_grads(lora)
    attn = SharedPrefixAttention(prefix, batch, length, torch.device("cpu"))
    hidden = model.hidden_states(ids, pos, attn, lora, **kwargs)
    loss = (hidden * weight).sum() + model.logits(hidden[-4:], lora).logsumexp(-1).sum()
    loss.backward()
    return hidden.detach(), loss.detach(), grads(lora)


def grads_distance(got: dict, want: dict) -> float:
    """|got - want| / |want| over all gradients (one norm: a bf16 rounding that flips in one entry stays small)."""
    num = sum(float((g - w).square().sum()) for k in want for g, w in zip(got[k], want[k]))
    return (num / sum(float(w.square().sum()) for k in want for w in want[k])) ** 0.5


def weights_distance(got: AdapterWeights, want: AdapterWeights, start: AdapterWeights) -> float:
    """|got - want| / |want - start| over all factors. Not entry by entry: Adam divides by each gradient's own
    size, so an entry whose gradient is ~1e-9 moves by ~lr whatever the rounding."""
    num = sum(float((g - w).square().sum()) for k in want.tensors for g, w in zip(got.tensors[k], want.tensors[k]))
    den = sum(float((w - s).square().sum()) for k in want.tensors for w, s in zip(want.tensors[k], start.tensors[k]))
    return (num / den) ** 0.5


def kept_bytes(fn, exclude: list[torch.Tensor]) -> int:
    """Bytes autograd keeps for backward while fn runs: tensors saved by operations, plus the inputs a
    checkpointed call keeps to run again in backward; each storage counted once, the given tensors (the frozen
    weights, the LoRA factors) not at all."""
    seen = {t.untyped_storage().data_ptr() for t in exclude}
    kept = {}

    def keep(t):
        if torch.is_tensor(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                kept[ptr] = t.untyped_storage().nbytes()
        return t

    plain = torch.utils.checkpoint.checkpoint

    def checkpoint(fn, *args, **kwargs):
        for a in args:
            keep(a)
        return plain(fn, *args, **kwargs)

    torch.utils.checkpoint.checkpoint = checkpoint
    try:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            out = fn()
    finally:
        torch.utils.checkpoint.checkpoint = plain
    del out
    return sum(kept.values())


# the two forms of a checkpointed layer: the hand-written backward (dark.models.train_layer, the default where it
# applies) and torch's reentrant checkpoint (DARK_LAYER_PASS=0, and every layer it does not apply to)
FORMS = {"by-hand": "1", "reentrant": "0"}


@pytest.fixture(params=list(FORMS))
def form(request, monkeypatch):
    monkeypatch.setenv("DARK_LAYER_PASS", FORMS[request.param])
    return request.param


def test_layer_checkpointing_gives_the_same_loss_and_gradients(llm, form):
    """CausalLM.hidden_states(checkpoint=True) on a shared-prefix batch (the attention the trainer uses): the
    same hidden states and the same LoRA gradients as keeping every activation. The reentrant form repeats the
    operations autograd ran; the hand-written backward computes the same gradients in another order (fp32 rounding
    apart: exact in fp64, test_the_hand_written_layer_backward_is_exact_in_fp64)."""
    model = llm.learner.trainer.model
    lora = lora_on_everything(model)
    results = {checkpoint: hidden_pass(model, lora, seed=1, checkpoint=checkpoint) for checkpoint in (False, True)}
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[True][1], results[False][1], rtol=1e-6, atol=0)
    assert_grads_close(results[True][2], results[False][2], rtol=1e-5 if form == "reentrant" else 1e-4)


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # q/k/v biases, tied embeddings
@pytest.mark.parametrize("targets", ["all", "o_proj+down_proj", "q_proj+v_proj"])
@pytest.mark.parametrize("prefix", [5, 0])
def test_the_hand_written_layer_backward_is_exact_in_fp64(tiny_models, family, targets, prefix, monkeypatch):
    """dark.models.train_layer against autograd through the whole model (no checkpoint), in fp64 where a different
    order of the same sums differs by ~1e-15: the same hidden states and LoRA gradients to 1e-10. With factors on
    q/k/v and gate/up, on o_proj and down_proj only (the groups without any), and on q and v alone (a group partly
    adapted: those layers take the reentrant checkpoint, which this checks is what runs)."""
    from dark.models import train_layer
    from dark.models.decoder import load_model

    model = load_model(tiny_models[family], torch.device("cpu"), torch.float64)
    names = LORA_TARGETS if targets == "all" else tuple(targets.split("+"))
    weights = AdapterWeights.init(LoraConfig(r=4, target_modules=names).validate(), model.config.projection_shapes(),
                                  model.config.num_layers, 0)
    gen = torch.Generator().manual_seed(1)
    params = {k: (a.double().requires_grad_(), (torch.randn(b.shape, generator=gen, dtype=torch.float64) * 0.05)
                  .requires_grad_()) for k, (a, b) in weights.tensors.items()}
    lora = TrainLoRA(params, weights.scaling, {m: o for m, (_, o) in model.config.projection_shapes().items()})
    by_hand = []
    counted = train_layer._LayerPass.apply
    monkeypatch.setattr(train_layer._LayerPass, "apply", lambda *a: by_hand.append(1) or counted(*a))
    plain = hidden_pass(model, lora, seed=2, prefix=prefix, checkpoint=False)
    assert not by_hand
    got = hidden_pass(model, lora, seed=2, prefix=prefix, checkpoint=True)
    assert len(by_hand) == (0 if targets == "q_proj+v_proj" else model.config.num_layers)
    torch.testing.assert_close(got[0], plain[0], rtol=1e-12, atol=1e-12)
    assert_grads_close(got[2], plain[2], rtol=1e-10)


def test_the_recompute_skips_each_layers_down_proj_product(llm, monkeypatch):
    """A checkpointed layer's recompute in backward gives what the layer's backward reads and no more: the
    down_proj product (whose values only the residual add reads) is not computed again. Counted in matmul FLOPs
    against the same recompute with the skip turned off (Linear.output_unread_in_recompute): one down_proj
    product a layer fewer, the same first run, and the same gradients. The hand-written backward does the work of
    the reentrant form with the skip, less the first layer's input gradient (the embeddings need none) and less
    down_proj's delta in each recompute (nothing reads that either)."""
    monkeypatch.setenv("DARK_LAYER_PASS", "0")
    from torch.utils.flop_counter import FlopCounterMode as Counter

    def FlopCounterMode(display):  # noqa: N802  in-place GEMMs (y.addmm_, the deltas added in place) counted too
        return Counter(display=display, custom_mapping={torch.ops.aten.addmm_: lambda y, a, b, *_, **__: 2 * a[0] * a[1] * b[1]})

    model = llm.learner.trainer.model
    cfg = model.config
    lora = lora_on_everything(model)
    prefix, batch, length = 5, 2, 9
    ids, pos, weight = shared_prefix_batch(model, prefix, batch, length, seed=3)
    attn = SharedPrefixAttention(prefix, batch, length, torch.device("cpu"))
    downs = [layer.mlp.down_proj for layer in model.model.layers]

    def counted() -> tuple[tuple[int, int], dict]:
        """(forward FLOPs, backward FLOPs) of a checkpointed pass and its backward, and the gradients."""
        zero_grads(lora)
        with FlopCounterMode(display=False) as fwd:
            hidden = model.hidden_states(ids, pos, attn, lora, checkpoint=True)
        loss = (hidden * weight).sum() + model.logits(hidden[-4:], lora).logsumexp(-1).sum()
        with FlopCounterMode(display=False) as bwd:
            loss.backward()
        return (fwd.get_total_flops(), bwd.get_total_flops()), grads(lora)

    flops, got = {}, {}
    try:
        for skip in (False, True):
            for d in downs:
                d.output_unread_in_recompute = skip
            flops[skip], got[skip] = counted()
    finally:
        for d in downs:
            d.output_unread_in_recompute = True
    tokens = prefix + batch * length
    down = 2 * tokens * cfg.intermediate_size * cfg.hidden_size * cfg.num_layers
    assert flops[True][0] == flops[False][0]  # the first run: the whole forward
    assert flops[True][1] == flops[False][1] - down, (flops, down)
    assert_grads_close(got[True], got[False], rtol=1e-6)

    monkeypatch.setenv("DARK_LAYER_PASS", "1")
    (fwd, bwd), by_hand = counted()
    qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    first_input = 2 * tokens * cfg.hidden_size * (qkv_out + 3 * 4)  # dy @ W and the codes' gradient @ A (r 4)
    # the reentrant recompute still adds down_proj's delta (its codes @ B) to the zeros it gives for the product
    down_delta = 2 * tokens * 4 * cfg.hidden_size * cfg.num_layers
    assert fwd == flops[True][0]
    assert bwd == flops[True][1] - first_input - down_delta, (bwd, flops[True][1])
    assert_grads_close(by_hand, got[True], rtol=1e-4)


def test_layer_inputs_leave_through_the_saved_tensor_hooks(llm, form):
    """CausalLM.hidden_states(checkpoint=True, saved=...): each layer's input, and nothing else, goes out through
    the InputsToHost hooks once and comes back for its layer's backward: the gradients of keeping it. (The copy
    to pinned host memory itself is CUDA's: tests/test_learn_gpu.py; here the transport keeps clones.)"""
    from dark.learn.offload import InputsToHost

    class Clones(InputsToHost):
        def __init__(self):
            self.out, self.back = [], 0

        def _out(self, t):
            self.out.append(t.shape)
            return ("away", t.detach().clone())

        def _in(self, packed):
            if isinstance(packed, tuple) and packed[0] == "away":
                self.back += 1
                return packed[1]
            return packed

    model = llm.learner.trainer.model
    lora = lora_on_everything(model)
    saved = Clones()
    kept = hidden_pass(model, lora, seed=2, checkpoint=True)
    away = hidden_pass(model, lora, seed=2, checkpoint=True, saved=saved)
    rows = 5 + 2 * 9  # the prefix and two sequences of hidden_pass's batch
    assert saved.out == [torch.Size([rows, model.config.hidden_size])] * model.config.num_layers
    assert saved.back == model.config.num_layers
    torch.testing.assert_close(away[1], kept[1], rtol=0, atol=0)
    assert grads_distance(away[2], kept[2]) == 0


def test_each_checkpointed_layer_call_runs_in_the_layer_context(llm, form):
    """CausalLM.hidden_states(checkpoint=True, layer_context=...): every layer's call, its first run (without
    autograd) and its recompute and backward, runs inside a fresh layer_context() (the trainer picks a CUDA stream
    there, so a step can move to the shared stream layer by layer); the values and gradients are those without."""
    from contextlib import contextmanager

    calls, phase = [], ["forward"]

    @contextmanager
    def context():
        calls.append((phase[0], torch.is_grad_enabled()))
        yield

    model = llm.learner.trainer.model
    lora = lora_on_everything(model)
    plain = hidden_pass(model, lora, seed=4, checkpoint=True)
    ids, pos, weight = shared_prefix_batch(model, 5, 2, 9, seed=4)
    zero_grads(lora)
    hidden = model.hidden_states(ids, pos, SharedPrefixAttention(5, 2, 9, torch.device("cpu")), lora,
                                 checkpoint=True, layer_context=context)
    loss = (hidden * weight).sum() + model.logits(hidden[-4:], lora).logsumexp(-1).sum()
    phase[0] = "backward"
    loss.backward()
    layers = model.config.num_layers
    # the reentrant form records its recompute's graph (gradients on); the hand-written one computes without
    assert calls == [("forward", False)] * layers + [("backward", form == "reentrant")] * layers
    torch.testing.assert_close(loss.detach(), plain[1], rtol=0, atol=0)
    assert grads_distance(grads(lora), plain[2]) == 0


def test_passes_without_gradients_never_checkpoint(llm, monkeypatch):
    """Serving and reference passes (no gradients) run the layers as they are, whatever the flag says."""
    model = llm.learner.trainer.model

    def refuse(*args, **kwargs):
        raise AssertionError("checkpoint called without gradients")

    ids = torch.arange(12)
    with torch.no_grad():
        want = model.hidden_states(ids, ids, SharedPrefixAttention(0, 1, 12, torch.device("cpu")))
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", refuse)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            got = model.hidden_states(ids, ids, SharedPrefixAttention(0, 1, 12, torch.device("cpu")), checkpoint=True)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("head", [True, False], ids=["head-trains", "head-frozen"])
@pytest.mark.parametrize("chunk", [1, 4, 7, 1024])
def test_chunked_logprobs_equal_the_full_log_softmax(llm, chunk, head):
    """The taught tokens' log-probabilities in chunks of rows (a chunk size that divides the rows or not, and
    one above them) equal the gather from the full log-softmax rows; so do each row's highest log-probability,
    and, checkpointed or not, the gradients. With the LM head frozen the chunks make their gradient in forward
    (_HeadLogprobs); with factors on the head, autograd runs through each chunk."""
    tr = llm.learner.trainer
    rendered = [render(llm.tokenizer, c) for c in CONVS]
    lora = lora_on_everything(tr.model, head=head)
    assert ((-1, "lm_head") in lora.params) == head
    # the full rows of every sequence: the plain log_softmax of all rows, as the trainer computed before
    full_chosen, full_owner, _, full = tr._token_logprobs(rendered, lora, LearnConfig(checkpoint_tokens=-1), full_from=0)
    assert len(full_chosen) > 7 and len(full_chosen) % 4 and len(full_chosen) % 7  # chunks that do not divide the rows
    full_chosen.sum().backward()
    want_grads = grads(lora)
    for checkpoint_tokens in (-1, 0):
        zero_grads(lora)
        cfg = LearnConfig(checkpoint_tokens=checkpoint_tokens, logits_chunk=chunk)
        chosen, owner, top, none = tr._token_logprobs(rendered, lora, cfg)
        assert none is None
        torch.testing.assert_close(owner, full_owner, rtol=0, atol=0)
        torch.testing.assert_close(chosen, full_chosen, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(top, full.detach().max(-1).values, rtol=1e-5, atol=1e-5)
        chosen.sum().backward()
        # fp32 sums in another order (the head's gradient chunk by chunk): ~1e-5 of the largest entry on some CPUs
        # (1.003e-5 seen on 2026-12-03); a lost or doubled chunk is off by far more
        assert_grads_close(grads(lora), want_grads, rtol=1e-4)
    # full rows of the later sequences only (anchors beside taught examples): the same rows, the same values
    with torch.no_grad():
        chosen, owner, top, part = tr._token_logprobs(rendered, lora, LearnConfig(logits_chunk=chunk), full_from=1)
    torch.testing.assert_close(part, full.detach()[full_owner >= 1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(chosen, full_chosen.detach(), rtol=1e-5, atol=1e-5)


def test_checkpointing_under_cpu_bf16_autocast(llm):
    """cfg.cpu_bf16 trains under bf16 autocast: the recomputed layers run under it too (same values; gradients as
    close to the fp32 ones as the pass that keeps its activations), and the LoRA factors stay fp32."""
    tr = llm.learner.trainer
    rendered = [render(llm.tokenizer, c) for c in CONVS]
    lora = lora_on_everything(tr.model)
    results = {}
    for name, autocast, checkpoint_tokens in (("fp32", False, -1), ("kept", True, -1), ("recomputed", True, 0)):
        zero_grads(lora)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            chosen = tr._token_logprobs(rendered, lora, LearnConfig(checkpoint_tokens=checkpoint_tokens, logits_chunk=7))[0]
        chosen.sum().backward()
        results[name] = chosen.detach(), grads(lora)
    torch.testing.assert_close(results["recomputed"][0], results["kept"][0], rtol=1e-6, atol=1e-6)
    # not bit for bit: the recomputed layers' backward adds the residual stream's gradient in another order
    # (fp32), and the bf16 products after it round entries the other way. As far from fp32 as bf16 puts them
    kept = grads_distance(results["kept"][1], results["fp32"][1])
    recomputed = grads_distance(results["recomputed"][1], results["fp32"][1])
    assert kept < 1e-2 and recomputed < 1.25 * kept, (kept, recomputed)
    assert all(a.grad.dtype == b.grad.dtype == torch.float32 for a, b in lora.params.values())
    # and a whole job with cpu_bf16 (autocast where the CPU has bf16 instructions), checkpointed
    cfg = LearnConfig(max_steps=2, min_steps=2, cpu_bf16=True, checkpoint_tokens=0).validate()
    start = AdapterWeights.init(LoraConfig().validate(), tr.model.config.projection_shapes(), tr.model.config.num_layers)
    result = tr.train(start, None, tr.build_items([{"messages": CONVS[0]}], [], "sft", cfg), cfg)
    assert result.steps == 2 and all(b.any() for _, b in result.weights.tensors.values())


def test_checkpointed_training_trains_the_same_weights(llm, form):
    """Two steps of train() (SFT, DPO, anchors, protected subspaces) with every pass checkpointed and the logits
    in chunks of 5 rows end at the weights of two plain steps; so does unlearn. The reentrant recompute repeats
    the arithmetic exactly; the hand-written backward sums in another order (fp32 rounding)."""
    tr = llm.learner.trainer
    model = tr.model
    examples = [{"messages": CONVS[0], "rejected": "blorp"}, {"messages": CONVS[1]}]

    for kind in ("sft", "unlearn"):
        results = {}
        for checkpoint_tokens, chunk in ((-1, 1024), (-1, 5), (0, 5)):
            cfg = LearnConfig(max_steps=2, min_steps=2, checkpoint_tokens=checkpoint_tokens, logits_chunk=chunk).validate()
            items = tr.build_items(examples, [], kind, cfg)
            start = AdapterWeights.init(LoraConfig().validate(), model.config.projection_shapes(), model.config.num_layers)
            results[checkpoint_tokens, chunk] = tr.train(start, None, items, cfg)
        plain, chunked, remat = results[-1, 1024], results[-1, 5], results[0, 5]
        assert plain.steps == remat.steps == 2
        assert remat.losses == pytest.approx(plain.losses, rel=1e-5, abs=1e-6)
        assert weights_distance(remat.weights, chunked.weights, start) < (1e-6 if form == "reentrant" else 1e-5), kind
        assert weights_distance(remat.weights, plain.weights, start) < 1e-4, kind    # logsumexp in chunks: rounding only


def test_micro_batched_training_trains_the_same_weights(llm):
    """A batch split into parts (each part's backward right after its forward, the anchors with the last part)
    takes the same steps as the batch in one pass: same losses, same weights within rounding, with DPO too."""
    tr = llm.learner.trainer
    model = tr.model
    examples = [{"messages": CONVS[0], "rejected": "blorp"}, {"messages": CONVS[1]}]
    results = {}
    for micro in (-1, 1):  # 1 token: every item its own part
        cfg = LearnConfig(max_steps=2, min_steps=2, micro_tokens=micro).validate()
        items = tr.build_items(examples, [], "sft", cfg)
        picked = tr._pick([i for i in items if i.kind == "sft"], cfg.batch_size, random.Random(0))
        assert (len(tr._micro_batches(picked, micro)) > 1) == (micro > 0)
        start = AdapterWeights.init(LoraConfig().validate(), model.config.projection_shapes(), model.config.num_layers)
        results[micro] = tr.train(start, None, items, cfg)
    whole, parts = results[-1], results[1]
    assert whole.steps == parts.steps == 2
    assert parts.losses == pytest.approx(whole.losses, rel=1e-5, abs=1e-6)
    assert weights_distance(parts.weights, whole.weights, start) < 1e-4


def test_parked_moments_train_exactly_the_same(llm, monkeypatch):
    """park_moments: the optimizer's moments leave for host memory after each step but the last and come back at
    the next optimizer step. The same losses, weights and moments as keeping them (bit for bit, a warm optimizer
    state from an earlier job too), and while a parked step's passes run the optimizer holds no moment."""
    from dark.learn import trainer as T

    tr = llm.learner.trainer
    model = tr.model
    examples = [{"messages": CONVS[0]}, {"messages": CONVS[1]}]
    seen = []  # per optimizer step: how many moment tensors the optimizer held when the step's passes began
    real_forward = T.Trainer._forward

    def counting_forward(self, rendered, lora, *args):
        if torch.is_grad_enabled():
            seen.append(sum(torch.is_tensor(v) and v.dim() > 0 for st in self._opt_probe.state.values() for v in st.values()))
        return real_forward(self, rendered, lora, *args)

    real_adamw = torch.optim.AdamW

    def probed_adamw(*args, **kw):
        opt = real_adamw(*args, **kw)
        tr._opt_probe = opt
        return opt

    monkeypatch.setattr(T.Trainer, "_forward", counting_forward)
    monkeypatch.setattr(T.torch.optim, "AdamW", probed_adamw)
    out = {}
    for park in (False, True):
        cfg = LearnConfig(max_steps=3, min_steps=3, kl_weight=0.0, park_moments=park).validate()
        items = tr.build_items(examples, [], "sft", cfg)
        start = AdapterWeights.init(LoraConfig().validate(), model.config.projection_shapes(), model.config.num_layers)
        seen.clear()
        first = tr.train(start, None, items, cfg)
        first_seen = list(seen)
        state = tr.optimizer_state_to_host(first.optimizer_state)
        seen.clear()
        second = tr.train(first.weights, state, items, cfg)  # a warm state: parked after its own first step
        out[park] = (first, second, first_seen, list(seen))
    (a1, a2, kept1, kept2), (b1, b2, seen1, seen2) = out[False], out[True]
    for x, y in ((a1, b1), (a2, b2)):
        assert x.losses == y.losses and x.steps == y.steps == 3
        for k in x.weights.tensors:
            assert all(torch.equal(u, v) for u, v in zip(x.weights.tensors[k], y.weights.tensors[k]))
        xs, ys = x.optimizer_state["state"], y.optimizer_state["state"]
        assert xs.keys() == ys.keys()
        for i in xs:
            for n in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(xs[i][n], ys[i][n])
    # first job: no moments yet at step 1, parked during steps 2 and 3; second job: the warm state comes in at
    # the first optimizer step (none during its passes), then parked again
    assert seen1 and not any(seen1) and seen2 and not any(seen2)
    # kept instead: from each job's second step on they are on the device through the passes (a warm state too,
    # which comes in at the first optimizer step either way)
    assert kept1[0] == 0 and all(kept1[1:]) and kept2[0] == 0 and all(kept2[1:])


def test_moments_in_gathers_on_a_helper_thread_and_takes_them_whole():
    """MomentsIn (on the CPU here: an ordinary staging buffer, no events): the gathered moments come back exactly,
    as views of one tensor, the step counters untouched; the buffer is the shared one, reused right after."""
    import concurrent.futures

    from dark.learn.trainer import MomentsIn, Staging

    staging, pool = Staging(pin=False), concurrent.futures.ThreadPoolExecutor(1)
    state = {"state": {i: {"step": torch.tensor(float(i)), "exp_avg": torch.randn(4, 30), "exp_avg_sq": torch.rand(30, 4)}
                       for i in range(3)}, "param_groups": [{"lr": 1e-3, "params": [0, 1, 2]}]}
    got = MomentsIn(state, torch.device("cpu"), staging, pool).take()
    staging.get(8).fill_(5.0)  # the next user of the buffer: what was taken is unaffected
    views = [got["state"][i][n] for i in range(3) for n in ("exp_avg", "exp_avg_sq")]
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1  # one tensor underneath
    for i in range(3):
        assert got["state"][i]["step"] is state["state"][i]["step"]
        for n in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["state"][i][n], state["state"][i][n])
    pool.shutdown()


def test_the_check_after_the_last_step_runs_without_gradients(llm):
    """A job's loop ends with a pass that only checks the final weights (max_steps reached): it runs without
    autograd, in each of a split batch's parts, and every step before it runs each part once with gradients."""
    tr = llm.learner.trainer
    model = tr.model
    examples = [{"messages": CONVS[0]}, {"messages": CONVS[1]}]
    for micro in (-1, 1):
        cfg = LearnConfig(max_steps=2, min_steps=2, micro_tokens=micro, kl_weight=0.0).validate()
        items = tr.build_items(examples, [], "sft", cfg)
        parts = len(tr._micro_batches(tr._pick([i for i in items if i.kind == "sft"], cfg.batch_size,
                                                random.Random(0)), micro))
        passes = []  # grad mode of each pass of the first layer with the adapter in it (references have none)
        hook = model.model.layers[0].register_forward_pre_hook(
            lambda mod, args: passes.append(torch.is_grad_enabled()) if isinstance(args[4], TrainLoRA) else None)
        try:
            start = AdapterWeights.init(LoraConfig().validate(), model.config.projection_shapes(), model.config.num_layers)
            result = tr.train(start, None, items, cfg)
        finally:
            hook.remove()
        assert result.steps == 2
        assert passes == [True] * (2 * parts) + [False] * parts, micro


def test_prepared_lora_computes_what_the_per_call_casts_compute():
    """TrainLoRA.prepared (factors cast, stacked and scaled once per pass) gives the same bf16 outputs and the same
    fp32 gradients of the master factors as casting in every call, for fused groups, single projections and a
    group whose members do not all have factors."""
    g = torch.Generator().manual_seed(0)
    outs = {"q_proj": 12, "k_proj": 4, "v_proj": 4, "o_proj": 8, "gate_proj": 10, "up_proj": 10}
    fan_in = {"q_proj": 8, "k_proj": 8, "v_proj": 8, "o_proj": 12, "gate_proj": 8, "up_proj": 8}
    keys = [(0, m) for m in outs] + [(1, "q_proj"), (1, "v_proj")]  # layer 1: q and v only

    def run(prepare: bool):
        params = {k: (torch.randn(3, fan_in[k[1]], generator=g).requires_grad_(),
                      torch.randn(outs[k[1]], 3, generator=g).requires_grad_()) for k in keys}
        lora = TrainLoRA(params, 0.5, outs)
        use = lora.prepared(torch.bfloat16) if prepare else lora
        assert (use is not lora) == prepare and lora.prepared(torch.float32) is lora
        x8 = torch.randn(5, 8, generator=g).bfloat16()
        x12 = torch.randn(5, 12, generator=g).bfloat16()
        ys = [use.apply_group(layer, "qkv", x8, torch.randn(5, 20, generator=g).bfloat16()) for layer in (0, 1)]
        ys.append(use.apply_group(0, "gate_up", x8, torch.randn(5, 20, generator=g).bfloat16()))
        ys.append(use.apply(0, "o_proj", x12, torch.randn(5, 8, generator=g).bfloat16()))
        sum((y.float() * torch.randn(y.shape, generator=g)).sum() for y in ys).backward()
        return ys, [t.grad for k in keys for t in params[k]]

    g.manual_seed(0)
    plain = run(False)
    g.manual_seed(0)
    ready = run(True)
    for a, b in zip(plain[0] + plain[1], ready[0] + ready[1]):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_micro_batches_split_by_tokens():
    from dark.learn.data import Rendered
    from dark.learn.trainer import Item, Trainer

    items = [Item(Rendered(list(range(n)), [-100] * n), "sft") for n in (5, 7, 3, 9, 2)]
    sizes = lambda groups: [[len(i.rendered.input_ids) for i in g] for g in groups]  # noqa: E731
    assert sizes(Trainer._micro_batches(items, -1)) == [[5, 7, 3, 9, 2]]
    assert sizes(Trainer._micro_batches(items, 100)) == [[5, 7, 3, 9, 2]]
    assert sizes(Trainer._micro_batches(items, 12)) == [[5, 7], [3, 9], [2]]
    assert sizes(Trainer._micro_batches(items, 4)) == [[5], [7], [3], [9], [2]]  # an item alone may be longer
    with pytest.raises(InvalidRequestError, match="micro_tokens"):
        LearnConfig(micro_tokens=0).validate()
    with pytest.raises(InvalidRequestError, match="inputs_to_host_tokens"):
        LearnConfig(inputs_to_host_tokens=1.5).validate()


def test_checkpoint_settings_are_validated():
    assert LearnConfig(checkpoint_tokens=-1).validate().checkpoint_tokens == -1
    with pytest.raises(InvalidRequestError, match="checkpoint_tokens"):
        LearnConfig(checkpoint_tokens=-2).validate()
    with pytest.raises(InvalidRequestError, match="checkpoint_tokens"):
        LearnConfig(checkpoint_tokens=1.5).validate()
    with pytest.raises(InvalidRequestError, match="logits_chunk"):
        LearnConfig(logits_chunk=0).validate()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lora_in_the_activations_precision(dtype):
    """On bf16/fp16 activations TrainLoRA computes in their precision: the fp32 math within that precision's
    tolerance, master factors and their gradients fp32, and no fp32 copy of the input kept for backward."""
    gen = torch.Generator().manual_seed(0)
    tokens, fan_in, fan_out, r = 32, 96, 48, 8
    a = (torch.randn(r, fan_in, generator=gen) * 0.1).requires_grad_(True)
    b = (torch.randn(fan_out, r, generator=gen) * 0.1).requires_grad_(True)
    lora = TrainLoRA({(0, "down_proj"): (a, b)}, 2.0)
    x = torch.randn(tokens, fan_in, generator=gen).to(dtype)
    y = torch.randn(tokens, fan_out, generator=gen).to(dtype)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = lora.apply(0, "down_proj", x, y)
    assert out.dtype == dtype
    assert not [t for t in saved if t.dtype == torch.float32 and t.numel() >= x.numel()], "an fp32 copy of x is kept"
    out.float().square().sum().backward()
    assert a.dtype == b.dtype == a.grad.dtype == b.grad.dtype == torch.float32
    got = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    want = y.float() + (x.float() @ a.t()) @ b.t() * 2.0
    torch.testing.assert_close(out.float(), want.detach(), rtol=2e-2, atol=2e-2)
    want.square().sum().backward()
    for g, w in zip(got, (a.grad, b.grad)):
        assert (g - w).norm() <= 2e-2 * w.norm()
    # fp32 activations (the CPU's): the fp32 math, as before
    x32, y32 = x.float(), y.float()
    torch.testing.assert_close(lora.apply(0, "down_proj", x32, y32), y32 + (x32 @ a.t()) @ b.t() * 2.0)


def test_checkpointing_keeps_far_fewer_bytes_for_backward(llm):
    """The bytes autograd keeps for one training forward of the trainer (activations, logits) drop several
    times with checkpointing: only each layer's input and each logits chunk's hidden rows stay."""
    tr = llm.learner.trainer
    model = tr.model
    lora = lora_on_everything(model)
    rendered = [render(llm.tokenizer, c) for c in CONVS]
    exclude = list(model.parameters()) + [t for ab in lora.params.values() for t in ab]

    def forward(cfg):
        return lambda: tr._token_logprobs(rendered, lora, cfg)[0].sum()

    plain = kept_bytes(forward(LearnConfig(checkpoint_tokens=-1)), exclude)
    remat = kept_bytes(forward(LearnConfig(checkpoint_tokens=0)), exclude)
    # the hidden states alone (no logits), with and without layer checkpointing
    ids = torch.arange(64)
    layers = {c: kept_bytes(lambda: model.hidden_states(ids, ids, SharedPrefixAttention(0, 1, 64, torch.device("cpu")),
                                                        lora, checkpoint=c).sum(), exclude) for c in (False, True)}
    print(f"kept for backward: trainer pass {plain} -> {remat} bytes; layers of 64 tokens {layers[False]} -> {layers[True]}")
    assert remat * 4 < plain
    assert layers[True] * 2 < layers[False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("present", [("q_proj", "k_proj", "v_proj"), ("q_proj", "v_proj"), ("gate_proj", "up_proj"),
                                     ("up_proj",)])
def test_grouped_training_lora_equals_each_member(dtype, present):
    """apply_group on a fused group's concatenated output (one stacked-A GEMM, one block-diagonal-B GEMM) gives
    each member's own delta, and the same gradients, also when some members have no factors."""
    gen = torch.Generator().manual_seed(len(present))
    group = "qkv" if present[0] in ("q_proj", "k_proj", "v_proj") else "gate_up"
    members = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}[group]
    outs = {"q_proj": 48, "k_proj": 16, "v_proj": 16, "gate_proj": 40, "up_proj": 40}
    tokens, fan_in, r = 12, 32, 4

    def fresh():
        g = torch.Generator().manual_seed(7)
        return {(0, m): ((torch.randn(r, fan_in, generator=g) * 0.2).requires_grad_(True),
                         (torch.randn(outs[m], r, generator=g) * 0.2).requires_grad_(True)) for m in present}

    x = torch.randn(tokens, fan_in, generator=gen).to(dtype)
    y = torch.randn(tokens, sum(outs[m] for m in members), generator=gen).to(dtype)
    grouped_params, single_params = fresh(), fresh()
    got = TrainLoRA(grouped_params, 1.5, outs).apply_group(0, group, x, y)
    single = TrainLoRA(single_params, 1.5, outs)
    parts, col = [], 0
    for m in members:
        parts.append(single.apply(0, m, x, y[:, col:col + outs[m]]))
        col += outs[m]
    want = torch.cat(parts, 1)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    w = torch.randn(got.shape, generator=gen)
    (got.float() * w).sum().backward()
    (want.float() * w).sum().backward()
    for k in grouped_params:
        for i in range(2):
            torch.testing.assert_close(grouped_params[k][i].grad, single_params[k][i].grad, **tol)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_training_through_the_triton_kernels_matches_plain_torch(tiny_models, tmp_path, family):
    """The training forms of the fused kernels (RMSNorm, the q/k/v split with rotary, SiLU * mul; on the CPU under
    TRITON_INTERPRET=1) give the plain-torch modules' hidden states, loss and LoRA gradients, checkpointed or not:
    Qwen2 takes the fused q/k/v path, Qwen3 (per-head q/k norms) the separate rotary one."""
    pytest.importorskip("triton")
    with OnlineLLM(str(tiny_models[family]), data_dir=tmp_path) as llm:
        model = llm.model
        lora = lora_on_everything(model)
        prefix, batch, length = 3, 2, 6
        ids, pos, weight = shared_prefix_batch(model, prefix, batch, length, seed=2)
        results = {}
        try:
            for fused, checkpoint in ((False, False), (True, False), (True, True)):
                model.use_fused_kernels(fused)
                zero_grads(lora)
                attn = SharedPrefixAttention(prefix, batch, length, torch.device("cpu"))
                hidden = model.hidden_states(ids, pos, attn, lora, checkpoint=checkpoint)
                loss = (hidden * weight).sum() + model.logits(hidden[-4:], lora).logsumexp(-1).sum()
                loss.backward()
                results[fused, checkpoint] = hidden.detach(), loss.detach(), grads(lora)
        finally:
            model.use_fused_kernels(False)
        plain = results[False, False]
        for key in ((True, False), (True, True)):
            torch.testing.assert_close(results[key][0], plain[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(results[key][1], plain[1], rtol=1e-5, atol=0)
            assert_grads_close(results[key][2], plain[2], rtol=1e-4)
