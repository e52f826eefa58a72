"""SharedPrefixAttention (training batches with a shared prefix) against plain masked attention per sequence."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dark.engine.attention import SharedPrefixAttention


def reference(q, k, v, prefix: int, batch: int, length: int) -> torch.Tensor:
    """Each sequence (prefix + its own tokens) run alone with causal attention; rows laid out like the batch."""
    rows = [None] * q.shape[0]
    for b in range(batch):
        own = list(range(prefix + b * length, prefix + (b + 1) * length))
        idx = torch.tensor(list(range(prefix)) + own)
        qs, ks, vs = (t[idx].transpose(0, 1)[None] for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        for i, r in enumerate(idx.tolist()):
            if r >= prefix or b == 0:  # the prefix rows: every sequence computes them alike
                rows[r] = out[i]
    return torch.stack(rows)


@pytest.mark.parametrize("prefix,batch,length", [(0, 2, 7), (5, 3, 6), (3, 1, 4), (9, 2, 1)])
def test_shared_prefix_matches_each_sequence_alone(prefix, batch, length):
    torch.manual_seed(prefix * 100 + batch * 10 + length)
    t = prefix + batch * length
    q, k, v = (torch.randn(t, h, 16, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    out = SharedPrefixAttention(prefix, batch, length, "cpu").attend(0, q, k, v)
    ref = reference(q, k, v, prefix, batch, length)
    assert torch.allclose(out, ref, atol=1e-12)
    # and the gradients the trainer takes through it
    w = torch.randn_like(out)
    g = torch.autograd.grad((out * w).sum(), (q, k, v))
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(g, g_ref):
        assert torch.allclose(a, b, atol=1e-10)
