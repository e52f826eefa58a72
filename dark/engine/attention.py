"""Attention over a paged KV cache (serving) and over a dense causal batch (training), in plain torch.

The paged path gathers each sequence's cache blocks into a padded batch and runs one SDPA call per layer
for all sequences, whatever mix of prefill chunks and decode tokens the step holds. GPU kernels can
replace `attend` without touching the model.
"""
from __future__ import annotations

import os

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


VARLEN_ATTENTION = os.environ.get("DARK_VARLEN_ATTENTION", "1") != "0"
# a mixed step's single-token rows apart from its prefill chunks: through the paged decode kernel rather than the
# packed flash batch, or in a padded batch of their own rather than padded to the longest chunk (DARK_SPLIT_DECODE_ROWS=0:
# every row in one batch, as before 2026-12-03)
SPLIT_DECODE_ROWS = os.environ.get("DARK_SPLIT_DECODE_ROWS", "1") != "0"


def varlen_applies(cache: torch.Tensor) -> bool:
    """Whether the packed flash path serves prefill steps on this cache: CUDA, half precision, head dim <= 256."""
    return (VARLEN_ATTENTION and cache.is_cuda and cache.dtype in (torch.bfloat16, torch.float16)
            and cache.shape[-1] <= 256 and cache.shape[-1] % 8 == 0)


