"""The protected subspaces (dark.learn.protect): their math, and that training keeps A's change out of them."""
from __future__ import annotations

import pytest
import torch

from dark import OnlineLLM
from dark.config import LearnConfig, LoraConfig
from dark.learn.data import normalize_examples
from dark.learn.protect import Protector, principal_directions
from dark.lora.weights import AdapterWeights


def test_principal_directions_find_the_dominant_subspace_both_ways():
    g = torch.Generator().manual_seed(0)
    d, rank = 40, 5
    basis, _ = torch.linalg.qr(torch.randn(d, rank, generator=g))
    for n in (20, 200):  # fewer samples than dimensions (Gram matrix) and more (second moment)
        x = torch.randn(n, rank, generator=g) * 10 @ basis.t() + 0.01 * torch.randn(n, d, generator=g)
        v = principal_directions(x, 0.99)
        assert v.shape == (d, rank)
        torch.testing.assert_close(v.t() @ v, torch.eye(rank), atol=1e-4, rtol=0)
        # the same subspace as the planted one: projecting the planted basis onto v loses nothing
        assert (basis - v @ (v.t() @ basis)).norm() < 1e-2
        assert principal_directions(x, 0.999999).shape[1] > rank  # more energy asked: the noise directions join


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_training_keeps_the_change_to_A_out_of_everyday_directions(tiny_models, tmp_path, dtype):
    """dtype None: the device's default (fp32 on the CPU); bfloat16, as a GPU runs, keeps the bases in half
    precision, where one projection through them left ~1% of the change in the everyday directions."""
    with OnlineLLM(str(tiny_models["qwen2"]), data_dir=tmp_path, **({"dtype": dtype} if dtype else {})) as llm:
        tr = llm.learner.trainer
        protector = tr.protector(0.99)
        assert isinstance(protector, Protector) and protector.bases
        mc = llm.model.config
        # an adapter that already has weights (B non-zero, as if imported): only the change is projected
        weights = AdapterWeights.init(LoraConfig(r=4, alpha=8), mc.projection_shapes(), mc.num_layers, seed=3)
        for key, (a, b) in weights.tensors.items():
            b.normal_(0, 0.1)
        before = {k: a.clone() for k, (a, _) in weights.tensors.items()}
        items = tr.build_items(normalize_examples([{"prompt": "A greeting in Zoggian", "response": "zog"}], "sft"), [],
                               "sft", LearnConfig())
        result = tr.train(weights, None, items, LearnConfig(max_steps=3, min_steps=3, protect_energy=0.99).validate())
        moved = 0
        for key, (a, _) in result.weights.tensors.items():
            change = a - before[key]
            v = protector.bases[key].float()
            assert (change @ v).norm() <= 1e-4 * change.norm() + 1e-7, key
            moved += change.norm().item() > 0
        assert moved == len(result.weights.tensors)  # every A still learned, outside those directions

        # a new adapter (B zero): A itself starts outside them, so everyday inputs give it (almost) no code
        fresh = AdapterWeights.init(LoraConfig(r=4, alpha=8), mc.projection_shapes(), mc.num_layers, seed=4)
        result = tr.train(fresh, None, items, LearnConfig(max_steps=2, min_steps=2, protect_energy=0.99).validate())
        for key, (a, _) in result.weights.tensors.items():
            v = protector.bases[key].float()
            assert (a @ v).norm() <= 1e-4 * a.norm(), key
        # and with protection off, nothing is projected
        free = tr.train(AdapterWeights.init(LoraConfig(r=4, alpha=8), mc.projection_shapes(), mc.num_layers, seed=4),
                        None, items, LearnConfig(max_steps=2, min_steps=2, protect_energy=0.0).validate())
        key = next(iter(free.weights.tensors))
        assert (free.weights.tensors[key][0] @ protector.bases[key].float()).norm() > 1e-2 * free.weights.tensors[key][0].norm()


