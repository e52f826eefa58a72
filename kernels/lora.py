"""Multi-adapter LoRA for a batch where every token has its own adapter slot (BGMV style).

A [slots, R, in] and B [slots, R, out] (B pre-scaled) are the engine's stacked factors; token t uses slot
s_t, or none when s_t = -1. `lora_shrink` computes h[t] = A[s_t] @ x[t] in fp32, split along `in` so a batch
of one still spreads over the chip (each range writes its own partial sum: no atomics, no zero fill);
`lora_expand` sums those partials and adds B[s_t]^T h[t] into y in place. Two launches per projection,
whatever the mix of adapters; inside a CUDA graph the slot tensor is the only input that changes. Each token
reads its own adapter's factors, which suits decode (few tokens); long prefills keep the dense torch math.

Groups: projections that share their input (q/k/v, gate/up) run as one GEMM whose output is their outputs
side by side. Their factors are stacked the same way: A [slots, members * stride, in] (member m's rows start
at m * stride) and B [slots, stride, out_0 + out_1 + ...] (member m's columns follow member m-1's). One shrink
computes every member's code, one expand adds each output column its own member's delta: two launches for
the group instead of two per member, and nothing stored for pairs of members that do not meet.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def lora_reference(x, y, A, B, token_slots, rank: int, splits=None, stride: int = 0):
    """y + per-token LoRA delta, in fp32 then cast: x [T, in], y [T, out], A [S, R, in], B [S, R, out].

    splits (a group): the out sizes of its members, whose factors sit as described in the module text."""
    out = y.float().clone()
    splits = splits or [y.shape[1]]
    for t in range(x.shape[0]):
        s = int(token_slots[t])
        if s < 0:
            continue
        col = 0
        for m, n in enumerate(splits):
            a = A[s, m * stride:m * stride + rank].float()
            out[t, col:col + n] += (a @ x[t].float()) @ B[s, :rank, col:col + n].float()
            col += n
    return out.to(y.dtype)


if triton is not None:

    @triton.jit
    def _shrink_kernel(x_ptr, a_ptr, slot_ptr, h_ptr, K, stride_xt, stride_as, stride_ar,
                       R: tl.constexpr, BR: tl.constexpr, CHUNK: tl.constexpr, BK: tl.constexpr,
                       SPLITS: tl.constexpr, MEMBERS: tl.constexpr, STRIDE: tl.constexpr):
        t = tl.program_id(0)
        sp = tl.program_id(1)
        s = tl.load(slot_ptr + t).to(tl.int64)
        valid = s >= 0
        s = tl.maximum(s, 0)
        r = tl.arange(0, BR)
        rm = (r < R) & valid
        for m in tl.static_range(MEMBERS):
            acc = tl.zeros([BR], tl.float32)
            for i in range(0, CHUNK, BK):  # constant trip count; the tail is masked
                kk = sp * CHUNK + i + tl.arange(0, BK)
                km = kk < K
                x = tl.load(x_ptr + t * stride_xt + kk, mask=km & valid, other=0.0).to(tl.float32)
                a = tl.load(a_ptr + s * stride_as + (m * STRIDE + r[:, None]) * stride_ar + kk[None, :],
                            mask=rm[:, None] & km[None, :], other=0.0).to(tl.float32)
                acc += tl.sum(a * x[None, :], 1)
            tl.store(h_ptr + ((t * SPLITS + sp) * MEMBERS + m) * BR + r, acc)

    @triton.jit
    def _expand_kernel(h_ptr, b_ptr, slot_ptr, y_ptr, N, N1, N2, stride_bs, stride_br, stride_yt,
                       R: tl.constexpr, BR: tl.constexpr, SPLITS: tl.constexpr, SP: tl.constexpr,
                       BN: tl.constexpr, MEMBERS: tl.constexpr):
        t = tl.program_id(0)
        nb = tl.program_id(1)
        s = tl.load(slot_ptr + t).to(tl.int64)
        valid = s >= 0
        s = tl.maximum(s, 0)
        r = tl.arange(0, BR)
        rm = (r < R) & valid
        sp = tl.arange(0, SP)
        n = nb * BN + tl.arange(0, BN)
        nm = (n < N) & valid
        b = tl.load(b_ptr + s * stride_bs + r[:, None] * stride_br + n[None, :], mask=rm[:, None] & nm[None, :],
                    other=0.0).to(tl.float32)
        member = (n >= N1).to(tl.int32) + (n >= N2).to(tl.int32)  # which member's output each column is
        delta = tl.zeros([BN], tl.float32)
        for m in tl.static_range(MEMBERS):
            h = tl.load(h_ptr + ((t * SPLITS + sp[:, None]) * MEMBERS + m) * BR + r[None, :],
                        mask=(sp < SPLITS)[:, None] & rm[None, :], other=0.0)
            h = tl.sum(h, 0)
            delta += tl.where(member == m, tl.sum(b * h[:, None], 0), 0.0)
        y = tl.load(y_ptr + t * stride_yt + n, mask=nm, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * stride_yt + n, (y + delta).to(y_ptr.dtype.element_ty), mask=nm)


def lora_shrink(x, A, token_slots, rank: int, chunk: int = 512, block_k: int = 128, members: int = 1,
                stride: int = 0):
    """x [T, in] -> partial codes [T, splits, members, BR] fp32; the sum over axis 1 of [:, :, m, :rank] is
    A[s_t, m * stride:m * stride + rank] @ x[t]."""
    T, K = x.shape
    assert x.stride(1) == 1 and A.stride(2) == 1
    chunk = min(chunk, triton.next_power_of_2(K))
    block_k = min(block_k, chunk)
    splits = triton.cdiv(K, chunk)
    br = max(16, triton.next_power_of_2(rank))
    h = torch.empty(T, splits, members, br, device=x.device, dtype=torch.float32)
    _shrink_kernel[(T, splits)](x, A, token_slots, h, K, x.stride(0), A.stride(0), A.stride(1),
                                R=rank, BR=br, CHUNK=chunk, BK=block_k, SPLITS=splits, MEMBERS=members,
                                STRIDE=stride)
    return h


def lora_expand(h, B, token_slots, y, rank: int, block_n: int = 256, splits=None):
    """y [T, out] += B[s_t, :rank]^T @ sum(h[t]) for tokens with a slot, each output column with the code of
    its member (splits: the members' out sizes; at most 3); returns y."""
    T, N = y.shape
    parts, members, br = h.shape[1], h.shape[2], h.shape[3]
    splits = splits or [N]
    assert y.stride(1) == 1 and B.stride(2) == 1 and len(splits) == members <= 3 and sum(splits) == N
    bounds = [sum(splits[:i + 1]) for i in range(members - 1)] + [N, N]
    block_n = min(block_n, triton.next_power_of_2(N))
    _expand_kernel[(T, triton.cdiv(N, block_n))](h, B, token_slots, y, N, bounds[0], bounds[1], B.stride(0),
                                                 B.stride(1), y.stride(0), R=rank, BR=br, SPLITS=parts,
                                                 SP=triton.next_power_of_2(parts), BN=block_n, MEMBERS=members)
    return y


def lora_apply(x, y, A, B, token_slots, rank: int, splits=None, stride: int = 0):
    """y += each token's LoRA delta (in place): shrink then expand (a group when splits names its members)."""
    members = len(splits) if splits else 1
    h = lora_shrink(x, A, token_slots, rank, members=members, stride=stride)
    return lora_expand(h, B, token_slots, y, rank, splits=splits)
