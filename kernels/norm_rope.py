"""RMSNorm, rotary embedding and SiLU * mul, one launch each instead of the ~7, ~10 and ~3 small elementwise kernels
of the plain-torch modules (which dominate a CUDA-graph decode step's launch count, and a LoRA training step's).

rms_norm, add_rms_norm (a residual add and the RMSNorm after it, one launch), rotary and silu_mul are for passes
without autograd (serving). The *_train functions are autograd Functions for training, whose base weights are
frozen: each backward is one launch too (a few for q/k/v) and gives the gradient of the activation only
(rms_norm_train none for its weight). qkv_rotary_train also takes the place of the split of a fused q/k/v
projection output, so its backward writes one gradient instead of adding three zero-padded ones. The *_reference
functions are the plain-torch definitions; their backward is autograd's.
"""
from __future__ import annotations

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


def rms_norm_reference(x, weight, eps):
    """As dark.models.decoder.RMSNorm: normalise in fp32, cast back, then scale by the weight."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm_reference(x, delta, weight, eps):
    """The decoder's residual add and the RMSNorm after it: (rms_norm_reference(x + delta), x + delta)."""
    summed = x + delta
    return rms_norm_reference(summed, weight, eps), summed


def rotary_reference(x, cos, sin):
    """x [T, heads, D]; cos, sin [T, D] (halves repeated): x * cos + rotate_half(x) * sin, in fp32."""
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos.float()[:, None, :] + rotated * sin.float()[:, None, :]).to(x.dtype)


def qkv_rotary_reference(y, nh, nkv, d, cos, sin):
    """As dark.models.decoder.SelfAttention on a fused projection output y [T, (nh + 2 * nkv) * d]: split it into
    q [T, nh, d], k and v [T, nkv, d], and rotate q and k."""
    t = y.shape[0]
    q, k, v = y.split([nh * d, nkv * d, nkv * d], -1)
    q, k, v = q.reshape(t, nh, d), k.reshape(t, nkv, d), v.reshape(t, nkv, d)
    return rotary_reference(q, cos, sin), rotary_reference(k, cos, sin), v


