"""Multi-adapter LoRA for a batch where every token has its own adapter slot (BGMV style).

A [slots, R, in] and B [slots, R, out] (B pre-scaled) are the engine's stacked factors; token t uses slot
s_t, or none when s_t = -1. `lora_shrink` computes h[t] = A[s_t] @ x[t] in fp32, split along `in` so a batch
of one still spreads over the chip (each range writes its own partial sum: no atomics, no zero fill);
`lora_expand` sums those partials and adds B[s_t]^T h[t] into y in place. Two launches per projection,
whatever the mix of adapters; inside a CUDA graph the slot tensor is the only input that changes. Each token
reads its own adapter's factors, which suits decode (few tokens); long prefills keep the dense torch math.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def lora_reference(x, y, A, B, token_slots, rank: int):
    """y + per-token LoRA delta, in fp32 then cast: x [T, in], y [T, out], A [S, R, in], B [S, R, out]."""
    out = y.float().clone()
    for t in range(x.shape[0]):
        s = int(token_slots[t])
        if s >= 0:
            out[t] += (A[s, :rank].float() @ x[t].float()) @ B[s, :rank].float()
    return out.to(y.dtype)


if triton is not None:

    @triton.jit
    def _shrink_kernel(x_ptr, a_ptr, slot_ptr, h_ptr, K, stride_xt, stride_as, stride_ar,
                       R: tl.constexpr, BR: tl.constexpr, CHUNK: tl.constexpr, BK: tl.constexpr,
                       SPLITS: tl.constexpr):
        t = tl.program_id(0)
        sp = tl.program_id(1)
        s = tl.load(slot_ptr + t).to(tl.int64)
        valid = s >= 0
        s = tl.maximum(s, 0)
        r = tl.arange(0, BR)
        rm = (r < R) & valid
        acc = tl.zeros([BR], tl.float32)
        for i in range(0, CHUNK, BK):  # constant trip count; the tail is masked
            kk = sp * CHUNK + i + tl.arange(0, BK)
            km = kk < K
            x = tl.load(x_ptr + t * stride_xt + kk, mask=km & valid, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + s * stride_as + r[:, None] * stride_ar + kk[None, :], mask=rm[:, None] & km[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], 1)
        tl.store(h_ptr + (t * SPLITS + sp) * BR + r, acc)

    @triton.jit
    def _expand_kernel(h_ptr, b_ptr, slot_ptr, y_ptr, N, stride_bs, stride_br, stride_yt,
                       R: tl.constexpr, BR: tl.constexpr, SPLITS: tl.constexpr, SP: tl.constexpr,
                       BN: tl.constexpr):
        t = tl.program_id(0)
        nb = tl.program_id(1)
        s = tl.load(slot_ptr + t).to(tl.int64)
        valid = s >= 0
        s = tl.maximum(s, 0)
        r = tl.arange(0, BR)
        rm = (r < R) & valid
        sp = tl.arange(0, SP)
        h = tl.load(h_ptr + (t * SPLITS + sp[:, None]) * BR + r[None, :], mask=(sp < SPLITS)[:, None] & rm[None, :],
                    other=0.0)
        h = tl.sum(h, 0)
        n = nb * BN + tl.arange(0, BN)
        nm = (n < N) & valid
        b = tl.load(b_ptr + s * stride_bs + r[:, None] * stride_br + n[None, :], mask=rm[:, None] & nm[None, :],
                    other=0.0).to(tl.float32)
        delta = tl.sum(b * h[:, None], 0)
        y = tl.load(y_ptr + t * stride_yt + n, mask=nm, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * stride_yt + n, (y + delta).to(y_ptr.dtype.element_ty), mask=nm)


def lora_shrink(x, A, token_slots, rank: int, chunk: int = 512, block_k: int = 128):
    """x [T, in] -> partial codes [T, splits, BR] fp32 (sum over axis 1 is A[s_t, :rank] @ x[t])."""
    T, K = x.shape
    assert x.stride(1) == 1 and A.stride(2) == 1
    chunk = min(chunk, triton.next_power_of_2(K))
    block_k = min(block_k, chunk)
    splits = triton.cdiv(K, chunk)
    br = max(16, triton.next_power_of_2(rank))
    h = torch.empty(T, splits, br, device=x.device, dtype=torch.float32)
    _shrink_kernel[(T, splits)](x, A, token_slots, h, K, x.stride(0), A.stride(0), A.stride(1),
                                R=rank, BR=br, CHUNK=chunk, BK=block_k, SPLITS=splits)
    return h


def lora_expand(h, B, token_slots, y, rank: int, block_n: int = 256):
    """y [T, out] += B[s_t, :rank]^T @ sum(h[t]) for tokens with a slot; returns y."""
    T, N = y.shape
    splits, br = h.shape[1], h.shape[2]
    assert y.stride(1) == 1 and B.stride(2) == 1
    block_n = min(block_n, triton.next_power_of_2(N))
    _expand_kernel[(T, triton.cdiv(N, block_n))](h, B, token_slots, y, N, B.stride(0), B.stride(1), y.stride(0),
                                                 R=rank, BR=br, SPLITS=splits, SP=triton.next_power_of_2(splits),
                                                 BN=block_n)
    return y


def lora_apply(x, y, A, B, token_slots, rank: int):
    """y += each token's LoRA delta (in place): shrink then expand."""
    return lora_expand(lora_shrink(x, A, token_slots, rank), B, token_slots, y, rank)
