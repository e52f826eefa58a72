"""RMSNorm and rotary embedding, one launch each instead of the ~7 and ~10 small elementwise kernels of the
plain-torch modules (which dominate a CUDA-graph decode step's launch count). Inference only: no backward.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def rms_norm_reference(x, weight, eps):
    """As dark.models.decoder.RMSNorm: normalise in fp32, cast back, then scale by the weight."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotary_reference(x, cos, sin):
    """x [T, heads, D]; cos, sin [T, D] (halves repeated): x * cos + rotate_half(x) * sin, in fp32."""
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos.float()[:, None, :] + rotated * sin.float()[:, None, :]).to(x.dtype)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, stride_x, stride_o, eps, BN: tl.constexpr):
        row = tl.program_id(0)
        n = tl.arange(0, BN)
        m = n < N
        x = tl.load(x_ptr + row * stride_x + n, mask=m, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
        y = (x * r).to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + n, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + n, (w * y).to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, stride_xt, stride_xh, stride_c, stride_ot, stride_oh,
                       HALF: tl.constexpr, BH: tl.constexpr):
        t = tl.program_id(0)
        h = tl.arange(0, BH)
        d = tl.arange(0, HALF)
        hm = (h < H)[:, None]
        src = x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :]
        x1 = tl.load(src, mask=hm, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=hm, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + t * stride_c + d).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + t * stride_c + HALF + d).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + t * stride_c + d).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + t * stride_c + HALF + d).to(tl.float32)[None, :]
        dst = out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :]
        dt = out_ptr.dtype.element_ty
        tl.store(dst, (x1 * c1 - x2 * s1).to(dt), mask=hm)
        tl.store(dst + HALF, (x2 * c2 + x1 * s2).to(dt), mask=hm)


def rms_norm(x, weight, eps):
    """x [..., N] -> same shape and dtype; weight [N]."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, device=x.device, dtype=torch.promote_types(weight.dtype, x.dtype))
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, shape[-1], x2.stride(0), out.stride(0), eps,
                                     BN=triton.next_power_of_2(shape[-1]))
    return out.view(shape)


def rotary(x, cos, sin):
    """x [T, heads, D] (last dim contiguous) -> a new rotated tensor; cos, sin [T, D]."""
    T, H, D = x.shape
    assert x.stride(2) == 1 and cos.stride(1) == 1 and cos.stride() == sin.stride()
    out = torch.empty(T, H, D, device=x.device, dtype=x.dtype)
    _rotary_kernel[(T,)](x, cos, sin, out, H, x.stride(0), x.stride(1), cos.stride(0), out.stride(0), out.stride(1),
                         HALF=D // 2, BH=triton.next_power_of_2(H))
    return out