def silu_mul_reference(gate_up, size):
    """As dark.models.decoder.MLP on a fused gate/up output [..., 2 * size]: silu(gate) * up, in its dtype."""
    gate, up = gate_up.split(size, -1)
    return F.silu(gate) * up


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, stride_x, stride_o, eps, BN: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0)
        n = tl.arange(0, BN)
        m = n < N
        w = tl.load(w_ptr + n, mask=m, other=0.0).to(tl.float32)
        wait_prior(PDL)
        x = tl.load(x_ptr + row * stride_x + n, mask=m, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
        y = (x * r).to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_o + n, (w * y).to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, out_ptr, sum_ptr, N, stride_x, stride_d, stride_o, stride_s, eps,
                             BN: tl.constexpr, PDL: tl.constexpr):
        # s = x + delta rounded to the sum's dtype (what torch's add gives: the fp32 sum of two bf16/fp16 values
        # rounds once), then _rms_norm_kernel's arithmetic on s
        row = tl.program_id(0).to(tl.int64)
        n = tl.arange(0, BN)
        m = n < N
        w = tl.load(w_ptr + n, mask=m, other=0.0).to(tl.float32)
        wait_prior(PDL)
        x = tl.load(x_ptr + row * stride_x + n, mask=m, other=0.0).to(tl.float32)
        d = tl.load(d_ptr + row * stride_d + n, mask=m, other=0.0).to(tl.float32)
        s = (x + d).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + n, s, mask=m)
        s = s.to(tl.float32)
        r = tl.rsqrt(tl.sum(s * s, 0) / N + eps)
        y = (s * r).to(sum_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_o + n, (w * y).to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _norm_codes_kernel(x_ptr, d_ptr, w_ptr, out_ptr, sum_ptr, a_ptr, slot_ptr, h_ptr, N, stride_as, stride_ar,
                           db_ptr, dh_ptr, stride_dbs, stride_dbr, eps, BN: tl.constexpr, HAS_DELTA: tl.constexpr,
                           R: tl.constexpr, BR: tl.constexpr, MEMBERS: tl.constexpr, STRIDE: tl.constexpr,
                           CPB: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr, DBR: tl.constexpr,
                           DP: tl.constexpr, DSP: tl.constexpr, PDL: tl.constexpr, DL_EARLY: tl.constexpr):
        """One row: program 0 is _rms_norm_kernel (HAS_DELTA: _add_rms_norm_kernel); program p > 0 computes the
        same normed row and, from it, CPB of the adapter's codes: code c = (p - 1) * CPB + i is member c // BR's
        rank row c % BR, h[c] = normed . A[slot, member * STRIDE + rank row] in fp32 (rows past R give 0). Its A
        rows are read before the wait: they never depend on the kernel before.

        DL (with HAS_DELTA): delta is a projection's output still without its adapter delta, whose codes are DP
        partial sums dh [DP, DBR] (gemv's codes_out): every program adds codes @ B[slot, :DR] to it (rounded to
        delta's dtype, as a GEMV output would be) before the residual add. DL_EARLY: B's [DR, N] tile is read before
        the wait, in registers (with enough warps), not row by row after it."""
        p = tl.program_id(0)
        n = tl.arange(0, BN)
        m = n < N
        w = tl.load(w_ptr + n, mask=m, other=0.0).to(tl.float32)
        s = tl.load(slot_ptr).to(tl.int64)
        has = s >= 0  # a token with no adapter: no delta (its codes, of slot 0, go unused)
        s = tl.maximum(s, 0)
        if MEMBERS > 0:
            c = (tl.maximum(p, 1) - 1) * CPB + tl.arange(0, CPB)
            member = c // BR
            r = c % BR
            cm = (member < MEMBERS) & (r < R) & (p > 0)
            a = tl.load(a_ptr + s * stride_as + (member * STRIDE + r).to(tl.int64)[:, None] * stride_ar + n[None, :],
                        mask=cm[:, None] & m[None, :], other=0.0)
        if DL and DL_EARLY:
            rb = tl.arange(0, DBR)
            b_all = tl.load(db_ptr + s * stride_dbs + rb[:, None] * stride_dbr + n[None, :],
                            mask=((rb < DR)[:, None] & m[None, :]) & has, other=0.0)
        wait_prior(PDL)
        x = tl.load(x_ptr + n, mask=m, other=0.0).to(tl.float32)
        if HAS_DELTA:
            d = tl.load(d_ptr + n, mask=m, other=0.0).to(tl.float32)
            if DL:
                j = tl.arange(0, DSP)
                rr = tl.arange(0, DBR)
                dcodes = tl.sum(tl.load(dh_ptr + j[:, None] * DBR + rr[None, :], mask=(j < DP)[:, None], other=0.0), 0)
                if DL_EARLY:
                    d += tl.sum(b_all.to(tl.float32) * tl.where(rr < DR, dcodes, 0.0)[:, None], 0)
                else:
                    for i in tl.static_range(DR):  # one rank row of B at a time: [BN] each, not [DR, BN] at once
                        code = tl.sum(tl.where(rr == i, dcodes, 0.0), 0)
                        d += code * tl.load(db_ptr + s * stride_dbs + i * stride_dbr + n, mask=m & has,
                                            other=0.0).to(tl.float32)
                d = d.to(d_ptr.dtype.element_ty).to(tl.float32)
            x = (x + d).to(sum_ptr.dtype.element_ty)
            if p == 0:
                tl.store(sum_ptr + n, x, mask=m)
            x = x.to(tl.float32)
            rs = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
            y = (w * (x * rs).to(sum_ptr.dtype.element_ty).to(tl.float32)).to(out_ptr.dtype.element_ty)
        else:
            rs = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
            y = (w * (x * rs).to(x_ptr.dtype.element_ty).to(tl.float32)).to(out_ptr.dtype.element_ty)
        if p == 0:
            tl.store(out_ptr + n, y, mask=m)
        elif MEMBERS > 0:
            h = tl.sum(a.to(tl.float32) * y.to(tl.float32)[None, :], 1)
            tl.store(h_ptr + c, h, mask=member < MEMBERS)

    @triton.jit
    def _rms_norm_bwd_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, N, stride_x, stride_dy, stride_dx, eps,
                             BN: tl.constexpr):
        # dx of y = w * x * r, r = rsqrt(mean(x^2) + eps), for a frozen w: with g = dy * w,
        # dx = r * g - x * r^3 * mean(g * x); r recomputed from x (the cast of x * r to x's dtype taken as identity)
        row = tl.program_id(0).to(tl.int64)
        n = tl.arange(0, BN)
        m = n < N
        x = tl.load(x_ptr + row * stride_x + n, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + n, mask=m, other=0.0).to(tl.float32)
        g = tl.load(dy_ptr + row * stride_dy + n, mask=m, other=0.0).to(tl.float32) * w
        r = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
        dx = r * g - x * (r * r * r) * (tl.sum(g * x, 0) / N)
        tl.store(dx_ptr + row * stride_dx + n, dx.to(dx_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, stride_xt, stride_xh, stride_c, stride_ot, stride_oh,
                       HALF: tl.constexpr, BH: tl.constexpr, SIGN: tl.constexpr):
        # SIGN -1 rotates the other way: with cos and sin halves repeated, the transpose of the rotation (backward)
        t = tl.program_id(0)
        h = tl.arange(0, BH)
        d = tl.arange(0, HALF)
        hm = (h < H)[:, None]
        src = x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :]
        x1 = tl.load(src, mask=hm, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=hm, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + t * stride_c + d).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + t * stride_c + HALF + d).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + t * stride_c + d).to(tl.float32)[None, :] * SIGN
        s2 = tl.load(sin_ptr + t * stride_c + HALF + d).to(tl.float32)[None, :] * SIGN
        dst = out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :]
        dt = out_ptr.dtype.element_ty
        tl.store(dst, (x1 * c1 - x2 * s1).to(dt), mask=hm)
        tl.store(dst + HALF, (x2 * c2 + x1 * s2).to(dt), mask=hm)

    @triton.jit
    def _gate_up_block(gu_ptr, size, stride_gu, BLOCK: tl.constexpr):
        # this program's row and BLOCK columns of gate (columns [0, size) of gate_up) and of up ([size, 2 * size))
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = col < size
        src = gu_ptr + row * stride_gu + col
        g = tl.load(src, mask=m, other=0.0).to(tl.float32)
        u = tl.load(src + size, mask=m, other=0.0).to(tl.float32)
        return row, col, m, g, u

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, size, stride_gu, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_prior(PDL)
        row, col, m, g, u = _gate_up_block(gu_ptr, size, stride_gu, BLOCK)
        tl.store(out_ptr + row * stride_o + col, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _silu_mul_bwd_kernel(gu_ptr, dy_ptr, dgu_ptr, size, stride_gu, stride_dy, stride_dgu, BLOCK: tl.constexpr):
        # y = g * s * u with s = sigmoid(g): dgate = dy * u * s * (1 + g * (1 - s)), dup = dy * g * s
        row, col, m, g, u = _gate_up_block(gu_ptr, size, stride_gu, BLOCK)
        dy = tl.load(dy_ptr + row * stride_dy + col, mask=m, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        dst = dgu_ptr + row * stride_dgu + col
        dt = dgu_ptr.dtype.element_ty
        tl.store(dst, (dy * u * s * (1.0 + g * (1.0 - s))).to(dt), mask=m)
        tl.store(dst + size, (dy * g * s).to(dt), mask=m)


def _rows(x):
    """x [..., N] as [rows, N] with the last dim contiguous (a view where it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x, weight, eps, codes=None):
    """x [..., N] -> same shape and dtype; weight [N]. codes: one row with an adapter's codes (_norm_codes)."""
    if codes is not None:
        return _norm_codes(x, None, weight, eps, codes)
    shape = x.shape
    x2 = _rows(x)
    out = torch.empty(x2.shape, device=x.device, dtype=torch.promote_types(weight.dtype, x.dtype))
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, shape[-1], x2.stride(0), out.stride(0), eps,
                                     BN=triton.next_power_of_2(shape[-1]), **pdl(x.device))
    return out.view(shape)


def add_rms_norm(x, delta, weight, eps, codes=None, delta_lora=None):
    """The residual add and the RMSNorm after it in one launch: x, delta [..., N] (rows may be wider) ->
    (normed, summed), summed = x + delta in their promoted dtype, rounded once as torch's add rounds it, and
    normed = rms_norm(summed, weight, eps) by rms_norm's arithmetic: the decoder's `x = x + h; norm(x)` without the
    add's own kernel and its round trip through memory. For passes without autograd. (Under TRITON_INTERPRET=1 a
    bf16 sum may sit one ulp towards zero: the interpreter truncates fp32 -> bf16 casts.)"""
    if codes is not None or delta_lora is not None:
        return _norm_codes(x, delta, weight, eps, codes, delta_lora)
    shape = x.shape
    assert delta.shape == shape, (delta.shape, shape)
    x2, d2 = _rows(x), _rows(delta)
    dtype = torch.promote_types(x.dtype, delta.dtype)
    summed = torch.empty(x2.shape, device=x.device, dtype=dtype)
    out = torch.empty(x2.shape, device=x.device, dtype=torch.promote_types(weight.dtype, dtype))
    _add_rms_norm_kernel[(x2.shape[0],)](x2, d2, weight, out, summed, shape[-1], x2.stride(0), d2.stride(0),
                                         out.stride(0), summed.stride(0), eps, BN=triton.next_power_of_2(shape[-1]),
                                         **pdl(x.device))
    return out.view(shape), summed.view(shape)


# codes a program of _norm_codes_kernel computes, and its warps (knobs for bench/profile_offline.py's A/B)
CODES_PER_PROGRAM = 4
CODES_WARPS = 8
# with a deferred delta (delta_lora): B's whole tile read before the wait (True), or row by row after it; the warps
# of such a launch (knobs for bench/profile_adapter_step.py's A/B; H200, 7B shapes, batch 1: the norm that adds
# down_proj's delta and writes q/k/v's codes takes ~5.9 us a layer of the step reading B row by row, ~3.8 with
# the tile read early; 16 warps changed nothing)
DELTA_EARLY = True
DELTA_WARPS = 8


def _norm_codes(x, delta, weight, eps, codes, delta_lora=None):
    """rms_norm / add_rms_norm of ONE row with an adapter's codes for the projections that take the normed row, in
    the same launch (a batch-1 decode step then needs no lora_shrink launch between the norm and the GEMV that adds
    the delta: dark.kernels.gemv's `lora`). codes: {"A": factors [slots, rows, N] (unit stride along N), "slot": a
    1-element integer device tensor (-1: none; the codes are then those of slot 0, and unused), "rank",
    "members", "stride": the rows between members' first rank rows, "out": [1, 1, members, BR] fp32, filled
    with member m's rank row r at [0, 0, m, r] (zero for r >= rank): lora_shrink's layout with one split}.
    Sets codes["written"] = True.

    delta_lora (add_rms_norm only; codes may be None): delta is a projection's output without its adapter's
    delta, which is added here first: {"out": its codes [1, parts, 1, BR] (partial sums: gemv's codes_out), "B":
    [slots, rows, N], "slot", "rank"}. Returns what rms_norm / add_rms_norm return."""
    N = x.shape[-1]
    assert x.numel() == N and (delta is None or delta.shape == x.shape), "codes with the norm: one row only"
    assert delta_lora is None or delta is not None, "an adapter's delta needs the residual add"
    x2 = _rows(x)
    d2 = _rows(delta) if delta is not None else x2
    dtype = torch.promote_types(x.dtype, delta.dtype) if delta is not None else x.dtype
    summed = torch.empty(x2.shape, device=x.device, dtype=dtype) if delta is not None else x2
    out = torch.empty(x2.shape, device=x.device, dtype=torch.promote_types(weight.dtype, dtype))
    if codes is not None:
        A, h = codes["A"], codes["out"]
        members, br = h.shape[2], h.shape[3]
        assert A.stride(-1) == 1 and A.shape[-1] == N and h.is_contiguous() and members == codes["members"]
        programs = triton.cdiv(members * br, CODES_PER_PROGRAM)
        cargs = (A, codes["slot"], h, A.stride(0), A.stride(1))
        cconst = dict(R=codes["rank"], BR=br, MEMBERS=members, STRIDE=codes["stride"])
    else:
        programs, cargs, cconst = 0, (weight, delta_lora["slot"], None, 0, 0), dict(R=1, BR=16, MEMBERS=0, STRIDE=0)
    if delta_lora is not None:
        B, dh = delta_lora["B"], delta_lora["out"]
        assert B.stride(-1) == 1 and B.shape[-1] == N and dh.is_contiguous() and dh.shape[2] == 1
        if codes is not None:  # one token, one slot tensor (an equality test would wait for the device)
            assert delta_lora["slot"] is codes["slot"], "the codes and the delta of one token read one slot tensor"
        dargs = (B, dh, B.stride(0), B.stride(1))
        dconst = dict(DL=True, DR=delta_lora["rank"], DBR=dh.shape[3], DP=dh.shape[1],
                      DSP=triton.next_power_of_2(dh.shape[1]))
    else:
        dargs, dconst = (None, None, 0, 0), dict(DL=False, DR=1, DBR=16, DP=1, DSP=1)
    a, slot, h, stride_as, stride_ar = cargs
    # B's tile in registers only while it is as small as measured (rank 16 at 7B widths: 16 x 4096 values); a
    # larger rank reads it row by row after the wait rather than spill
    early = DELTA_EARLY and delta_lora is not None and dconst["DBR"] * triton.next_power_of_2(N) <= 16 * 4096
    _norm_codes_kernel[(1 + programs,)](x2, d2, weight, out, summed, a, slot, h, N, stride_as, stride_ar, *dargs, eps,
                                        BN=triton.next_power_of_2(N), HAS_DELTA=delta is not None, **cconst,
                                        CPB=CODES_PER_PROGRAM, **dconst, DL_EARLY=early,
                                        num_warps=DELTA_WARPS if delta_lora is not None else CODES_WARPS,
                                        **pdl(x.device))
    if codes is not None:
        codes["written"] = True
    if delta is None:
        return out.view(x.shape)
    return out.view(x.shape), summed.view(x.shape)


def _rotary_into(x, cos, sin, out, sign):
    """out [T, heads, D] (last dim contiguous, any other strides) = x rotated by (cos, sign * sin)."""
    T, H, D = x.shape
    if x.numel() == 0:  # nothing to rotate (an empty tensor's strides, e.g. an expanded gradient's 0, are any)
        return out
    assert x.stride(2) == 1 and out.stride(2) == 1 and cos.stride(1) == 1 and cos.stride() == sin.stride()
    _rotary_kernel[(T,)](x, cos, sin, out, H, x.stride(0), x.stride(1), cos.stride(0), out.stride(0), out.stride(1),
                         HALF=D // 2, BH=triton.next_power_of_2(H), SIGN=sign)
    return out


def rotary(x, cos, sin):
    """x [T, heads, D] (last dim contiguous) -> a new rotated tensor; cos, sin [T, D]."""
    return _rotary_into(x, cos, sin, torch.empty(x.shape, device=x.device, dtype=x.dtype), 1.0)


def silu_mul(gate_up, size, block=1024, inplace: bool = False):
    """gate_up [..., 2 * size] (gate, then up) -> silu(gate) * up [..., size], in fp32 then cast to its dtype.

    inplace (a 2-D gate_up with its rows contiguous, that nothing reads again): the result is written over the
    gate half and returned as a view of it (row stride 2 * size), so a large batch holds [T, 2 * size], not that
    and [T, size] beside it: each program reads its gate and up block before it writes that gate block."""
    shape = gate_up.shape
    assert shape[-1] == 2 * size
    gu = _rows(gate_up)
    if inplace and gate_up.dim() == 2 and gu.data_ptr() == gate_up.data_ptr():
        out = gu[:, :size]
    else:
        out = torch.empty(gu.shape[0], size, device=gate_up.device, dtype=gate_up.dtype)
    _silu_mul_kernel[(gu.shape[0], triton.cdiv(size, block))](gu, out, size, gu.stride(0), out.stride(0),
                                                              BLOCK=block, **pdl(gu.device))
    return out if out.dim() == len(shape) else out.view(*shape[:-1], size)


# --- training: autograd Functions, gradients for the activations only (the base weights are frozen) ---------------


class _RMSNormTrain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.eps = eps
        ctx.save_for_backward(_rows(x), weight)  # x, not the output: backward recomputes the row's rsqrt
        return rms_norm(x, weight, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x2, weight = ctx.saved_tensors
        return rms_norm_backward(x2, weight, dy, ctx.eps), None, None


def rms_norm_backward(x, weight, dy, eps):
    """The gradient of rms_norm(x, weight, eps) for x, given the output's dy (weight frozen): one launch."""
    x2, dy2 = _rows(x), _rows(dy)
    dx = torch.empty(x2.shape, device=x2.device, dtype=x2.dtype)
    _rms_norm_bwd_kernel[(x2.shape[0],)](x2, weight, dy2, dx, x2.shape[1], x2.stride(0), dy2.stride(0),
                                         dx.stride(0), eps, BN=triton.next_power_of_2(x2.shape[1]))
    return dx.view(dy.shape)


def rms_norm_train(x, weight, eps):
    """rms_norm with a backward for x (one launch each way); weight is frozen: it gets no gradient."""
    assert not weight.requires_grad, "rms_norm_train gives no gradient for the weight"
    return _RMSNormTrain.apply(x, weight, eps)


class _RotaryTrain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rotary(x, cos, sin)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        dy = dy if dy.stride(2) == 1 else dy.contiguous()
        return _rotary_into(dy, cos, sin, torch.empty(dy.shape, device=dy.device, dtype=dy.dtype), -1.0), None, None


def rotary_train(x, cos, sin):
    """rotary with a backward for x: the opposite rotation (sin negated in the kernel), one launch each way.
    x [T, heads, D] (last dim contiguous, other strides any); cos, sin [T, D] with their halves repeated (as
    dark.models.decoder.Rotary makes them), which get no gradient."""
    return _RotaryTrain.apply(x, cos, sin)


def _heads(y, start, n, d):
    """Heads [start, start + n) of a fused projection output y [T, width] (last dim contiguous) as a [T, n, d] view."""
    return y[:, start * d:(start + n) * d].view(y.shape[0], n, d)


class _QKVRotaryTrain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, nh, nkv, d, cos, sin):
        ctx.heads = (nh, nkv, d)
        ctx.save_for_backward(cos, sin)
        ctx.set_materialize_grads(False)  # an unused output's gradient comes as None, not as a tensor of zeros
        return qkv_rotary_split(y, nh, nkv, d, cos, sin)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        return qkv_rotary_backward(dq, dk, dv, cos, sin, *ctx.heads), None, None, None, None, None


def qkv_rotary_split(y, nh, nkv, d, cos, sin):
    """qkv_rotary_train's values without autograd: (q rotated, k rotated, v), each a new contiguous tensor."""
    assert y.dim() == 2 and y.shape[1] == (nh + 2 * nkv) * d
    y = y if y.stride(1) == 1 else y.contiguous()
    t = y.shape[0]
    q = _rotary_into(_heads(y, 0, nh, d), cos, sin, y.new_empty(t, nh, d), 1.0)
    k = _rotary_into(_heads(y, nh, nkv, d), cos, sin, y.new_empty(t, nkv, d), 1.0)
    v = _heads(y, nh + nkv, nkv, d).clone(memory_format=torch.contiguous_format)  # a copy, never a view of y
    return q, k, v


def qkv_rotary_backward(dq, dk, dv, cos, sin, nh, nkv, d):
    """The gradient of qkv_rotary_split for its y, given the gradients of q, k and v (None: unused): one [T, width]
    tensor, each gradient written straight into its columns (q and k rotated back, v as it is)."""
    like = next(g for g in (dq, dk, dv) if g is not None)
    dy = torch.empty(like.shape[0], (nh + 2 * nkv) * d, device=like.device, dtype=like.dtype)
    for grad, start, n in ((dq, 0, nh), (dk, nh, nkv)):
        dst = _heads(dy, start, n, d)
        if grad is None:
            dst.zero_()
        else:
            _rotary_into(grad if grad.stride(2) == 1 else grad.contiguous(), cos, sin, dst, -1.0)
    dst = _heads(dy, nh + nkv, nkv, d)
    if dv is None:
        dst.zero_()
    else:
        dst.copy_(dv)
    return dy


def qkv_rotary_train(y, nh, nkv, d, cos, sin):
    """A fused q/k/v projection output y [T, (nh + 2 * nkv) * d] (last dim contiguous, rows may be wider) ->
    (q [T, nh, d] rotated, k [T, nkv, d] rotated, v [T, nkv, d]), each a new contiguous tensor: split, reshape and
    rotary in 3 launches, and a backward that writes one gradient for y (3 launches) instead of adding three."""
    return _QKVRotaryTrain.apply(y, nh, nkv, d, cos, sin)


class _SiluMulTrain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, size, block, reuse):
        ctx.size, ctx.block, ctx.reuse = size, block, reuse
        ctx.save_for_backward(gate_up)
        return silu_mul(gate_up, size, block)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        gate_up, = ctx.saved_tensors
        return silu_mul_backward(gate_up, dy, ctx.size, ctx.block, ctx.reuse), None, None, None


def silu_mul_backward(gate_up, dy, size, block=1024, reuse: bool = False):
    """The gradient of silu_mul(gate_up, size) for gate_up, given the output's dy: one [..., 2 * size] tensor
    (dgate, dup) in one launch. reuse: written over gate_up (each program reads its gate, up and dy blocks before
    it writes those places), so a layer's backward holds one [T, 2 * size] tensor here, not two."""
    gu, dy2 = _rows(gate_up), _rows(dy)
    dgu = gu if reuse else torch.empty(gu.shape, device=gu.device, dtype=gu.dtype)
    _silu_mul_bwd_kernel[(gu.shape[0], triton.cdiv(size, block))](gu, dy2, dgu, size, gu.stride(0),
                                                                  dy2.stride(0), dgu.stride(0), BLOCK=block)
    return dgu.view(gate_up.shape)


def silu_mul_train(gate_up, size, block=1024, reuse_input: bool = False):
    """silu_mul with a backward for gate_up: one [..., 2 * size] gradient (dgate, dup) in one launch.
    reuse_input (gate_up a temporary that nothing else reads, e.g. a projection's output inside the model): the
    backward writes the gradient over gate_up instead of into a new tensor."""
    return _SiluMulTrain.apply(gate_up, size, block, reuse_input)