class PagedAttention:
    """Metadata of one engine step, shared by all layers.

    q_lens[b] new tokens of sequence b are computed at positions ctx_lens[b] - q_lens[b] .. ctx_lens[b] - 1;
    its keys live in the blocks of block_tables[b].

    On CUDA in bf16/fp16 the step's sequences attend as one packed variable-length batch through the flash
    kernel torch ships (each sequence's keys gathered from its blocks, causal aligned to the bottom right, no
    padding and no mask); with `decode_kernel` (the runner's Triton kernels on), a step that mixes prefill chunks with
    single-token rows sends those rows to paged_decode instead (_split_decode_rows). Elsewhere (the CPU,
    float32/64, or DARK_VARLEN_ATTENTION=0) they attend as a padded batch under a dense mask in SDPA, the
    single-token rows of a mixed step in a batch of their own (padded to one query, not to the longest chunk).
    (Attending each prefill chunk alone with bottom-right causal SDPA was tried
    on 2026-12-01: its ~8k-token prefill steps of the offline benchmark measured 676-795 ms on the H200 against
    418 ms for the padded form.)
    """

    def __init__(self, cache: KVCache, q_lens: list[int], ctx_lens: list[int], block_tables: list[list[int]],
                 slot_mapping: torch.Tensor, decode_kernel: bool = False):
        device = cache.data.device
        self.cache = cache
        self.slot_mapping = slot_mapping
        bs = cache.block_size
        self.varlen = varlen_applies(cache.data)
        self.decode = None  # (token rows, block tables, context lengths, ranges, stages): the rows paged_decode attends
        # a step mixing single-token rows with prefill chunks attends the two apart (SPLIT_DECODE_ROWS)
        single = [i for i, n in enumerate(q_lens) if n == 1] if SPLIT_DECODE_ROWS and max(q_lens) > 1 else []
        rest = [i for i, n in enumerate(q_lens) if n != 1] if single else list(range(len(q_lens)))
        if self.varlen:
            self.block_tables = self._tables(block_tables, device)
            rows = list(range(len(q_lens)))
            if decode_kernel and single:
                self._split_decode_rows(q_lens, ctx_lens, single, device)
                rows = rest
            self.prefill_rows = None if len(rows) == len(q_lens) else self._token_rows(q_lens, rows, device)
            q_sub, ctx_sub = [q_lens[i] for i in rows], [ctx_lens[i] for i in rows]
            tables = self.block_tables if len(rows) == len(q_lens) else self.block_tables[torch.tensor(rows, device=device)]
            q_lens_t = torch.tensor(q_sub, device=device)
            ctx_t = torch.tensor(ctx_sub, device=device)
            zero = torch.zeros(1, dtype=torch.int32, device=device)
            self.cu_q = torch.cat([zero, torch.cumsum(q_lens_t, 0, dtype=torch.int32)])
            self.cu_k = torch.cat([zero, torch.cumsum(ctx_t, 0, dtype=torch.int32)])
            self.max_q, self.max_k = max(q_sub), max(ctx_sub)
            total_k = sum(ctx_sub)
            # key i of the packed batch: sequence seq_of_k[i], position pos[i], cache slot kv_index[i]
            seq_of_k = torch.repeat_interleave(torch.arange(len(ctx_sub), device=device), ctx_t, output_size=total_k)
            pos = torch.arange(total_k, device=device) - self.cu_k[:-1].long()[seq_of_k]
            self.kv_index = tables[seq_of_k, pos // bs] * bs + pos % bs
            return
        # the padded form: one padded query batch per group of sequences, the single-token rows in their own (else
        # each would be padded to the longest chunk's length)
        groups = [single, rest] if single else [rest]
        self.padded = [(None if len(groups) == 1 else self._token_rows(q_lens, g, device),
                        self._padded_batch([q_lens[i] for i in g], [ctx_lens[i] for i in g],
                                           [block_tables[i] for i in g], bs, device)) for g in groups]

    @staticmethod
    def _tables(block_tables: list[list[int]], device) -> torch.Tensor:
        """The sequences' block tables as one tensor, rows padded with block 0 to the longest."""
        nb = max(len(t) for t in block_tables)
        return torch.tensor([t + [0] * (nb - len(t)) for t in block_tables], dtype=torch.long, device=device)

    @staticmethod
    def _padded_batch(q_lens: list[int], ctx_lens: list[int], block_tables: list[list[int]], bs: int, device) -> tuple:
        """(block tables, row and column of each token in the padded query batch, the mask, its query length) of
        these sequences."""
        tables = PagedAttention._tables(block_tables, device)
        nb = tables.shape[1]
        q_lens_t = torch.tensor(q_lens, device=device)
        ctx_t = torch.tensor(ctx_lens, device=device)
        max_q = max(q_lens)
        # token i of the flat batch sits at (row b, column j) of the padded query batch
        q_row = torch.repeat_interleave(torch.arange(len(q_lens), device=device), q_lens_t)
        starts = torch.cumsum(q_lens_t, 0) - q_lens_t
        q_col = torch.arange(sum(q_lens), device=device) - starts[q_row]
        qpos = (ctx_t - q_lens_t)[:, None] + torch.arange(max_q, device=device)[None, :]
        kpos = torch.arange(nb * bs, device=device)
        # padded query rows see key 0 at least, so softmax never meets an empty row
        mask = ((kpos[None, None, :] <= qpos[:, :, None]) & (kpos[None, None, :] < ctx_t[:, None, None]))[:, None]
        return tables, q_row, q_col, mask, max_q

    @staticmethod
    def _padded_attend(batch: tuple, kc: torch.Tensor, vc: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        tables, q_row, q_col, mask, max_q = batch
        heads, dim = kc.shape[-2:]
        b = tables.shape[0]
        keys = kc[tables].view(b, -1, heads, dim).transpose(1, 2)
        values = vc[tables].view(b, -1, heads, dim).transpose(1, 2)
        qp = q.new_zeros(b, max_q, q.shape[1], dim)
        qp[q_row, q_col] = q
        out = F.scaled_dot_product_attention(qp.transpose(1, 2), keys, values, attn_mask=mask,
                                             enable_gqa=heads != q.shape[1])
        return out.transpose(1, 2)[q_row, q_col]

    def _split_decode_rows(self, q_lens: list[int], ctx_lens: list[int], dec: list[int], device) -> None:
        """Send the step's single-token rows `dec` (a running sequence's next token) to paged_decode, which reads
        each one's keys straight from its blocks; the rest (prefill chunks) stay in the packed flash batch. In that
        batch a single query row still costs a whole query tile over its context, and its keys are gathered first:
        with ~240 sequences decoding beside an 8k-token prefill, ~30 ms of a ~200 ms step (bench/RESULTS.md,
        2026-12-03)."""
        rows = self._token_rows(q_lens, dec, device)
        picked = torch.tensor(dec, device=device)
        # block tables as the decode steps' graphs hand them to the kernel (int32, rows 16-aligned): the kernel
        # compiled for those serves these rows too, with no compile in the middle of serving
        width = -(-self.block_tables.shape[1] // 16) * 16
        tables = torch.zeros(len(dec), width, dtype=torch.int32, device=device)
        tables[:, :self.block_tables.shape[1]] = self.block_tables[picked]
        # and the context ranges and pipelining of the decode graph whose bucket holds this many rows: the kernel
        # variants those graphs compiled (a batch size no graph had, e.g. 13 rows, would compile new ones mid-serving)
        from ..models.decoder import kernel_module
        from .runner import GRAPH_BUCKETS

        bucket = next((b for b in GRAPH_BUCKETS if b >= len(dec)), len(dec))
        kernels = kernel_module("paged_attention")
        self.decode = (rows, tables, torch.tensor([ctx_lens[i] for i in dec], device=device),
                       kernels.default_splits(bucket, self.cache.data.shape[-2]), kernels.default_stages(bucket))

    @staticmethod
    def _token_rows(q_lens: list[int], seqs: list[int], device):
        """The flat batch's token rows of these sequences, in order: a slice when they are consecutive."""
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        if seqs == list(range(seqs[0], seqs[-1] + 1)):
            return slice(starts[seqs[0]], starts[seqs[-1] + 1])
        return torch.tensor([t for i in seqs for t in range(starts[i], starts[i + 1])], device=device)

    def _flash(self, kc: torch.Tensor, vc: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        heads, dim = kc.shape[-2:]
        keys = kc.view(-1, heads, dim).index_select(0, self.kv_index)
        values = vc.view(-1, heads, dim).index_select(0, self.kv_index)
        return torch.ops.aten._flash_attention_forward(q.contiguous(), keys, values, self.cu_q, self.cu_k,
                                                       self.max_q, self.max_k, 0.0, True, False)[0]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kc, vc = self.cache.data[layer, 0], self.cache.data[layer, 1]
        heads, dim = kc.shape[-2:]
        kc.view(-1, heads, dim)[self.slot_mapping] = k
        vc.view(-1, heads, dim)[self.slot_mapping] = v
        if self.varlen:
            if self.decode is None:
                return self._flash(kc, vc, q)
            from ..models.decoder import kernel_module

            rows, tables, ctx, splits, stages = self.decode
            out = torch.empty_like(q)
            # under dependent launch, as the decode graphs launch it: the variant they compiled (PDL is one of the
            # kernel's compile-time switches; without it the first mixed steps of a process compiled ~0.7 s each)
            with kernel_module().dependent_launch():
                out[rows] = kernel_module("paged_attention").paged_decode(
                    q[rows].contiguous(), kc, vc, tables, ctx, dim ** -0.5, splits=splits, num_stages=stages)
            out[self.prefill_rows] = self._flash(kc, vc, q[self.prefill_rows])  # a split step has chunks too
            return out
        if len(self.padded) == 1:
            return self._padded_attend(self.padded[0][1], kc, vc, q)
        out = torch.empty_like(q)
        for rows, batch in self.padded:
            out[rows] = self._padded_attend(batch, kc, vc, q[rows])
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

    def attend_fused_qkv(self, layer: int, y: torch.Tensor, nh: int, nkv: int, d: int, cos: torch.Tensor,
                         sin: torch.Tensor, codes: dict | None = None, lora: dict | None = None) -> torch.Tensor:
        """attend on a fused q/k/v projection output y [T, (nh + 2 * nkv) * d], unrotated: q and k rotated and k, v
        stored in one launch (qkv_rotary_store) instead of two rotary launches and store_kv, then paged_decode.
        SelfAttention calls it in passes without autograd with the fused kernels on, when q and k have no norm.
        codes: paged_decode's (an adapter's codes for o_proj, a batch of one); lora: qkv_rotary_store's (y still
        lacks the q/k/v group's adapter delta, a batch of one)."""
        from ..models.decoder import kernel_module

        pa = kernel_module("paged_attention")
        kc, vc = self.cache.data[layer, 0], self.cache.data[layer, 1]
        q = pa.qkv_rotary_store(y, nh, nkv, d, cos, sin, kc, vc, self.slot_mapping, lora=lora)
        return pa.paged_decode(q, kc, vc, self.block_tables, self.ctx_lens, self.scale, self.splits, codes=codes)


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

    On Hopper SDPA takes cuDNN's attention for these calls. cuDNN builds a plan for every length it has not met
    (~0.1 s forward + backward on an H200; 2.4 s its first use in a process, which the learn thread's warm-up step
    pays), yet whole corrections took as long as with flash (1.10 / 1.11 s, 6 each) and a 2 x 2048 training step is
    4.7% faster (422 / 442 ms): torch keeps the choice (bench/RESULTS.md, 2026-12-02 11:52 and 12:35-12:45).
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
        if not p:
            # no shared prefix (a batch of unrelated sequences): causal attention per sequence, nothing to join. An
            # empty prefix call would take SDPA's math path, ~20 host operator calls a layer for no work
            qs, ks, vs = (t.view(b, n, t.shape[1], dim).transpose(1, 2) for t in (q, k, v))
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa).transpose(1, 2).reshape(
                b * n, heads, dim)
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
