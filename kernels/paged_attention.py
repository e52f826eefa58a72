"""Decode attention over the paged KV cache: one query token per sequence, keys read through the block table.

`paged_decode` splits each sequence's context into `splits` contiguous ranges (flash-decoding), one program
per (sequence, KV head, range) that handles all query heads of its GQA group, then a second kernel merges the
ranges (with one range, the first kernel writes the output and there is no merge). Nothing is gathered or padded; a sequence with context length 0 (a padded row of a CUDA-graph batch)
gets zeros. `store_kv` writes the step's keys and values into their cache slots, skipping slot -1.
`qkv_rotary_store` takes the fused q/k/v projection output instead: it rotates q into a new tensor and k into the
cache, and stores v, in one launch (a decode step's split, two rotary kernels and store_kv before).
The plain-torch references below are what the tests compare with.
"""
from __future__ import annotations

import math
import os

import torch

from . import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install runs without Triton: the engine then keeps its plain-torch path
    triton = None
else:
    from . import wait_prior

LOG2E = 1.4426950408889634
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def paged_decode_reference(q, k_cache, v_cache, block_tables, ctx_lens, scale):
    """q [B, H, D]; caches [blocks, block_size, KVH, D]; block_tables [B, >=ceil(ctx/bs)]; ctx_lens [B]."""
    B, H, D = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros_like(q)
    for b in range(B):
        n = int(ctx_lens[b])
        if n == 0:
            continue
        pages = block_tables[b, :(n + bs - 1) // bs].long()
        k = k_cache[pages].reshape(-1, kvh, D)[:n].float()
        v = v_cache[pages].reshape(-1, kvh, D)[:n].float()
        k, v = (t.repeat_interleave(H // kvh, dim=1) for t in (k, v))
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v).to(q.dtype)
    return out


def store_kv_reference(k, v, k_cache, v_cache, slot_mapping):
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


def qkv_rotary_store_reference(y, nh, nkv, d, cos, sin, k_cache, v_cache, slot_mapping):
    """y [T, (nh + 2 * nkv) * d], a fused q/k/v projection output: q and k rotated (fp32 math, as the rotary kernel),
    k and v stored at their slots (-1: skipped); returns q [T, nh, d]."""
    from .norm_rope import qkv_rotary_reference

    q, k, v = qkv_rotary_reference(y, nh, nkv, d, cos, sin)
    store_kv_reference(k, v, k_cache, v_cache, slot_mapping)
    return q


if triton is not None:

    @triton.jit
    def _head_deltas(lh_ptr, b1, b2, member, has, R: tl.constexpr, BR: tl.constexpr, SPLITS: tl.constexpr,
                     SP: tl.constexpr, L2_ONLY: tl.constexpr):
        """One head's adapter delta, its two halves [HALF] in fp32, from its member's codes (the partial sums of
        lh [SPLITS, 3, BR] added up) and its B columns b1, b2 [BR, HALF]. A token with no slot (has false): its
        codes were never written (any bits, NaN too), so none of them is read. L2_ONLY: the codes read past L1."""
        r = tl.arange(0, BR)
        sp = tl.arange(0, SP)
        ptrs = lh_ptr + sp[:, None] * (3 * BR) + member * BR + r[None, :]
        mask = (sp < SPLITS)[:, None] & ((r < R) & has)[None, :]
        if L2_ONLY:
            hs = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
        else:
            hs = tl.load(ptrs, mask=mask, other=0.0)
        code = tl.sum(hs, 0)
        return tl.sum(b1 * code[:, None], 0), tl.sum(b2 * code[:, None], 0)

    @triton.jit
    def _qkv_rotary_store_kernel(y_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr, slot_ptr, stride_y, stride_c,
                                 stride_q, lslot_ptr, lh_ptr, lb_ptr, stride_bs, stride_br,
                                 NH: tl.constexpr, NKV: tl.constexpr, HALF: tl.constexpr, LORA: tl.constexpr,
                                 R: tl.constexpr, BR: tl.constexpr, SPLITS: tl.constexpr, SP: tl.constexpr,
                                 CODES_AFTER: tl.constexpr, PDL: tl.constexpr):
        # one program per (token, head of y): heads [0, NH) are q's, rotated into q; [NH, NH + NKV) k's, rotated
        # into the key cache; the rest v's, copied into the value cache. The rotation is the rotary kernel's.
        # LORA (a batch of one): the adapter's delta of the head's columns added to y first (y + delta rounded to
        # y's dtype, as lora_expand leaves the projection's output). The slot and B (the step's input, an adapter's
        # weights) are read before the wait, and so are the codes, which come from the kernel before the
        # projection's (the norm, or lora_shrink): under dependent launch this kernel starts only once every program
        # of the projection has passed its own wait, so that kernel is finished and its writes are in L2 (read past
        # L1: ".cg"). CODES_AFTER: the codes read after the wait instead, beside y.
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        d = tl.arange(0, HALF)
        src = y_ptr + t * stride_y + h * (2 * HALF) + d
        if LORA:
            member = (h >= NH).to(tl.int32) + (h >= NH + NKV).to(tl.int32)
            ls = tl.load(lslot_ptr).to(tl.int64)
            has = ls >= 0
            r = tl.arange(0, BR)
            bcol = lb_ptr + tl.maximum(ls, 0) * stride_bs + r[:, None] * stride_br + h * (2 * HALF) + d[None, :]
            bm = (r < R)[:, None] & has
            b1 = tl.load(bcol, mask=bm, other=0.0).to(tl.float32)
            b2 = tl.load(bcol + HALF, mask=bm, other=0.0).to(tl.float32)
            if not CODES_AFTER:
                delta1, delta2 = _head_deltas(lh_ptr, b1, b2, member, has, R, BR, SPLITS, SP, True)
        wait_prior(PDL)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        cache = tl.maximum(slot, 0) * (NKV * 2 * HALF) + d  # a cache row of NKV heads, as store_kv's
        # y's two halves and the codes are all loaded before any of them is used: one round trip to memory
        y1 = tl.load(src)
        y2 = tl.load(src + HALF)
        if LORA:
            if CODES_AFTER:
                delta1, delta2 = _head_deltas(lh_ptr, b1, b2, member, has, R, BR, SPLITS, SP, False)
            y1 = (y1.to(tl.float32) + delta1).to(y_ptr.dtype.element_ty)
            y2 = (y2.to(tl.float32) + delta2).to(y_ptr.dtype.element_ty)
        if h < NH + NKV:
            x1 = y1.to(tl.float32)
            x2 = y2.to(tl.float32)
            c1 = tl.load(cos_ptr + t * stride_c + d).to(tl.float32)
            c2 = tl.load(cos_ptr + t * stride_c + HALF + d).to(tl.float32)
            s1 = tl.load(sin_ptr + t * stride_c + d).to(tl.float32)
            s2 = tl.load(sin_ptr + t * stride_c + HALF + d).to(tl.float32)
            o1 = x1 * c1 - x2 * s1
            o2 = x2 * c2 + x1 * s2
            if h < NH:
                q_dst = q_ptr + t * stride_q + h * (2 * HALF) + d
                tl.store(q_dst, o1.to(q_ptr.dtype.element_ty))
                tl.store(q_dst + HALF, o2.to(q_ptr.dtype.element_ty))
            else:
                k_mask = (d < HALF) & (slot >= 0)
                k_dst = kc_ptr + cache + (h - NH) * (2 * HALF)
                # rounded to y's dtype first, as rotary's output is before store_kv copies it
                k_dt = y_ptr.dtype.element_ty
                tl.store(k_dst, o1.to(k_dt).to(kc_ptr.dtype.element_ty), mask=k_mask)
                tl.store(k_dst + HALF, o2.to(k_dt).to(kc_ptr.dtype.element_ty), mask=k_mask)
        else:
            v_mask = (d < HALF) & (slot >= 0)
            v_dst = vc_ptr + cache + (h - NH - NKV) * (2 * HALF)
            tl.store(v_dst, y1.to(vc_ptr.dtype.element_ty), mask=v_mask)
            tl.store(v_dst + HALF, y2.to(vc_ptr.dtype.element_ty), mask=v_mask)

    @triton.jit
    def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_k, stride_v, W: tl.constexpr,
                         BW: tl.constexpr, PDL: tl.constexpr):
        wait_prior(PDL)
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        w = tl.arange(0, BW)
        m = (w < W) & (slot >= 0)
        dst = tl.maximum(slot, 0) * W + w
        tl.store(kc_ptr + dst, tl.load(k_ptr + t * stride_k + w, mask=m), mask=m)
        tl.store(vc_ptr + dst, tl.load(v_ptr + t * stride_v + w, mask=m), mask=m)

    @triton.jit
    def _attend_tile(q, kc_ptr, vc_ptr, bt_ptr, b, kvh, n0, end, acc, m_i, l_i, stride_cb, stride_cs, stride_ch,
                     stride_bt, qk_scale, D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                     DOT_F32: tl.constexpr):
        # one tile of BLOCK_N keys and values (through the block table) into the online softmax of a GQA group
        d = tl.arange(0, D)
        offs = n0 + tl.arange(0, BLOCK_N)
        nm = offs < end
        page = tl.load(bt_ptr + b * stride_bt + offs // BS, mask=nm, other=0).to(tl.int64)
        addr = page[:, None] * stride_cb + (offs % BS)[:, None] * stride_cs + kvh * stride_ch + d[None, :]
        k = tl.load(kc_ptr + addr, mask=nm[:, None], other=0.0)
        v = tl.load(vc_ptr + addr, mask=nm[:, None], other=0.0)
        if DOT_F32:  # fp32 caches (exact, not tf32), and the interpreter, whose dot misreads bf16 operands
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * qk_scale
        else:
            s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(nm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_F32:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        return acc, m_new, l_i

    @triton.jit
    def _paged_decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, m_ptr, l_ptr, acc_ptr, out_ptr,
                             stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt, qk_scale,
                             G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                             BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, DOT_F32: tl.constexpr,
                             LOOP_FOR: tl.constexpr, PDL: tl.constexpr):
        wait_prior(PDL)
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        H = tl.num_programs(1) * G
        ctx = tl.load(ctx_ptr + b).to(tl.int32)
        per = tl.cdiv(tl.cdiv(ctx, SPLITS), BLOCK_N) * BLOCK_N
        start = sp * per
        end = tl.minimum(start + per, ctx)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        gm = g < G
        heads = kvh * G + g
        q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=gm[:, None], other=0.0)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        if LOOP_FOR:  # compiled: a for loop, which Triton pipelines (the loads of the next tile in flight)
            for n0 in tl.range(start, end, BLOCK_N):
                acc, m_i, l_i = _attend_tile(q, kc_ptr, vc_ptr, bt_ptr, b, kvh, n0, end, acc, m_i, l_i, stride_cb,
                                             stride_cs, stride_ch, stride_bt, qk_scale, D, BS, BLOCK_N, DOT_F32)
        else:  # the interpreter cannot take tensor bounds in range()
            n0 = start
            while n0 < end:
                acc, m_i, l_i = _attend_tile(q, kc_ptr, vc_ptr, bt_ptr, b, kvh, n0, end, acc, m_i, l_i, stride_cb,
                                             stride_cs, stride_ch, stride_bt, qk_scale, D, BS, BLOCK_N, DOT_F32)
                n0 += BLOCK_N
        if SPLITS == 1:  # the whole context in this program: the output itself, no merge
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=gm[:, None])
        else:
            row = (b * H + heads) * SPLITS + sp
            tl.store(m_ptr + row, m_i, mask=gm)
            tl.store(l_ptr + row, l_i, mask=gm)
            tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=gm[:, None])

    @triton.jit
    def _merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, stride_ot, stride_oh, a_ptr, slot_ptr, codes_ptr, stride_as,
                      stride_ar, D: tl.constexpr, SPLITS: tl.constexpr, SP: tl.constexpr, CODES: tl.constexpr,
                      R: tl.constexpr, BR: tl.constexpr, PDL: tl.constexpr):
        # CODES (a batch of one): head h's part of an adapter's codes for the projection that takes the output
        # (o_proj), codes[h, r] = out[h] . A[slot, r, h * D:(h + 1) * D] in fp32, A read before the wait
        b = tl.program_id(0)
        h = tl.program_id(1)
        H = tl.num_programs(1)
        d = tl.arange(0, D)
        if CODES:
            r = tl.arange(0, BR)
            slot = tl.maximum(tl.load(slot_ptr).to(tl.int64), 0)
            a = tl.load(a_ptr + slot * stride_as + r[:, None] * stride_ar + h * D + d[None, :],
                        mask=(r < R)[:, None], other=0.0).to(tl.float32)
        wait_prior(PDL)
        s = tl.arange(0, SP)
        sm = s < SPLITS
        row = (b * H + h) * SPLITS + s
        m = tl.load(m_ptr + row, mask=sm, other=float("-inf"))
        l = tl.load(l_ptr + row, mask=sm, other=0.0)
        mx = tl.max(m, 0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - mx))
        acc = tl.load(acc_ptr + row[:, None] * D + d[None, :], mask=sm[:, None], other=0.0)
        total = tl.sum(l * w, 0)
        o = (tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + b * stride_ot + h * stride_oh + d, o)
        if CODES:
            tl.store(codes_ptr + h * BR + r, tl.sum(a * o.to(tl.float32)[None, :], 1))


