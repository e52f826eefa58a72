"""Multi-adapter LoRA for a batch where every token has its own adapter slot (SGMV style: one read per adapter).

A [slots, R, in] and B [slots, R, out] (B pre-scaled) are the engine's stacked factors; token t uses slot
s_t, or none when s_t = -1. `lora_segments` sorts the slots once per forward (`torch.sort`: no host sync, no
dynamic shape, so a CUDA graph keeps it): tokens of one adapter then sit side by side, a segment, and `order`
maps each sorted position back to its token. Both kernels run over sorted positions; the program at position
i works only where a block of BT = 16 tokens starts, that is at segment start + 16k (the -1 segment, which
sorts first, is skipped), and finds its segment's bounds by counting the sorted slots below and up to its own.
A segment of 40 tokens is three such blocks in three programs; a lone token is a block of one.

`lora_shrink` computes h[t] = A[s] @ x[t] in fp32 for a block's tokens with one `tl.dot` per K tile: the
block's x rows are gathered through `order`, the A tile is read once for the block (not once per token), and
the work is split along `in` so a batch of one still spreads over the chip (each range writes its own
partial sum at the token's own row of h: no atomics, no zero fill). `lora_expand` reads a B tile once per
block, sums the partials of the block's codes, multiplies them by the tile (`tl.dot`) and adds the result into
the tokens' rows of y in place. Two launches per projection, whatever the mix of adapters; inside a CUDA
graph the slot tensor is the only input that changes. A step of 64 tokens over 32 adapters reads each
adapter's factors about once, not 64 times; long prefills keep the dense torch math (dark.lora.slots).

The products stay fp32-exact: bf16 x and A go straight into the tensor cores with fp32 accumulation (their
products are exact in fp32); the fp32 codes meet a bf16/fp16 B as two half-precision parts (hi + lo), so the
code is not rounded to bf16; fp32 inputs use the "ieee" dot. Under TRITON_INTERPRET (whose bf16 dot is wrong)
the dots upcast to fp32.

Groups: projections that share their input (q/k/v, gate/up) run as one GEMM whose output is their outputs
side by side. Their factors are stacked the same way: A [slots, members * stride, in] (member m's rows start
at m * stride) and B [slots, stride, out_0 + out_1 + ...] (member m's columns follow member m-1's). One shrink
computes every member's code (one dot over all members' A rows), one expand adds each output column its own
member's delta (the B tile holds, for each column, only its member's rows): two launches for the group
instead of two per member, and nothing stored for pairs of members that do not meet.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK_T = 16  # tokens of one segment per program (tl.dot needs 16 rows at least; short blocks are masked)
SCAN = 128    # sorted slots read per step while a program looks for its segment's bounds


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


def lora_segments(token_slots):
    """(sorted slots, order): token order[i] has the i-th smallest slot. Run once per forward and passed to
    every projection's kernels; a batch of one needs no sort (order None: position i is token i)."""
    if token_slots.numel() <= 1:
        return token_slots, None
    return torch.sort(token_slots)