def test_a_step_widens_one_basis_at_a_time(monkeypatch):
    """project_updates gives each A the same result as projecting it alone, widens a basis shared by several
    projections once, and lets each widened (fp32, device) copy go before the next: a 7B model's bases widened all
    at once would take ~2 GB of device memory at the end of every step."""
    import weakref

    g = torch.Generator().manual_seed(0)
    p = Protector(0.9)
    shared, _ = torch.linalg.qr(torch.randn(12, 4, generator=g))
    alone, _ = torch.linalg.qr(torch.randn(20, 6, generator=g))
    p.bases = {(0, "q_proj"): shared.bfloat16(), (0, "down_proj"): alone.bfloat16()}
    p.bases[(0, "k_proj")] = p.bases[(0, "q_proj")]  # q and k share their input, hence one basis
    keys = [(0, "down_proj"), (0, "q_proj"), (0, "o_proj"), (0, "k_proj")]
    start = [torch.randn(3, n, generator=g) for n in (20, 12, 8, 12)]
    a = [s + 0.1 * torch.randn(s.shape, generator=g) for s in start]
    want = [s + p.project(k, t - s) for k, t, s in zip(keys, a, start)]
    before = [t.clone() for t in a]
    widened, plain = [], Protector._on

    def on(v, like):
        assert all(w() is None for w in widened), "an earlier widened basis is still alive"
        out = plain(v, like)
        widened.append(weakref.ref(out))
        return out

    monkeypatch.setattr(Protector, "_on", staticmethod(on))
    p.project_updates(keys, a, start)
    assert len(widened) == 2  # q and k: one basis, widened once
    for got, w in zip(a, want):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)
    assert torch.equal(a[2], before[2])  # o_proj has no basis here: untouched


def test_a_pending_projection_runs_as_the_pass_reaches_each_layer():
    """A step's projection (Protector.pending) is done layer by layer as the next pass reaches each layer
    (TrainLoRA.before_layer): a layer's A is projected before the pass casts it, later layers and the LM head are
    not touched yet, and after the last layer every A is projected as project_updates would, and nothing is left
    pending."""
    from dark.learn.trainer import TrainLoRA

    g = torch.Generator().manual_seed(1)
    p = Protector(0.9)
    keys = [(0, "q_proj"), (1, "q_proj"), (-1, "lm_head")]
    for key in keys:
        p.bases[key] = torch.linalg.qr(torch.randn(12, 4, generator=g))[0].bfloat16()
    params = {k: (torch.randn(3, 12, generator=g).requires_grad_(), torch.randn(12, 3, generator=g).requires_grad_())
              for k in keys}
    start = [params[k][0].detach().clone() for k in keys]
    with torch.no_grad():  # an optimizer step
        for k in keys:
            params[k][0].add_(0.1 * torch.randn(3, 12, generator=g))
    stepped = [params[k][0].detach().clone() for k in keys]
    want = [s + p.project(k, t - s) for k, t, s in zip(keys, stepped, start)]
    lora = TrainLoRA(params, 1.0, {"q_proj": 12, "lm_head": 12})
    lora.pending = p.pending(keys, [params[k][0] for k in keys], start)
    ready = lora.prepared(torch.bfloat16)
    ready.before_layer(0)
    torch.testing.assert_close(params[keys[0]][0].detach(), want[0], rtol=1e-5, atol=1e-6)
    assert not torch.equal(params[keys[0]][0].detach(), stepped[0])
    assert torch.equal(ready.cast[(0, "q_proj")][0], params[keys[0]][0].detach().bfloat16())  # cast once projected
    assert torch.equal(params[keys[1]][0].detach(), stepped[1]) and torch.equal(params[keys[2]][0].detach(), stepped[2])
    assert set(ready.cast) == {(0, "q_proj")} and lora.pending is not None
    ready.before_layer(float("inf"))
    for k, w in zip(keys, want):
        torch.testing.assert_close(params[k][0].detach(), w, rtol=1e-5, atol=1e-6)
    assert lora.pending is None and set(ready.cast) == set(keys)
    assert ready.cast[(-1, "lm_head")][0].requires_grad  # cast under autograd: backward reaches the master factor
