"""Matrix-vector products for decode steps of a few tokens: out [M, N] = x [M, K] @ W[N, K]^T (+ bias), M small.

A decode step at batch 1 is bound by reading the weights once (15 GB for a 7B model), so what matters is the
bandwidth a kernel reaches on each projection's shape. Each program reads BLOCK_N whole rows of W (contiguous,
coalesced along K) and keeps the few x rows in registers: no split of K, hence no second reduction kernel.
Two epilogues save the decode step a launch each: `glu` (the MLP's gate/up with SiLU * up) and `lora` (one
token's adapter delta from lora_shrink's codes). Under programmatic dependent launch (dark.kernels.pdl) a
program reads its first weight columns before waiting for the kernel before. gemv_reference is the plain-torch
definition.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from . import pdl

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
else:
    from . import wait_prior


def gemv_reference(x, weight, bias=None):
    return F.linear(x, weight, bias)


if triton is not None:

    @triton.jit
    def _lora_b(b_ptr, s, cols, cm, stride_bs, stride_br, R: tl.constexpr, BR: tl.constexpr):
        """fp32 [BR, BLOCK_N]: B of slot s at output columns `cols` (mask cm): rank row r of column c holds the row
        of c's member (lora_expand's layout)."""
        r = tl.arange(0, BR)
        return tl.load(b_ptr + s * stride_bs + r[:, None] * stride_br + cols[None, :],
                       mask=(r < R)[:, None] & cm[None, :], other=0.0).to(tl.float32)

    @triton.jit
    def _lora_delta(h_ptr, b, cols, N1, N2, BR: tl.constexpr, MEMBERS: tl.constexpr, SPLITS: tl.constexpr,
                    SP: tl.constexpr):
        """fp32 [BLOCK_N]: the adapter's delta at output columns `cols` for a batch of one, from its B tile (_lora_b)
        and its codes h [SPLITS, MEMBERS, BR] (partial sums over K ranges, as lora_shrink writes them; members'
        outputs start at columns N1, N2)."""
        r = tl.arange(0, BR)
        sp = tl.arange(0, SP)
        member = (cols >= N1).to(tl.int32) + (cols >= N2).to(tl.int32)
        delta = tl.zeros(cols.shape, tl.float32)
        for mm in tl.static_range(MEMBERS):
            hm = tl.sum(tl.load(h_ptr + sp[:, None] * (MEMBERS * BR) + mm * BR + r[None, :],
                                mask=(sp < SPLITS)[:, None], other=0.0), 0)
            delta += tl.where(member == mm, tl.sum(b * hm[:, None], 0), 0.0)
        return delta

    @triton.jit
    def _member_delta(h_ptr, b, mm, BR: tl.constexpr, MEMBERS: tl.constexpr, SPLITS: tl.constexpr,
                      SP: tl.constexpr):
        """fp32 [BLOCK_N]: _lora_delta where every column is member mm's (a GLU tile's gate or up half)."""
        r = tl.arange(0, BR)
        sp = tl.arange(0, SP)
        hm = tl.sum(tl.load(h_ptr + sp[:, None] * (MEMBERS * BR) + mm * BR + r[None, :],
                            mask=(sp < SPLITS)[:, None], other=0.0), 0)
        return tl.sum(b * hm[:, None], 0)

    @triton.jit
    def _tile_deltas(lh_ptr, lb, lb_u, lm, n, N1, N2, BR: tl.constexpr, MEMBERS: tl.constexpr, SPLITS: tl.constexpr,
                     SP: tl.constexpr, GLU: tl.constexpr):
        """(delta, delta_u) fp32 [BLOCK_N] of a program's rows, 0 where lm is false (a token with no slot:
        lora_shrink left its codes unwritten, any bits, NaN too, and 0 * NaN is NaN). GLU: gate's rows are member
        0's and up's member 1's (B tiles lb, lb_u); else delta_u repeats delta, unused."""
        if GLU:
            delta = tl.where(lm, _member_delta(lh_ptr, lb, 0, BR, MEMBERS, SPLITS, SP), 0.0)
            delta_u = tl.where(lm, _member_delta(lh_ptr, lb_u, 1, BR, MEMBERS, SPLITS, SP), 0.0)
        else:
            delta = tl.where(lm, _lora_delta(lh_ptr, lb, n, N1, N2, BR, MEMBERS, SPLITS, SP), 0.0)
            delta_u = delta
        return delta, delta_u

    @triton.jit
    def _codes_part(x_ptr, K, ca_ptr, cslot_ptr, cout_ptr, stride_cas, stride_car, j, CR: tl.constexpr,
                    CBR: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
        """Program j of the codes programs: one row x's partial codes over K range j, cout[j, r] =
        x[range] . A[slot, r, range] in fp32 (r < CR; 0 up to CBR), A read before the wait."""
        r = tl.arange(0, CBR)
        k = j * CHUNK + tl.arange(0, CHUNK)
        km = k < K
        slot = tl.maximum(tl.load(cslot_ptr).to(tl.int64), 0)
        a = tl.load(ca_ptr + slot * stride_cas + r[:, None] * stride_car + k[None, :],
                    mask=(r < CR)[:, None] & km[None, :], other=0.0).to(tl.float32)
        wait_prior(PDL)
        x = tl.load(x_ptr + k, mask=km, other=0.0).to(tl.float32)
        tl.store(cout_ptr + j * CBR + r, tl.sum(a * x[None, :], 1))

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_om,
                     lslot_ptr, lh_ptr, lb_ptr, N1, N2, stride_bs, stride_br,
                     ca_ptr, cslot_ptr, cout_ptr, stride_cas, stride_car, NMAIN,
                     M: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     FIRST_K: tl.constexpr, GLU: tl.constexpr, LORA: tl.constexpr, R: tl.constexpr,
                     BR: tl.constexpr, MEMBERS: tl.constexpr, SPLITS: tl.constexpr, SP: tl.constexpr,
                     CODES: tl.constexpr, CR: tl.constexpr, CBR: tl.constexpr, CHUNK: tl.constexpr,
                     PDL: tl.constexpr, DELTA_AFTER: tl.constexpr):
        # CODES (one row): programs from NMAIN on compute an adapter's partial codes of x for a LATER kernel to
        # add the delta (_codes_part), beside the product's programs
        if CODES:
            if tl.program_id(0) >= NMAIN:
                _codes_part(x_ptr, K, ca_ptr, cslot_ptr, cout_ptr, stride_cas, stride_car,
                            tl.program_id(0) - NMAIN, CR, CBR, CHUNK, PDL)
            else:
                _gemv_body(x_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_om, lslot_ptr, lh_ptr,
                           lb_ptr, N1, N2, stride_bs, stride_br, M, HAS_BIAS, BLOCK_N, BLOCK_K, FIRST_K, GLU, LORA,
                           R, BR, MEMBERS, SPLITS, SP, PDL, DELTA_AFTER)
        else:
            _gemv_body(x_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_om, lslot_ptr, lh_ptr,
                       lb_ptr, N1, N2, stride_bs, stride_br, M, HAS_BIAS, BLOCK_N, BLOCK_K, FIRST_K, GLU, LORA,
                       R, BR, MEMBERS, SPLITS, SP, PDL, DELTA_AFTER)

    @triton.jit
    def _gemv_body(x_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_om,
                   lslot_ptr, lh_ptr, lb_ptr, N1, N2, stride_bs, stride_br,
                   M: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   FIRST_K: tl.constexpr, GLU: tl.constexpr, LORA: tl.constexpr, R: tl.constexpr,
                   BR: tl.constexpr, MEMBERS: tl.constexpr, SPLITS: tl.constexpr, SP: tl.constexpr,
                   PDL: tl.constexpr, DELTA_AFTER: tl.constexpr):
        # GLU: W is [2N, K], gate rows then up rows, and out = silu(x @ gate^T) * (x @ up^T), both products
        # rounded to out's dtype first (what the GEMV then silu_mul give). LORA (a batch of one): the adapter's
        # delta added before that rounding (a GLU's gate and up columns are its columns n and N + n).
        pid = tl.program_id(0)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
        up = rows + N * stride_wn
        # the first FIRST_K columns of this program's rows are read before waiting for the kernel before (the
        # weights never depend on it): under programmatic dependent launch that read overlaps its tail
        k1 = tl.arange(0, FIRST_K)
        m1 = nm[:, None] & (k1 < K)[None, :]
        w1 = tl.load(rows + k1[None, :], mask=m1, other=0.0).to(tl.float32)
        if GLU:
            u1 = tl.load(up + k1[None, :], mask=m1, other=0.0).to(tl.float32)
        if LORA:
            # the slot and B before the wait as well: the slot is the step's input (copied before the step's
            # first kernel), B an adapter's weights; only the codes come from the kernel just before
            ls = tl.load(lslot_ptr).to(tl.int64)
            lm = nm & (ls >= 0)
            ls = tl.maximum(ls, 0)
            lb = _lora_b(lb_ptr, ls, n, lm, stride_bs, stride_br, R, BR)
            if GLU:
                lb_u = _lora_b(lb_ptr, ls, n + N, lm, stride_bs, stride_br, R, BR)
            else:
                lb_u = lb  # unused
        wait_prior(PDL)
        if LORA and not DELTA_AFTER:
            delta, delta_u = _tile_deltas(lh_ptr, lb, lb_u, lm, n, N1, N2, BR, MEMBERS, SPLITS, SP, GLU)
        kk = tl.arange(0, BLOCK_K)
        for m in tl.static_range(M):
            x1 = tl.load(x_ptr + m * stride_xm + k1, mask=k1 < K, other=0.0).to(tl.float32)
            y = tl.sum(w1 * x1[None, :], 1)
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            if GLU:
                yu = tl.sum(u1 * x1[None, :], 1)
                acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            k0 = FIRST_K
            while k0 < K:  # a while loop: the interpreter cannot take tensor bounds in range()
                k = k0 + kk
                km = nm[:, None] & (k < K)[None, :]
                xv = tl.load(x_ptr + m * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
                acc += tl.load(rows + k[None, :], mask=km, other=0.0).to(tl.float32) * xv
                if GLU:
                    acc_u += tl.load(up + k[None, :], mask=km, other=0.0).to(tl.float32) * xv
                k0 += BLOCK_K
            y += tl.sum(acc, 1)
            if HAS_BIAS:
                y += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)
            if GLU:
                yu += tl.sum(acc_u, 1)
            if LORA:
                if DELTA_AFTER:  # the codes read once the product is summed (M is 1 with LORA)
                    delta, delta_u = _tile_deltas(lh_ptr, lb, lb_u, lm, n, N1, N2, BR, MEMBERS, SPLITS, SP, GLU)
                y += delta
                if GLU:
                    yu += delta_u
            if GLU:
                dt = out_ptr.dtype.element_ty
                g = y.to(dt).to(tl.float32)
                y = g * tl.sigmoid(g) * yu.to(dt).to(tl.float32)
            tl.store(out_ptr + m * stride_om + n, y.to(out_ptr.dtype.element_ty), mask=nm)


