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


def paged_step_case(device, dtype, heads=4, kvh=2, dim=16, bs=4, seqs=((9, 1), (0, 7), (5, 6), (2, 1), (0, 1)),
                    decode_kernel=False):
    """One step holding decode rows, prefills from position 0 and chunks continuing a cached context, in blocks
    scattered through a one-layer cache: (PagedAttention's output, the reference). The reference for each token
    is causal attention over its own sequence's keys (float64 on the CPU)."""
    from dark.engine.attention import KVCache, PagedAttention

    torch.manual_seed(3)
    blocks = sum((c + n + bs - 1) // bs for c, n in seqs) + 8
    cache = KVCache(1, blocks, bs, kvh, dim, dtype, device)
    free = iter(torch.randperm(blocks).tolist())
    tables, full_k, full_v = [], [], []
    for cached, new in seqs:
        total = cached + new
        table = [next(free) for _ in range((total + bs - 1) // bs)]
        tables.append(table)
        k, v = torch.randn(total, kvh, dim, dtype=torch.float64), torch.randn(total, kvh, dim, dtype=torch.float64)
        full_k.append(k)
        full_v.append(v)
        for p in range(cached):  # what earlier steps stored
            cache.data[0, 0, table[p // bs], p % bs] = k[p].to(dtype)
            cache.data[0, 1, table[p // bs], p % bs] = v[p].to(dtype)
    q_lens = [n for _, n in seqs]
    ctx_lens = [c + n for c, n in seqs]
    slot_mapping = torch.tensor([t[p // bs] * bs + p % bs for (c, n), t in zip(seqs, tables) for p in range(c, c + n)],
                                device=device)
    q = torch.randn(sum(q_lens), heads, dim, dtype=torch.float64)
    k_new = torch.cat([k[c:] for (c, _), k in zip(seqs, full_k)])
    v_new = torch.cat([v[c:] for (c, _), v in zip(seqs, full_v)])
    attn = PagedAttention(cache, q_lens, ctx_lens, tables, slot_mapping, decode_kernel=decode_kernel)
    out = attn.attend(0, *(t.to(device, dtype) for t in (q, k_new, v_new)))
    refs = []
    row = 0
    for (c, n), k, v in zip(seqs, full_k, full_v):
        # what the cache holds, in its precision
        k, v = k.to(dtype).double(), v.to(dtype).double()
        for i in range(n):
            pos = c + i
            qs = q[row].to(dtype).double()[:, None]                     # [heads, 1, dim]
            ks, vs = (t[:pos + 1].repeat_interleave(heads // kvh, 1).transpose(0, 1) for t in (k, v))
            refs.append(F.scaled_dot_product_attention(qs, ks, vs)[:, 0])
            row += 1
    return attn, out, torch.stack(refs)


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("seqs", [((9, 1), (0, 7), (5, 6), (2, 1), (0, 1)), ((9, 1), (30, 1), (0, 7), (5, 6))])
def test_paged_step_mixing_decodes_and_prefill_chunks_matches_dense(monkeypatch, split, seqs):
    """Each token's output equals causal attention over its own sequence's keys, read back from the paged cache
    (the padded form under a mask, which serves steps on the CPU): with the single-token rows in a padded batch of
    their own (interleaved with the chunks, or first as the scheduler puts running sequences), and with every row
    padded to the longest chunk (DARK_SPLIT_DECODE_ROWS=0)."""
    import dark.engine.attention as attention

    monkeypatch.setattr(attention, "SPLIT_DECODE_ROWS", split)
    attn, out, ref = paged_step_case("cpu", torch.float64, seqs=seqs)
    assert not attn.varlen
    assert len(attn.padded) == (2 if split else 1)
    if split:  # the single rows' batch pads to one query
        assert attn.padded[0][1][4] == 1 and attn.padded[1][1][4] == 7
    for row in range(ref.shape[0]):
        assert torch.allclose(out[row], ref[row], atol=1e-12), row
