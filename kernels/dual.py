"""One read of a weight for two products: a decode step's y [M, N] = x [M, K] @ W[N, K]^T, and a LoRA training
step's data gradient through the same frozen weight, dx [T, K] = g [T, N] @ W.

Why: decode and training beside each other as separate kernels share the memory system, and no split of the GPU
gives decode within 1.3x of its solo step and training 70% of its solo rate (bench/RESULTS.md, 2026-12-03 and
2026-12-06). A decode step's products read every weight once and use a few percent of the tensor cores, so a
training step's products could ride in that read instead of reading the weight again. Its forward rows ride as
extra rows of x (bench/probe_piggyback.py: 8 + 192 rows within 1.16x of the 8-row step). Its backward's data
gradient needs W, not W^T: another product of the same tiles, which this kernel does while they are on chip.

Each program takes BK columns of K and a range of BN-row chunks of W (a split of N, so that every SM has programs
even where K is narrow). It keeps its dx tile [T, BK] in registers over its chunks, so dx's sum over N crosses
programs only once per split (fp32 atomic adds at the end), while y's sum over K crosses programs at every chunk
(fp32 atomic adds of [M, BN]). plan() sizes the two so that the partial sums stay a small part of the weight's
bytes. y and dx come back in fp32, summed in no fixed order (atomics), so the last bits may differ between calls.
dual_reference is the plain-torch definition.

A building block measured by bench/probe_piggyback.py (the `dual` forms); the engine does not call it yet.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

from . import launch_sms, pdl, tma_descriptor

BN, BK, STAGES, WARPS = 128, 128, 3, 8
PROGRAMS_PER_SM = 2
MAX_ROWS = 128  # rows of x and of g a call takes (each padded to a power of two of at least 16)
MAX_PADDED = 192  # of both together, padded: 128 and 128 spill past the 255 registers a thread has
SHARED = 216 * 1024  # of the 227 KiB of shared memory an H100/H200 program may take, what the staged tiles may use


def dual_reference(x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return F.linear(x, weight), g @ weight


def plan(n: int, k: int, sms: int) -> tuple[int, int]:
    """(BN chunks a program takes, programs along N) for an [n, k] weight on a device of `sms` SMs."""
    along_k = triton.cdiv(k, BK)
    tiles = triton.cdiv(n, BN)
    splits = max(1, min(tiles, round(PROGRAMS_PER_SM * sms / along_k)))
    per = triton.cdiv(tiles, splits)
    return per, triton.cdiv(tiles, per)


def stages(rows_x: int, rows_g: int) -> int:
    """Pipeline stages for padded row counts: STAGES, fewer where the staged tiles (W's and g's each stage, and x)
    would not fit in an SM's shared memory (128 rows of each at 3 stages take 240 KiB)."""
    per = (BN * BK + rows_g * BN) * 2
    s = STAGES
    while s > 1 and s * per + rows_x * BK * 2 > SHARED:
        s -= 1
    return s


def _rows(n: int) -> int:
    return max(16, triton.next_power_of_2(max(n, 1)))