def config(n: int, k: int, glu: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, FIRST_K) for an [n, k] weight (glu: n outputs from 2n rows), the best of a
    sweep on an H200 at the Qwen2.5-7B shapes under programmatic dependent launch (bench/sweep_gemv.py,
    bench/RESULTS.md 2026-12-01): long rows (down_proj) 16 rows a program, 2048 columns before the wait;
    gate/up with SiLU 2 rows of each and the LM head 4, a whole 3584-wide row before the wait; q/k/v 8 rows, o 4."""
    if glu:
        return 2, 1024, 4, 4096
    if k > 8192:
        return 16, 1024, 4, 2048
    if n > 8192:
        return 4, 1024, 4, 4096
    if n > k:
        return 8, 512, 8, 1024
    return 4, 1024, 4, 1024


# with `lora`, whether a program reads the codes and sums its delta after its product (True) or before it, just
# after the wait: the GEMV alone (o_proj's, whose codes are 28 partial sums) and the gate/up one with SiLU (knobs
# for bench/profile_adapter_step.py's A/B; H200, 7B shapes, batch 1: o_proj's delta costs ~0 after its product
# against ~1.7 us a layer before it, gate/up's ~2.8 before against ~3.7 after)
DELTA_AFTER = True
GLU_DELTA_AFTER = False
# the K range of one codes program (gemv's codes_out)
CODES_CHUNK = 512
# rows of each half a program of the gate/up GEMV takes when it adds an adapter's delta (None: config's; a knob for
# bench/profile_offline.py's A/B: more rows a program, fewer programs paying the delta's fixed work)
GLU_LORA_BLOCK_N: int | None = None


def codes_parts(k: int) -> int:
    """The partial sums gemv's codes_out takes for a row of k columns."""
    return triton.cdiv(k, CODES_CHUNK)