if triton is not None:

    @triton.jit
    def _block(sorted_ptr, order_ptr, T, BT: tl.constexpr, SCAN: tl.constexpr, NSCAN: tl.constexpr,
               SORTED: tl.constexpr):
        """The block of sorted positions this program owns: (its slot, whether it owns one, the tokens' rows
        [BT] and their mask). A block starts at its segment's start + BT k."""
        i = tl.program_id(0)
        s = tl.load(sorted_ptr + i).to(tl.int64)
        start = i * 0
        end = i * 0
        if s >= 0:  # the -1 segment does nothing: skip the scan
            for j in tl.static_range(NSCAN):  # NSCAN * SCAN >= T
                p = j * SCAN + tl.arange(0, SCAN)
                v = tl.load(sorted_ptr + p, mask=p < T, other=2147483647).to(tl.int64)
                start += tl.sum((v < s).to(tl.int32), 0)
                end += tl.sum((v <= s).to(tl.int32), 0)
        owns = (s >= 0) & ((i - start) % BT == 0)
        pos = i + tl.arange(0, BT)
        pm = pos < end
        if SORTED:
            tok = tl.load(order_ptr + pos, mask=pm, other=0).to(tl.int64)
        else:
            tok = pos.to(tl.int64)
        return tl.maximum(s, 0), owns, tok, pm

    @triton.jit
    def _shrink_kernel(x_ptr, a_ptr, sorted_ptr, order_ptr, h_ptr, T, K, stride_xt, stride_as, stride_ar,
                       R: tl.constexpr, BR: tl.constexpr, MB: tl.constexpr, CHUNK: tl.constexpr,
                       BK: tl.constexpr, SPLITS: tl.constexpr, MEMBERS: tl.constexpr, STRIDE: tl.constexpr,
                       BT: tl.constexpr, SCAN: tl.constexpr, NSCAN: tl.constexpr, SORTED: tl.constexpr,
                       UPCAST: tl.constexpr):
        sp = tl.program_id(1)
        s, owns, tok, pm = _block(sorted_ptr, order_ptr, T, BT, SCAN, NSCAN, SORTED)
        if owns:
            c = tl.arange(0, MB)  # code column: member c // BR, rank row c % BR
            m = c // BR
            r = c % BR
            cm = (m < MEMBERS) & (r < R)
            arow = (m * STRIDE + r).to(tl.int64)
            acc = tl.zeros([BT, MB], tl.float32)
            for k0 in range(0, CHUNK, BK):  # constant trip count; the tail is masked
                kk = sp * CHUNK + k0 + tl.arange(0, BK)
                km = kk < K
                x = tl.load(x_ptr + tok[:, None] * stride_xt + kk[None, :], mask=pm[:, None] & km[None, :],
                            other=0.0)
                a = tl.load(a_ptr + s * stride_as + arow[None, :] * stride_ar + kk[:, None],
                            mask=cm[None, :] & km[:, None], other=0.0)  # [BK, MB]: the tile, once per block
                if UPCAST or x.dtype == tl.float32:
                    acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(x, a.to(x.dtype), acc)
            tl.store(h_ptr + (tok[:, None] * SPLITS + sp) * (MEMBERS * BR) + c[None, :], acc,
                     mask=pm[:, None] & (c < MEMBERS * BR)[None, :])

    @triton.jit
    def _expand_kernel(h_ptr, b_ptr, sorted_ptr, order_ptr, y_ptr, T, N, N1, N2, stride_bs, stride_br,
                       stride_yt, R: tl.constexpr, BR: tl.constexpr, MB: tl.constexpr, SPLITS: tl.constexpr,
                       BN: tl.constexpr, MEMBERS: tl.constexpr, BT: tl.constexpr, SCAN: tl.constexpr,
                       NSCAN: tl.constexpr, SORTED: tl.constexpr, UPCAST: tl.constexpr):
        nb = tl.program_id(1)
        s, owns, tok, pm = _block(sorted_ptr, order_ptr, T, BT, SCAN, NSCAN, SORTED)
        if owns:
            n = nb * BN + tl.arange(0, BN)
            nm = n < N
            member = (n >= N1).to(tl.int32) + (n >= N2).to(tl.int32)  # which member's output each column is
            c = tl.arange(0, MB)
            m = c // BR
            r = c % BR
            # row c of the tile is B's rank row c % BR, kept only in the columns of member c // BR
            b = tl.load(b_ptr + s * stride_bs + r[:, None] * stride_br + n[None, :],
                        mask=(r < R)[:, None] & (m[:, None] == member[None, :]) & nm[None, :], other=0.0)
            hp = h_ptr + tok[:, None] * (SPLITS * MEMBERS * BR) + c[None, :]
            hm = pm[:, None] & (c < MEMBERS * BR)[None, :]
            h = tl.zeros([BT, MB], tl.float32)
            for sp in tl.static_range(SPLITS):  # unrolled: the partials' loads all in flight at once
                h += tl.load(hp + sp * (MEMBERS * BR), mask=hm, other=0.0)
            if UPCAST or b.dtype == tl.float32:
                d = tl.dot(h, b.to(tl.float32), input_precision="ieee")
            else:  # fp32 codes as hi + lo halves: the tensor cores, with the code not rounded to bf16
                hi = h.to(b.dtype)
                lo = (h - hi.to(tl.float32)).to(b.dtype)
                d = tl.dot(lo, b, tl.dot(hi, b))
            yp = y_ptr + tok[:, None] * stride_yt + n[None, :]
            ym = pm[:, None] & nm[None, :]
            y = tl.load(yp, mask=ym, other=0.0).to(tl.float32)
            tl.store(yp, (y + d).to(y_ptr.dtype.element_ty), mask=ym)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _segment_args(token_slots, segments):
    sorted_slots, order = segments if segments is not None else lora_segments(token_slots)
    if order is None:
        assert sorted_slots.numel() <= 1, "order None means a batch of at most one token"
        return sorted_slots, sorted_slots, False
    return sorted_slots, order, True