def dual(x: torch.Tensor | None, g: torch.Tensor | None, weight: torch.Tensor, y: torch.Tensor | None = None,
         dx: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """x [M, K] or None, g [T, N] or None, weight [N, K] (M, T <= MAX_ROWS) -> (x @ W^T [M, N], g @ W [T, K]), fp32.

    y and dx, when given, are fp32 buffers of those shapes that the products are added into (zero them for the
    products alone); else zeroed ones are made."""
    N, K = weight.shape
    assert weight.stride(1) == 1 and (weight.stride(0) * weight.element_size()) % 16 == 0, \
        "dual: the weight's rows contiguous and 16-byte aligned (what a TMA descriptor needs)"
    assert weight.dtype in (torch.bfloat16, torch.float16) and N % 8 == 0, "dual: a 16-bit weight, N a multiple of 8"
    assert x is not None or g is not None, "dual: x, g or both"
    M = 0 if x is None else x.shape[0]
    T = 0 if g is None else g.shape[0]
    assert M <= MAX_ROWS and T <= MAX_ROWS, f"dual: at most {MAX_ROWS} rows of x and of g, not {M} and {T}"
    assert (M == 0 or T == 0) or _rows(M) + _rows(T) <= MAX_PADDED, \
        f"dual: {M} rows of x and {T} of g pad to more than {MAX_PADDED} together"
    assert x is None or (x.shape[1] == K and x.dtype == weight.dtype), "dual: x [M, K] in the weight's dtype"
    assert g is None or (g.shape[1] == N and g.dtype == weight.dtype), "dual: g [T, N] in the weight's dtype"
    dev = weight.device
    if x is not None:
        x = x if x.stride(1) == 1 else x.contiguous()
        y = torch.zeros(M, N, device=dev, dtype=torch.float32) if y is None else y
        assert y.shape == (M, N) and y.dtype == torch.float32 and y.stride(1) == 1, "dual: y an fp32 buffer [M, N]"
    if g is not None:
        g = g if g.stride(1) == 1 and g.stride(0) % 8 == 0 else g.contiguous()
        dx = torch.zeros(T, K, device=dev, dtype=torch.float32) if dx is None else dx
        assert dx.shape == (T, K) and dx.dtype == torch.float32 and dx.stride(1) == 1, \
            "dual: dx an fp32 buffer [T, K]"
    per, splits = plan(N, K, launch_sms(dev))
    r, tb = _rows(M), _rows(T)
    w_desc = tma_descriptor(weight, [BN, BK])
    g_desc = w_desc if g is None else tma_descriptor(g, [tb, BN], cached=False)  # g is new each step
    _dual_kernel[(triton.cdiv(K, BK), splits)](
        w_desc, weight if x is None else x, g_desc, weight if x is None else y, weight if g is None else dx,
        M, T, N, K, 0 if x is None else x.stride(0), 0 if x is None else y.stride(0),
        0 if g is None else dx.stride(0),
        CHUNKS=per, BN=BN, BK=BK, R=r, TB=tb, HAS_X=x is not None, HAS_G=g is not None,
        STAGES=stages(r, tb if g is not None else 0), UPCAST=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=WARPS, **pdl(dev))
    return (y if x is not None else None), (dx if g is not None else None)


if triton is not None:
    from . import wait_prior

    @triton.jit
    def _dual_kernel(w_desc, x_ptr, g_desc, y_ptr, dx_ptr, M, T, N, K, stride_x, stride_y, stride_dx,
                     CHUNKS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, R: tl.constexpr, TB: tl.constexpr,
                     HAS_X: tl.constexpr, HAS_G: tl.constexpr, STAGES: tl.constexpr, UPCAST: tl.constexpr,
                     PDL: tl.constexpr):
        wait_prior(PDL)  # x, g and the sums' buffers may be the kernel before's
        kb = tl.program_id(0)
        part = tl.program_id(1)
        offs_k = kb * BK + tl.arange(0, BK)
        mask_k = offs_k < K
        offs_r = tl.arange(0, R)
        offs_t = tl.arange(0, TB)
        if HAS_X:
            x = tl.load(x_ptr + offs_r[:, None] * stride_x + offs_k[None, :],
                        mask=(offs_r[:, None] < M) & mask_k[None, :], other=0.0)
            if UPCAST:  # the CPU interpreter's 16-bit dot is wrong: there the same steps run in fp32
                x = x.to(tl.float32)
        dx = tl.zeros([TB, BK], tl.float32)
        n_lo = part * (CHUNKS * BN)
        for c in tl.range(0, CHUNKS, num_stages=STAGES):
            offs_n = n_lo + c * BN + tl.arange(0, BN)
            mask_n = offs_n < N
            w = w_desc.load([n_lo + c * BN, kb * BK])  # [BN, BK]; past N or K the copy engine fills zeros
            if UPCAST:
                w = w.to(tl.float32)
            if HAS_X:
                if UPCAST:
                    yp = tl.dot(w, tl.trans(x), input_precision="ieee")
                else:
                    yp = tl.dot(w, tl.trans(x))
                tl.atomic_add(y_ptr + offs_r[None, :] * stride_y + offs_n[:, None], yp,
                              mask=(offs_r[None, :] < M) & mask_n[:, None], sem="relaxed")
            if HAS_G:
                gt = g_desc.load([0, n_lo + c * BN])  # [TB, BN]; rows past T are zeros
                if UPCAST:
                    dx = tl.dot(gt.to(tl.float32), w, dx, input_precision="ieee")
                else:
                    dx = tl.dot(gt, w, dx)
        if HAS_G:
            tl.atomic_add(dx_ptr + offs_t[:, None] * stride_dx + offs_k[None, :], dx,
                          mask=(offs_t[:, None] < T) & mask_k[None, :], sem="relaxed")
