"""Multi-adapter LoRA for a batch where every token has its own adapter slot (SGMV style: one read per adapter).

A [slots, R, in] and B [slots, R, out] (B pre-scaled) are the engine's stacked factors; token t uses slot
s_t, or none when s_t = -1. `lora_segments` runs once per forward: it sorts the slots (`torch.sort`), so each
adapter's tokens sit side by side (a segment), and cuts every segment into blocks of up to BLOCK_T = 16
tokens, one row of a small table each (the slot, then the block's token indices); -1 tokens get none. Only
fixed-shape torch ops with no host sync: a CUDA graph captures it with the step. The kernels run one program
row per table row (G rows, a bound on the blocks from T and the slot count; rows past the last block exit at
once): a segment of 40 tokens is three blocks, a lone token a block of one. A batch of one needs no table
(its slot tensor is read as the one row).

One launch per projection (`lora_fused`, DARK_LORA_FUSED=1): grid (G rows, column programs). Each program takes its
row's slot and tokens, gathers their x rows and computes their codes h = x @ A[s]^T over the whole of `in`
itself (BK-wide steps of `tl.dot`, fp32 accumulation, every member's A rows of a group at once), then, for its
run of column tiles, multiplies h by the B tile and adds the result into the tokens' own rows of y in place.
Nothing goes through memory between the two halves, and no atomics or zero fill. Every column program of a
row repeats the row's shrink: A is small (q/k/v rank 16: 48 x 3584 bf16, 344 KB; down: 16 x 18944, 606 KB)
and after the first program L2 serves it, so the repeats cost L2 reads, not HBM. How many column programs a
row gets (`_fused_grid`) comes from a model of the launch's time in bytes one SM streams: the waves of programs
times one program's bytes (its shrink, its tiles), or all the repeated shrinks' bytes over FUSED_L2_PROGRAMS
SMs' worth of L2 bandwidth, whichever is longer: a lone block (batch of one) gets several programs, as its
shrink is the critical path whatever their number, and rows sharing a launch get fewer each; the grid stays
under a wave or two of the chip's SMs (H200, rank 16, bf16, G = 1 / 11 / 40: q/k/v 9 / 44 / 40 programs,
o 14 / 55 / 80, gate/up 37 / 88 / 120, down 4 / 22 / 40).

The shrink/expand pair is the default (it measured faster on the H200, see FUSED): `lora_shrink`
computes the codes with the work split along `in` (each range writes its own fp32 partial at the token's own
row of h), `lora_expand` sums the partials and adds h @ B into y, one program covering several column tiles
when many blocks share the launch. Two launches per projection. Either way, inside a CUDA graph the slot
tensor is the only input that changes, and a step of 64 tokens over 32 adapters reads each adapter's factors
about once, not 64 times; long prefills keep the dense torch math (dark.lora.slots).

`lora_expand_codes` is the expand alone for codes that a GEMM over a weight extended by every slot's A rows
already computed (every slot's codes side by side in the rows of its output; the engine's multi-token decode path,
dark.lora.slots): each block reads its own slot's codes there. Those codes are rounded to the GEMM's dtype.

The products stay fp32-exact: bf16 x and A go straight into the tensor cores with fp32 accumulation (their
products are exact in fp32); the fp32 codes meet a bf16/fp16 B as two half-precision parts (hi + lo), so the
code is not rounded to bf16; fp32 inputs use the "ieee" dot. Under TRITON_INTERPRET (whose bf16 dot is wrong)
the dots upcast to fp32.

Groups: projections that share their input (q/k/v, gate/up) run as one GEMM whose output is their outputs
side by side. Their factors are stacked the same way: A [slots, members * stride, in] (member m's rows start
at m * stride) and B [slots, stride, out_0 + out_1 + ...] (member m's columns follow member m-1's). The
shrink computes every member's code (one dot over all members' A rows), the expand adds each output column
its own member's delta (the B tile holds, for each column, only its member's rows): one launch for the group
(two unfused) instead of one per member, and nothing stored for pairs of members that do not meet.
"""
from __future__ import annotations

import functools
import os

import torch

from . import launch_sms, pdl

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
else:
    from . import wait_prior

BLOCK_T = 16  # tokens of one segment per program (tl.dot needs 16 rows at least; short blocks are masked)


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