def lora_shrink(x, A, token_slots, rank: int, chunk: int = 512, block_k: int = 128, members: int = 1,
                stride: int = 0, segments=None):
    """x [T, in] -> partial codes [T, splits, members, BR] fp32; for a token with a slot, the sum over axis 1 of
    [:, :, m, :rank] is A[s_t, m * stride:m * stride + rank] @ x[t] (rows of tokens without one are left
    unwritten). segments: lora_segments(token_slots), when the caller shares it between projections."""
    T, K = x.shape
    assert x.stride(1) == 1 and A.stride(2) == 1
    chunk = max(16, min(chunk, triton.next_power_of_2(K)))
    br = max(16, triton.next_power_of_2(rank))
    mb = triton.next_power_of_2(members) * br
    block_k = max(16, min(block_k, chunk, max(32, 8192 // mb)))
    splits = triton.cdiv(K, chunk)
    h = torch.empty(T, splits, members, br, device=x.device, dtype=torch.float32)
    if T == 0:
        return h
    sorted_slots, order, is_sorted = _segment_args(token_slots, segments)
    _shrink_kernel[(T, splits)](x, A, sorted_slots, order, h, T, K, x.stride(0), A.stride(0), A.stride(1),
                                R=rank, BR=br, MB=mb, CHUNK=chunk, BK=block_k, SPLITS=splits, MEMBERS=members,
                                STRIDE=stride, BT=BLOCK_T, SCAN=SCAN, NSCAN=triton.cdiv(T, SCAN), SORTED=is_sorted,
                                UPCAST=_interpreted())
    return h


def lora_expand(h, B, token_slots, y, rank: int, block_n: int = 256, splits=None, segments=None):
    """y [T, out] += B[s_t, :rank]^T @ sum(h[t]) for tokens with a slot, each output column with the code of
    its member (splits: the members' out sizes; at most 3); returns y."""
    T, N = y.shape
    parts, members, br = h.shape[1], h.shape[2], h.shape[3]
    splits = splits or [N]
    assert y.stride(1) == 1 and B.stride(2) == 1 and len(splits) == members <= 3 and sum(splits) == N
    if T == 0:
        return y
    bounds = [sum(splits[:i + 1]) for i in range(members - 1)] + [N, N]
    mb = triton.next_power_of_2(members) * br
    block_n = max(16, min(block_n, triton.next_power_of_2(N), max(64, 16384 // mb)))
    sorted_slots, order, is_sorted = _segment_args(token_slots, segments)
    _expand_kernel[(T, triton.cdiv(N, block_n))](h, B, sorted_slots, order, y, T, N, bounds[0], bounds[1],
                                                 B.stride(0), B.stride(1), y.stride(0), R=rank, BR=br, MB=mb,
                                                 SPLITS=parts, BN=block_n, MEMBERS=members, BT=BLOCK_T,
                                                 SCAN=SCAN, NSCAN=triton.cdiv(T, SCAN), SORTED=is_sorted,
                                                 UPCAST=_interpreted())
    return y


def lora_apply(x, y, A, B, token_slots, rank: int, splits=None, stride: int = 0, segments=None):
    """y += each token's LoRA delta (in place): shrink then expand (a group when splits names its members).
    segments: lora_segments(token_slots), computed once per forward by the caller; sorted here when None."""
    members = len(splits) if splits else 1
    if segments is None:
        segments = lora_segments(token_slots)
    h = lora_shrink(x, A, token_slots, rank, members=members, stride=stride, segments=segments)
    return lora_expand(h, B, token_slots, y, rank, splits=splits, segments=segments)