def gemv(x, weight, bias=None, block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
         num_stages: int = 3, first_k: int | None = None, glu: bool = False, lora: dict | None = None,
         codes_out: dict | None = None):
    """x [M, K] (M small: the kernel reads W once per row of x, so it is for M = 1), weight [N, K] with unit stride
    along K, bias [N] or None -> [M, N] in x's dtype. Block sizes default to config(N, K); first_k (a power of
    two) columns of each row are read before the wait for the kernel before.

    glu: weight is [2 * N, K], a gate projection's rows then an up projection's (no bias), and the result is
    silu(x @ gate^T) * (x @ up^T) [M, N]: the MLP's gate/up GEMV and silu_mul in one launch, equal to the two.

    codes_out (M = 1, no lora): an adapter's codes of x, for a later kernel to add the delta (the residual add's
    norm: norm_rope's delta_lora), from programs of this launch beside the product's: {"A": [slots, rows, K],
    "slot": 1-element device tensor, "rank", "out": [1, codes_parts(K), 1, BR] fp32, partial sums over K ranges
    (lora_shrink's layout)}. The output is the product alone.

    lora (M = 1): an adapter's delta added in the same launch, instead of lora_expand's after it: {"h": the codes
    from lora_shrink [1, splits, members, BR], "B": factors [slots, rows, outputs] as lora_expand takes them,
    "slot": the token's slot (a 1-element integer tensor, -1: none), "rank", "splits": the members' output sizes
    (None: one member)}. The sum is rounded once (lora_expand rounds the GEMV's output, then the sum)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    N = weight.shape[0] // 2 if glu else weight.shape[0]
    assert weight.shape[1] == K and weight.stride(1) == 1 and not (glu and (bias is not None or weight.shape[0] % 2))
    bn, bk, nw, fk = config(N, K, glu)
    if glu and lora is not None and GLU_LORA_BLOCK_N:
        bn = GLU_LORA_BLOCK_N
    explicit_n = block_n
    block_n, block_k, num_warps = block_n or bn, block_k or bk, num_warps or nw
    first_k = min(first_k or (fk if block_k == bk else block_k), triton.next_power_of_2(K))  # no wider than a row
    if os.environ.get("TRITON_INTERPRET") == "1" and not explicit_n:
        # the CPU interpreter runs program by program: few large ones (an LM head is 10^4 programs of 4 rows)
        block_n = max(block_n, min(1024, 2**18 // max(first_k, block_k)))
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    lo = _lora_args(lora, M, weight.shape[0], glu)
    main = triton.cdiv(N, block_n)
    if codes_out is not None:
        A, h = codes_out["A"], codes_out["out"]
        assert M == 1 and lora is None and A.shape[-1] == K and A.stride(-1) == 1 and h.is_contiguous()
        assert h.shape[1] == codes_parts(K) and h.shape[2] == 1
        cargs = (A, codes_out["slot"], h, A.stride(0), A.stride(1), main)
        cconst = dict(CODES=True, CR=codes_out["rank"], CBR=h.shape[3], CHUNK=CODES_CHUNK)
        grid = main + h.shape[1]
    else:
        cargs, cconst, grid = (None, None, None, 0, 0, main), dict(CODES=False, CR=1, CBR=16, CHUNK=16), main
    _gemv_kernel[(grid,)](x, weight, bias if bias is not None else weight, out, N, K, x.stride(0), weight.stride(0),
                          out.stride(0), *lo["args"], *cargs, M=M, HAS_BIAS=bias is not None, BLOCK_N=block_n,
                          BLOCK_K=block_k, FIRST_K=first_k, GLU=glu, **lo["consts"], **cconst, num_warps=num_warps,
                          num_stages=num_stages, **pdl(x.device))
    return out


def _lora_args(lora: dict | None, M: int, rows: int, glu: bool = False) -> dict:
    """The kernel's LoRA arguments: pointers and sizes, and its constants."""
    if lora is None:
        return {"args": (None, None, None, 0, 0, 0, 0),
                "consts": dict(LORA=False, R=1, BR=16, MEMBERS=1, SPLITS=1, SP=1, DELTA_AFTER=False)}
    h, B, slot = lora["h"], lora["B"], lora["slot"]
    splits = lora.get("splits") or [rows]
    assert M == 1 and slot.numel() == 1 and h.shape[0] == 1 and h.shape[2] == len(splits) <= 3
    assert B.stride(2) == 1 and B.shape[2] == rows == sum(splits) and h.is_contiguous()
    assert not glu or len(splits) == 2, "a GLU's adapter delta comes as two members: gate's and up's"
    bounds = [sum(splits[:i + 1]) for i in range(len(splits) - 1)] + [rows, rows]
    return {"args": (slot, h, B, bounds[0], bounds[1], B.stride(0), B.stride(1)),
            "consts": dict(LORA=True, R=lora["rank"], BR=h.shape[3], MEMBERS=h.shape[2], SPLITS=h.shape[1],
                           SP=triton.next_power_of_2(h.shape[1]),
                           DELTA_AFTER=GLU_DELTA_AFTER if glu else DELTA_AFTER)}
