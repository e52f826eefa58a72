"""Attention over a paged KV cache (serving) and over a dense causal batch (training), in plain torch.

The paged path attends a step's decode rows together and each prefill chunk alone over its gathered cache
blocks, whatever mix the step holds. GPU kernels can replace `attend` without touching the model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


class KVCache:
    """Keys and values of every layer, in blocks of `block_size` tokens: [layers, 2, blocks, block, heads, dim]."""

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.data = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class PagedAttention:
    """Metadata of one engine step, shared by all layers.

    q_lens[b] new tokens of sequence b are computed at positions ctx_lens[b] - q_lens[b] .. ctx_lens[b] - 1;
    its keys live in the blocks of block_tables[b]. Rows with one new token (decodes) attend together: through
    the paged decode kernel when `kernel` (CUDA), else one SDPA call over their padded gathered keys. Each longer
    chunk (a prefill) attends alone to its own gathered keys, causal aligned to the bottom-right corner, which the
    fused SDPA kernels (flash / memory-efficient) take without a mask: nothing is padded to the longest chunk.
    """

    def __init__(self, cache: KVCache, q_lens: list[int], ctx_lens: list[int], block_tables: list[list[int]],
                 slot_mapping: torch.Tensor, kernel: bool = False):
        device = cache.data.device
        self.cache, self.slot_mapping, self.kernel = cache, slot_mapping, kernel
        bs = cache.block_size
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        # prefill chunks: (first row in the flat batch, rows, context length, the blocks holding the context)
        self.chunks = [(starts[b], n, c, torch.tensor(t[:(c + bs - 1) // bs], dtype=torch.long, device=device))
                       for b, (n, c, t) in enumerate(zip(q_lens, ctx_lens, block_tables)) if n > 1]
        dec = [b for b, n in enumerate(q_lens) if n == 1]
        self.dec_rows = None
        if dec:
            nb = max(len(block_tables[b]) for b in dec)
            self.dec_rows = torch.tensor([starts[b] for b in dec], device=device)
            tables = [block_tables[b] + [0] * (nb - len(block_tables[b])) for b in dec]
            self.dec_tables = torch.tensor(tables, dtype=torch.int32 if kernel else torch.long, device=device)
            self.dec_ctx = torch.tensor([ctx_lens[b] for b in dec], device=device)
            if not kernel:
                self.dec_mask = (torch.arange(nb * bs, device=device)[None, :] < self.dec_ctx[:, None])[:, None, None]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kc, vc = self.cache.data[layer, 0], self.cache.data[layer, 1]
        heads, dim = kc.shape[-2:]
        kc.view(-1, heads, dim)[self.slot_mapping] = k
        vc.view(-1, heads, dim)[self.slot_mapping] = v
        gqa = heads != q.shape[1]
        out = torch.empty_like(q)
        if self.dec_rows is not None:
            qd = q[self.dec_rows]
            if self.kernel:
                from ..models.decoder import kernel_module

                od = kernel_module("paged_attention").paged_decode(qd, kc, vc, self.dec_tables, self.dec_ctx,
                                                                   dim ** -0.5)
            else:
                b = qd.shape[0]
                keys = kc[self.dec_tables].view(b, -1, heads, dim).transpose(1, 2)
                values = vc[self.dec_tables].view(b, -1, heads, dim).transpose(1, 2)
                od = F.scaled_dot_product_attention(qd[:, :, None], keys, values, attn_mask=self.dec_mask,
                                                    enable_gqa=gqa)[:, :, 0]
            out[self.dec_rows] = od
        for first, n, ctx, pages in self.chunks:
            keys = kc[pages].view(-1, heads, dim)[:ctx].transpose(0, 1)[None]
            values = vc[pages].view(-1, heads, dim)[:ctx].transpose(0, 1)[None]
            qc = q[first:first + n].transpose(0, 1)[None]
            if ctx == n:
                oc = F.scaled_dot_product_attention(qc, keys, values, is_causal=True, enable_gqa=gqa)
            else:
                if gqa:  # the bottom-right bias reaches the fused kernels by their plain signature: one head each
                    keys, values = (t.repeat_interleave(q.shape[1] // heads, dim=1) for t in (keys, values))
                oc = F.scaled_dot_product_attention(qc, keys, values, attn_mask=causal_lower_right(n, ctx))
            out[first:first + n] = oc[0].transpose(0, 1)
        return out


class PagedDecodeAttention:
    """Decode-only steps on CUDA: one query token per sequence, read straight from the block table (Triton).

    Every input is a device tensor of fixed shape, so a CUDA graph can capture the step and later steps only
    refill the tensors: slot_mapping [B] (-1: a padded row, nothing stored), block_tables [B, W] (columns past
    a sequence's last block are never read), ctx_lens [B] (0: a padded row, its output is zeros).
    """

    def __init__(self, cache: KVCache, slot_mapping: torch.Tensor, block_tables: torch.Tensor, ctx_lens: torch.Tensor):
        self.cache, self.slot_mapping, self.block_tables, self.ctx_lens = cache, slot_mapping, block_tables, ctx_lens
        self.scale = cache.data.shape[-1] ** -0.5  # SDPA's default, as the plain path uses
        self.splits = None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from ..models.decoder import kernel_module

        pa = kernel_module("paged_attention")
        kc, vc = self.cache.data[layer, 0], self.cache.data[layer, 1]
        pa.store_kv(k, v, kc, vc, self.slot_mapping)
        return pa.paged_decode(q, kc, vc, self.block_tables, self.ctx_lens, self.scale, self.splits)


class DenseCausalAttention:
    """A right-padded batch of whole sequences, [batch, length] flattened to tokens; no cache."""

    def __init__(self, batch: int, length: int):
        self.batch, self.length = batch, length

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, n = self.batch, self.length
        q, k, v = (t.view(b, n, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
        # right padding: a real token never attends to a later (padded) position under the causal mask
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return out.transpose(1, 2).reshape(b * n, q.shape[1], q.shape[3])


class SharedPrefixAttention:
    """Training batches whose sequences all start with the same tokens (system prompt, tool list, template).

    The flat batch holds the shared prefix once ([prefix] tokens), then each sequence's remaining tokens,
    right-padded to `length`. Prefix tokens attend causally among themselves; every suffix token attends to
    the whole prefix and causally to its own sequence. Same result as running each sequence in full, with the
    prefix computed once.
    """

    def __init__(self, prefix: int, batch: int, length: int, device):
        self.prefix, self.batch, self.length = prefix, batch, length
        # every prefix key, then causal over the own tokens: causal aligned to the bottom-right corner of the
        # [length, prefix + length] scores, which the fused (flash / memory-efficient) kernels take without a mask
        # tensor; right padding sits after every real token, so causality already hides it from them
        self.bias = causal_lower_right(length, prefix + length) if prefix else None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p, b, n = self.prefix, self.batch, self.length
        heads, dim = q.shape[1], q.shape[2]
        gqa = k.shape[1] != heads
        pre = [t[:p].transpose(0, 1)[None] for t in (q, k, v)]  # [1, heads, p, dim]
        out_p = F.scaled_dot_product_attention(*pre, is_causal=True, enable_gqa=gqa)
        qs, ks, vs = (t[p:].view(b, n, t.shape[1], dim).transpose(1, 2) for t in (q, k, v))
        keys = torch.cat([pre[1].expand(b, -1, -1, -1), ks], 2)
        values = torch.cat([pre[2].expand(b, -1, -1, -1), vs], 2)
        if self.bias is None:
            out_s = F.scaled_dot_product_attention(qs, keys, values, is_causal=True, enable_gqa=gqa)
        else:
            out_s = F.scaled_dot_product_attention(qs, keys, values, attn_mask=self.bias, enable_gqa=gqa)
        return torch.cat([out_p[0].transpose(0, 1), out_s.transpose(1, 2).reshape(b * n, heads, dim)])