def segment_rows(tokens: int, max_slots: int | None = None) -> int:
    """Rows of a step's block table (lora_segments) for `tokens` tokens over at most max_slots adapters: the kernels'
    launch shapes (their programs, chunk and tile counts, some of them compile-time constants) follow from it."""
    if tokens <= 1:
        return 1
    nseg = tokens if max_slots is None else min(tokens, max_slots)
    return max(1, min(tokens, (tokens + (BLOCK_T - 1) * nseg) // BLOCK_T))


def lora_segments(token_slots, max_slots: int | None = None):
    """The step's block table, once per forward, shared by every projection's kernels: int32 [G, 1 + BLOCK_T],
    row g = (slot, its tokens in sorted order padded with -1); rows past the last block have slot -1.

    Sorting puts each adapter's tokens side by side (a segment); a segment of L tokens is ceil(L / 16) rows, so
    G = min(T, (T + 15 * segments) // 16) rows always suffice, with segments <= max_slots (the engine's slot
    count) when given. Only torch ops of fixed shape and no host sync: a CUDA graph captures it with the step.
    A batch of one needs no table: its slot tensor is returned as it is."""
    T = token_slots.numel()
    if T <= 1:
        return token_slots.view(-1)
    G = segment_rows(T, max_slots)
    sorted_slots, order = torch.sort(token_slots.view(-1))
    pos = torch.arange(T, device=token_slots.device)
    start = torch.searchsorted(sorted_slots, sorted_slots)  # first position of each one's segment
    end = torch.searchsorted(sorted_slots, sorted_slots, right=True)
    owns = (sorted_slots >= 0) & ((pos - start) % BLOCK_T == 0)  # a block of 16 starts here
    first = torch.sort(torch.where(owns, pos, pos + T)).values[:G]  # the blocks' first positions, in order
    valid = first < T
    first = first % T
    p = first[:, None] + torch.arange(BLOCK_T, device=token_slots.device)
    member = valid[:, None] & (p < end[first][:, None])
    tokens = torch.where(member, order[p.clamp(max=T - 1)], -1)
    slot = torch.where(valid, sorted_slots[first], -1)
    return torch.cat([slot[:, None], tokens], 1).to(torch.int32)


if triton is not None:

    @triton.jit
    def _block(table_ptr, BT: tl.constexpr, SORTED: tl.constexpr):
        """This program's block: (its slot, whether it has tokens, their rows [BT], their mask)."""
        g = tl.program_id(0)
        j = tl.arange(0, BT)
        if SORTED:  # one row of the table: slot, then tokens (-1: none)
            s = tl.load(table_ptr + g * (BT + 1)).to(tl.int64)
            tok = tl.load(table_ptr + g * (BT + 1) + 1 + j).to(tl.int64)
            pm = tok >= 0
        else:  # a batch of one: the slot tensor itself
            s = tl.load(table_ptr).to(tl.int64)
            tok = j.to(tl.int64)
            pm = (j < 1) & (s >= 0)
        return tl.maximum(s, 0), s >= 0, tl.maximum(tok, 0), pm

    @triton.jit
    def _codes(x_ptr, a_ptr, s, tok, pm, start, K, stride_xt, stride_as, stride_ar, R: tl.constexpr,
               BR: tl.constexpr, MB: tl.constexpr, LENGTH: tl.constexpr, BK: tl.constexpr, MEMBERS: tl.constexpr,
               STRIDE: tl.constexpr, BT: tl.constexpr, UPCAST: tl.constexpr):
        """The block's fp32 codes x @ A^T [BT, MB] over columns [start, start + LENGTH) of x (those below K), for
        adapter slot s; code column c is member c // BR's rank row c % BR. Returns (codes, c, member, rank row)."""
        c = tl.arange(0, MB)
        m = c // BR
        r = c % BR
        cm = (m < MEMBERS) & (r < R)
        arow = (m * STRIDE + r).to(tl.int64)
        acc = tl.zeros([BT, MB], tl.float32)
        for k0 in range(0, LENGTH, BK):  # constant trip count; the tail is masked
            kk = start + k0 + tl.arange(0, BK)
            km = kk < K
            x = tl.load(x_ptr + tok[:, None] * stride_xt + kk[None, :], mask=pm[:, None] & km[None, :], other=0.0)
            a = tl.load(a_ptr + s * stride_as + arow[None, :] * stride_ar + kk[:, None],
                        mask=cm[None, :] & km[:, None], other=0.0)  # [BK, MB]: the tile, once per block
            if UPCAST or x.dtype == tl.float32:
                acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, a.to(x.dtype), acc)
        return acc, c, m, r

    @triton.jit
    def _shrink_kernel(x_ptr, a_ptr, table_ptr, h_ptr, K, stride_xt, stride_as, stride_ar,
                       R: tl.constexpr, BR: tl.constexpr, MB: tl.constexpr, CHUNK: tl.constexpr,
                       BK: tl.constexpr, SPLITS: tl.constexpr, MEMBERS: tl.constexpr, STRIDE: tl.constexpr,
                       BT: tl.constexpr, SORTED: tl.constexpr, UPCAST: tl.constexpr,
                       PDL: tl.constexpr):
        wait_prior(PDL)  # every program, the ones with no tokens too (see wait_prior)
        sp = tl.program_id(1)
        s, owns, tok, pm = _block(table_ptr, BT, SORTED)
        if owns:
            acc, c, _, _ = _codes(x_ptr, a_ptr, s, tok, pm, sp * CHUNK, K, stride_xt, stride_as, stride_ar,
                                  R, BR, MB, CHUNK, BK, MEMBERS, STRIDE, BT, UPCAST)
            tl.store(h_ptr + (tok[:, None] * SPLITS + sp) * (MEMBERS * BR) + c[None, :], acc,
                     mask=pm[:, None] & (c < MEMBERS * BR)[None, :])

    @triton.jit
    def _add_expanded(h, b_ptr, y_ptr, s, tok, pm, m, r, nb, N, N1, N2, stride_bs, stride_br, stride_yt,
                      R: tl.constexpr, BN: tl.constexpr, TILES: tl.constexpr, UPCAST: tl.constexpr):
        """y[tok, n] += h @ B for TILES tiles of BN columns from column tile nb * TILES on: h [BT, MB] the block's
        fp32 codes (code column c: member m = c // BR, rank row r = c % BR), B of adapter slot s, each member's
        rank rows kept only in its own columns (N1, N2: where the second and third members' outputs start)."""
        if UPCAST or b_ptr.dtype.element_ty == tl.float32:
            hi = h
            lo = h
        else:  # fp32 codes as hi + lo halves: the tensor cores, with the code not rounded to bf16
            hi = h.to(b_ptr.dtype.element_ty)
            lo = (h - hi.to(tl.float32)).to(b_ptr.dtype.element_ty)
        for t in range(TILES):  # TILES tiles of BN columns each, the codes loaded once for all
            n = (nb * TILES + t) * BN + tl.arange(0, BN)
            nm = n < N
            member = (n >= N1).to(tl.int32) + (n >= N2).to(tl.int32)  # which member's output each column is
            # row c of the tile is B's rank row c % BR, kept only in the columns of member c // BR
            b = tl.load(b_ptr + s * stride_bs + r[:, None] * stride_br + n[None, :],
                        mask=(r < R)[:, None] & (m[:, None] == member[None, :]) & nm[None, :], other=0.0)
            if UPCAST or b_ptr.dtype.element_ty == tl.float32:
                d = tl.dot(h, b.to(tl.float32), input_precision="ieee")
            else:
                d = tl.dot(lo, b, tl.dot(hi, b))
            yp = y_ptr + tok[:, None] * stride_yt + n[None, :]
            ym = pm[:, None] & nm[None, :]
            y = tl.load(yp, mask=ym, other=0.0).to(tl.float32)
            tl.store(yp, (y + d).to(y_ptr.dtype.element_ty), mask=ym)

    @triton.jit
    def _expand_kernel(h_ptr, b_ptr, table_ptr, y_ptr, N, N1, N2, stride_bs, stride_br, stride_yt, stride_ht,
                       stride_hs, stride_hm, stride_hp,
                       R: tl.constexpr, BR: tl.constexpr, MB: tl.constexpr, SPLITS: tl.constexpr,
                       BN: tl.constexpr, TILES: tl.constexpr, MEMBERS: tl.constexpr, BT: tl.constexpr,
                       SORTED: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr):
        """h: token t's code of member m, rank row r (split sp) at t * stride_ht + s * stride_hs + m * stride_hm
        + r + sp * stride_hp: lora_shrink's partials (stride_hs 0), or every slot's codes side by side in the
        columns of a GEMM's output (lora_expand_codes: the token's own slot s picks its codes)."""
        wait_prior(PDL)
        nb = tl.program_id(1)
        s, owns, tok, pm = _block(table_ptr, BT, SORTED)
        if owns:
            c = tl.arange(0, MB)
            m = c // BR
            r = c % BR
            hp = h_ptr + tok[:, None] * stride_ht + s * stride_hs + (m * stride_hm + r)[None, :]
            hm = pm[:, None] & ((m < MEMBERS) & (r < R))[None, :]
            h = tl.zeros([BT, MB], tl.float32)
            for sp in tl.static_range(SPLITS):  # unrolled: the partials' loads all in flight at once
                h += tl.load(hp + sp * stride_hp, mask=hm, other=0.0).to(tl.float32)
            _add_expanded(h, b_ptr, y_ptr, s, tok, pm, m, r, nb, N, N1, N2, stride_bs, stride_br, stride_yt,
                          R, BN, TILES, UPCAST)


    @triton.jit
    def _fused_kernel(x_ptr, a_ptr, b_ptr, table_ptr, y_ptr, N, N1, N2, stride_xt, stride_as, stride_ar,
                      stride_bs, stride_br, stride_yt, K: tl.constexpr, R: tl.constexpr, BR: tl.constexpr,
                      MB: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, TILES: tl.constexpr,
                      MEMBERS: tl.constexpr, STRIDE: tl.constexpr, BT: tl.constexpr, SORTED: tl.constexpr,
                      UPCAST: tl.constexpr, PDL: tl.constexpr):
        """Shrink then expand in one program: the block's codes over the whole of K (no partials in memory),
        then TILES column tiles from column tile nb * TILES on. K and TILES are constants: fixed trip counts
        (and no K mask when BK divides K)."""
        wait_prior(PDL)
        nb = tl.program_id(1)
        s, owns, tok, pm = _block(table_ptr, BT, SORTED)
        if owns:
            # every member's A rows over the whole of K, read once per block (from L2 after the first)
            h, _, m, r = _codes(x_ptr, a_ptr, s, tok, pm, 0, K, stride_xt, stride_as, stride_ar,
                                R, BR, MB, K, BK, MEMBERS, STRIDE, BT, UPCAST)
            _add_expanded(h, b_ptr, y_ptr, s, tok, pm, m, r, nb, N, N1, N2, stride_bs, stride_br, stride_yt,
                          R, BN, TILES, UPCAST)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# programs per launch the kernels aim for when choosing the K-range (shrink) and the columns (expand) of one
# program: fewer, longer programs once many blocks share the launch; many short ones for a batch of one
SHRINK_PROGRAMS = 1024
EXPAND_PROGRAMS = 2048
# launch options of the pair, for bench/bench_lora_multi.py's A/B runs: warps a program and the expand's column tile
# (H200, 64 sequences over 32 adapters: none of 8 warps, tiles of 128 or 512, one tile a program with all its loads
# issued at once, or 4x / 1/4 the shrink's programs moved the step by more than 0.1 ms; bench/RESULTS.md)
SHRINK_WARPS = 4
EXPAND_WARPS = 4
EXPAND_BLOCK_N = 256


def _table(token_slots, segments):
    table = segments if segments is not None else lora_segments(token_slots)
    if table.dim() == 1:
        assert table.numel() == 1, "a table of one dimension is the slot of a batch of one"
        return table, 1, False
    return table, table.shape[0], True


def lora_shrink(x, A, token_slots, rank: int, chunk: int | None = None, block_k: int = 128, members: int = 1,
                stride: int = 0, segments=None):
    """x [T, in] -> partial codes [T, splits, members, BR] fp32; for a token with a slot, the sum over axis 1 of
    [:, :, m, :rank] is A[s_t, m * stride:m * stride + rank] @ x[t] (rows of tokens without one are left
    unwritten). segments: lora_segments(token_slots), when the caller shares it between projections; chunk:
    the K-range of one program (None: from the number of blocks)."""
    T, K = x.shape
    assert x.stride(1) == 1 and A.stride(2) == 1
    table, rows, is_sorted = _table(token_slots, segments) if T else (None, 0, False)
    if chunk is None:
        chunk = min(4096, max(512, triton.next_power_of_2(triton.cdiv(K, max(1, SHRINK_PROGRAMS // max(rows, 1))))))
    chunk = max(16, min(chunk, triton.next_power_of_2(K)))
    br = max(16, triton.next_power_of_2(rank))
    mb = triton.next_power_of_2(members) * br
    block_k = max(16, min(block_k, chunk, max(32, 8192 // mb)))
    splits = triton.cdiv(K, chunk)
    h = torch.empty(T, splits, members, br, device=x.device, dtype=torch.float32)
    if T == 0:
        return h
    _shrink_kernel[(rows, splits)](x, A, table, h, K, x.stride(0), A.stride(0), A.stride(1), R=rank, BR=br, MB=mb,
                                   CHUNK=chunk, BK=block_k, SPLITS=splits, MEMBERS=members, STRIDE=stride,
                                   BT=BLOCK_T, SORTED=is_sorted, UPCAST=_interpreted(), num_warps=SHRINK_WARPS,
                                   **pdl(x.device))
    return h


def lora_expand(h, B, token_slots, y, rank: int, block_n: int | None = None, splits=None, segments=None,
                tiles: int | None = None):
    """y [T, out] += B[s_t, :rank]^T @ sum(h[t]) for tokens with a slot, each output column with the code of
    its member (splits: the members' out sizes; at most 3); returns y. tiles: column tiles of one program
    (None: from the number of blocks); block_n None: EXPAND_BLOCK_N."""
    parts, members, br = h.shape[1], h.shape[2], h.shape[3]
    assert len(splits or [0]) == members
    return _expand(h, (h.stride(0), 0, h.stride(2), h.stride(1)), parts, br, B, token_slots, y, rank, splits,
                   segments, block_n, tiles)


def lora_expand_codes(codes, B, token_slots, y, rank: int, member_stride: int, splits=None, segments=None,
                      block_n: int | None = None, tiles: int | None = None):
    """lora_expand with every slot's codes given side by side: codes [T, slots * members * member_stride] (any
    row stride, bf16 or fp32), token t's code of member m, rank row r at column s_t * members * member_stride +
    m * member_stride + r, as one GEMM over a weight with every slot's A rows after the base rows leaves them
    (dark.lora.slots: the engine's extended weights). y [T, out] += B[s_t, :rank]^T @ that code; returns y."""
    members = len(splits) if splits else 1
    assert codes.stride(1) == 1 and rank <= member_stride
    return _expand(codes, (codes.stride(0), members * member_stride, member_stride, 0), 1,
                   max(16, triton.next_power_of_2(rank)), B, token_slots, y, rank, splits, segments, block_n, tiles)


def _expand(h, h_strides, parts: int, br: int, B, token_slots, y, rank: int, splits, segments, block_n, tiles):
    """The expand launch: h_strides (token, slot, member, split) of the codes, as _expand_kernel reads them."""
    block_n = EXPAND_BLOCK_N if block_n is None else block_n
    T, N = y.shape
    splits = splits or [N]
    members = len(splits)
    assert y.stride(1) == 1 and B.stride(2) == 1 and members <= 3 and sum(splits) == N
    if T == 0:
        return y
    table, rows, is_sorted = _table(token_slots, segments)
    bounds = [sum(splits[:i + 1]) for i in range(members - 1)] + [N, N]
    mb = triton.next_power_of_2(members) * br
    block_n = max(16, min(block_n, triton.next_power_of_2(N), max(64, 16384 // mb)))
    n_tiles = triton.cdiv(N, block_n)
    if tiles is None:
        tiles = triton.cdiv(n_tiles, max(1, EXPAND_PROGRAMS // rows))
    tiles = max(1, min(tiles, n_tiles))
    _expand_kernel[(rows, triton.cdiv(n_tiles, tiles))](h, B, table, y, N, bounds[0], bounds[1], B.stride(0),
                                                        B.stride(1), y.stride(0), *h_strides, R=rank, BR=br,
                                                        MB=mb, SPLITS=parts, BN=block_n, TILES=tiles,
                                                        MEMBERS=members, BT=BLOCK_T, SORTED=is_sorted,
                                                        UPCAST=_interpreted(), num_warps=EXPAND_WARPS,
                                                        **pdl(y.device))
    return y


# shrink + expand unless DARK_LORA_FUSED=1: on the H200 (run_all, 2026-12-01, Qwen2.5-7B shapes, rank 16) the pair
# measured faster than the fused kernel in the same run: batch 1 with an adapter 0.813 vs 0.745 of the base step,
# 64 sequences over 32 adapters 0.762 vs 0.607 (the fused programs' repeated shrinks are the critical path)
FUSED = os.environ.get("DARK_LORA_FUSED", "0") == "1"
# the fused kernel's tiling (_fused_grid): how many programs streaming A at once fill L2's bandwidth (the repeated
# shrinks' cost), and the bytes of the A tile of one K step (bf16: BK = 512 for one member, 256 for gate/up, 128 for
# q/k/v)
FUSED_L2_PROGRAMS = 48
FUSED_TILE = 16384


@functools.lru_cache(maxsize=4096)
def _fused_grid(rows: int, per_row: int, K: int, N: int, block_n: int, rank: int, members: int, elt: int,
                sms: int, l2_programs: int) -> tuple[int, int]:
    """(programs per row, column tiles per program) for the fused kernel: the fewest programs within 5% of the best
    of a model of its time, in bytes one SM streams: the waves of programs times one program's bytes (its shrink: A
    and its tokens' x over all of K; its tiles: B rows and y columns), or the repeated shrinks' bytes over
    l2_programs SMs' worth of L2 bandwidth, whichever is longer. Several programs for a lone block (its shrink is
    the critical path and L2 serves it), few per row once many rows share the launch (each repeats the shrink)."""
    n_tiles = triton.cdiv(N, block_n)
    shrink = (members * rank + per_row) * K * elt
    per_tile = block_n * (rank + 2 * per_row) * elt
    costs = {}
    for tiles in range(1, n_tiles + 1):
        p = triton.cdiv(n_tiles, tiles)
        if p in costs:
            continue
        costs[p] = (max(triton.cdiv(rows * p, sms) * (shrink + tiles * per_tile), rows * p * shrink / l2_programs),
                    tiles)
    best = min(cost for cost, _ in costs.values())
    p = min(p for p, (cost, _) in costs.items() if cost <= 1.05 * best)
    return p, costs[p][1]


def lora_fused(x, y, A, B, token_slots, rank: int, splits=None, stride: int = 0, segments=None,
               block_n: int = 256, block_k: int | None = None, tiles: int | None = None):
    """y += each token's LoRA delta (in place) in ONE launch: grid (table rows, column programs), each program
    computing its block's codes over all of K and adding them times B into its column tiles. block_n / block_k /
    tiles (column tiles of one program): None or the default for the model's choice; set by tests."""
    T, K = x.shape
    N = y.shape[1]
    members = len(splits) if splits else 1
    splits = splits or [N]
    assert x.stride(1) == 1 and A.stride(2) == 1 and B.stride(2) == 1 and y.stride(1) == 1
    assert len(splits) == members <= 3 and sum(splits) == N
    if T == 0:
        return y
    table, rows, is_sorted = _table(token_slots, segments)
    bounds = [sum(splits[:i + 1]) for i in range(members - 1)] + [N, N]
    br = max(16, triton.next_power_of_2(rank))
    mb = triton.next_power_of_2(members) * br
    block_n = max(16, min(block_n, triton.next_power_of_2(N), max(64, 32768 // (mb * x.element_size()))))
    if block_k is None:
        block_k = max(32, FUSED_TILE // (mb * x.element_size()))
    block_k = max(16, min(block_k, triton.next_power_of_2(K)))
    n_tiles = triton.cdiv(N, block_n)
    if tiles is None:
        per_row = min(BLOCK_T, triton.cdiv(T, rows))
        _, tiles = _fused_grid(rows, per_row, K, N, block_n, rank, members, x.element_size(), launch_sms(x.device),
                               FUSED_L2_PROGRAMS)
    tiles = max(1, min(tiles, n_tiles))
    _fused_kernel[(rows, triton.cdiv(n_tiles, tiles))](
        x, A, B, table, y, N, bounds[0], bounds[1], x.stride(0), A.stride(0), A.stride(1), B.stride(0), B.stride(1),
        y.stride(0), K=K, R=rank, BR=br, MB=mb, BK=block_k, BN=block_n, TILES=tiles, MEMBERS=members, STRIDE=stride,
        BT=BLOCK_T, SORTED=is_sorted, UPCAST=_interpreted(), **pdl(x.device))
    return y


def lora_apply(x, y, A, B, token_slots, rank: int, splits=None, stride: int = 0, segments=None, fused=None):
    """y += each token's LoRA delta (in place); a group when splits names its members. segments:
    lora_segments(token_slots), computed once per forward by the caller; made here when None. fused: one launch
    (lora_fused) or shrink then expand; None: the module's FUSED (DARK_LORA_FUSED)."""
    if segments is None:
        segments = lora_segments(token_slots)
    if FUSED if fused is None else fused:
        return lora_fused(x, y, A, B, token_slots, rank, splits=splits, stride=stride, segments=segments)
    members = len(splits) if splits else 1
    h = lora_shrink(x, A, token_slots, rank, members=members, stride=stride, segments=segments)
    return lora_expand(h, B, token_slots, y, rank, splits=splits, segments=segments)