def default_splits(batch: int, kv_heads: int, num_sms: int = 132) -> int:
    """Enough context ranges to give every multiprocessor two programs, at most 16: a power of two, so the
    few compiled variants of the kernels serve every batch size (a new value compiles both kernels again,
    which a step of a batch size no CUDA graph bucket had would pay for in the middle of serving). Timed as a
    decode step runs it (28 calls in a CUDA graph, 1,100-token contexts, H200): 2 ranges at 48 sequences
    33.8 us a call against 41.0 with 1, at 64 42.3 against 44.1; 1 from 128 sequences up."""
    n = max(1, min(16, -(-2 * num_sms // max(1, batch * kv_heads))))
    return 1 << (n.bit_length() - 1)


def default_stages(batch: int) -> int | None:
    """paged_decode's pipelining for a batch of `batch` sequences (see its num_stages): 3 tiles in flight from 16
    sequences up, else one at a time."""
    return 3 if batch >= 16 else None


def store_kv(k, v, k_cache, v_cache, slot_mapping):
    """k, v [T, KVH, D] into caches [blocks, block_size, KVH, D] at flat slots slot_mapping [T] (-1: skip)."""
    T = k.shape[0]
    W = k.shape[1] * k.shape[2]
    assert k.stride(2) == 1 and k.stride(1) == k.shape[2] and v.stride(2) == 1 and v.stride(1) == v.shape[2]
    _store_kv_kernel[(T,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), W,
                           triton.next_power_of_2(W), **pdl(k.device))


# with `lora`: the codes read after the wait, beside y (True), or before it (a knob for
# bench/profile_adapter_step.py's A/B; H200, 7B shapes, batch 1: adapter / base 0.952 after, 0.963 before)
ROTARY_CODES_AFTER = False


def qkv_rotary_store(y, nh, nkv, d, cos, sin, k_cache, v_cache, slot_mapping, lora: dict | None = None):
    """A fused q/k/v projection output y [T, (nh + 2 * nkv) * d] (last dim contiguous, rows may be wider) ->
    q [T, nh, d] rotated (a new tensor), with k rotated and v written into caches [blocks, block_size, nkv, d]
    (contiguous) at the flat slots slot_mapping [T] (-1: skip), in one launch: what rotary (q and k) and store_kv
    write, by the same arithmetic. cos, sin [T, d] with their halves repeated, as dark.models.decoder.Rotary makes
    them. One program per (token, head): 36 for a Qwen2.5-7B token, so a batch of one spreads over the SMs.

    lora (T = 1): y lacks its adapter's delta, which is added here first, as dark.kernels.gemv's `lora` would have
    added it in the projection (the same dict: "h" the q/k/v group's codes [1, splits, 3, BR] from the kernel
    before the projection's, which must not be the kernel just before this one: they are read before its wait;
    "B" [slots, rows, (nh + 2 * nkv) * d], "slot", "rank", "splits" the members' widths).
    The q/k/v GEMV then runs as the base model's, and each head's program reads only its own columns of B."""
    T = y.shape[0]
    assert y.dim() == 2 and y.shape[1] == (nh + 2 * nkv) * d and y.stride(1) == 1 and d % 2 == 0
    assert k_cache.shape[2:] == (nkv, d) and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert cos.shape == (T, d) and cos.stride(1) == 1 and cos.stride() == sin.stride()
    half = d // 2
    assert half & (half - 1) == 0, "head_dim / 2 must be a power of two"
    q = torch.empty(T, nh, d, device=y.device, dtype=y.dtype)
    if lora is not None:
        hc, B, ls = lora["h"], lora["B"], lora["slot"]
        assert T == 1 and ls.numel() == 1 and hc.is_contiguous() and hc.shape[0] == 1 and hc.shape[2] == 3
        assert list(lora["splits"]) == [nh * d, nkv * d, nkv * d] and B.stride(2) == 1
        largs = (ls, hc, B, B.stride(0), B.stride(1))
        lconst = dict(LORA=True, R=lora["rank"], BR=hc.shape[3], SPLITS=hc.shape[1],
                      SP=triton.next_power_of_2(hc.shape[1]), CODES_AFTER=ROTARY_CODES_AFTER)
    else:
        largs, lconst = (None, None, None, 0, 0), dict(LORA=False, R=1, BR=16, SPLITS=1, SP=1, CODES_AFTER=False)
    if T:
        _qkv_rotary_store_kernel[(T, nh + 2 * nkv)](y, cos, sin, q, k_cache, v_cache, slot_mapping, y.stride(0),
                                                   cos.stride(0), q.stride(0), *largs, NH=nh, NKV=nkv, HALF=half,
                                                   **lconst, **pdl(y.device))
    return q


def paged_decode(q, k_cache, v_cache, block_tables, ctx_lens, scale, splits: int | None = None,
                 block_n: int = 64, num_warps: int = 4, num_stages: int | None = -1, codes: dict | None = None):
    """q [B, H, D] -> [B, H, D]; caches [blocks, block_size, KVH, D]; block_tables [B, W] int; ctx_lens [B].
    num_stages: tiles of keys and values in flight at once (a pipelined loop); None: one at a time; -1: 3 from
    16 sequences up (in a CUDA graph of 28 calls, H200, 1,100-token contexts: 142 against 175 us a call at 256
    sequences, 72 against 113 at 128, 27.6 against 31.1 at 32), else one at a time (9.9 against 10.4 us at 8).

    codes (a batch of one, with a merge: more than one range): the merge also writes an adapter's codes for the
    projection that takes the output, per head: {"A": [slots, rows, H * D], "slot": 1-element device tensor,
    "rank", "out": [1, H, 1, BR] fp32, whose sum over axis 1 is out . A[slot, :rank]^T (lora_shrink's layout, one
    range a head)}; sets codes["written"]. Left unwritten (the caller then shrinks) without a merge."""
    B, H, D = q.shape
    _, bs, kvh, _ = k_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and q.stride(2) == 1
    G = H // kvh
    splits = splits or default_splits(B, kvh)
    if num_stages == -1:
        num_stages = default_stages(B)
    out = torch.empty_like(q)
    # one range per sequence: the kernel writes the output (no partial results, no merge)
    parts = B * H * splits if splits > 1 else 1
    part_m = torch.empty(parts, device=q.device, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(parts, D, device=q.device, dtype=torch.float32)
    _paged_decode_kernel[(B, kvh, splits)](
        q, k_cache, v_cache, block_tables, ctx_lens, part_m, part_l, part_acc, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        scale * LOG2E, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BS=bs, BLOCK_N=block_n, SPLITS=splits,
        DOT_F32=_INTERPRETING or k_cache.dtype == torch.float32, LOOP_FOR=num_stages is not None and not _INTERPRETING,
        num_warps=num_warps, **({"num_stages": num_stages} if num_stages else {}), **pdl(q.device))
    if splits == 1:
        return out
    if codes is not None:
        A, h = codes["A"], codes["out"]
        assert B == 1 and A.shape[-1] == H * D and A.stride(-1) == 1 and h.is_contiguous() and h.shape[1] == H
        cargs = (A, codes["slot"], h, A.stride(0), A.stride(1))
        cconst = dict(CODES=True, R=codes["rank"], BR=h.shape[3])
        codes["written"] = True
    else:
        cargs, cconst = (None, None, None, 0, 0), dict(CODES=False, R=1, BR=16)
    _merge_kernel[(B, H)](part_m, part_l, part_acc, out, out.stride(0), out.stride(1), *cargs, D=D, SPLITS=splits,
                          SP=triton.next_power_of_2(splits), **cconst, **pdl(q.device))
    return out


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
