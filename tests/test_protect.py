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


@pytest.mark.parametrize("in_place", [False, True])
def test_a_step_widens_one_basis_at_a_time(monkeypatch, in_place):
    """project_updates gives each A the same result as projecting it alone, widens a basis shared by several
    projections once, and lets each widened (fp32, device) copy go before the next: a 7B model's bases widened all
    at once would take ~2 GB of device memory at the end of every step. in_place (the trainer's CUDA graph): the
    same results, the changes made in start's tensors."""
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
    changes = [t - s for t, s in zip(a, start)]
    p.project_updates(keys, a, start, in_place=in_place)
    if in_place:
        for got, c in zip(start, changes):
            torch.testing.assert_close(got, c)
    assert len(widened) == 2  # q and k: one basis, widened once
    for got, w in zip(a, want):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)
    assert torch.equal(a[2], before[2])  # o_proj has no basis here: untouched
