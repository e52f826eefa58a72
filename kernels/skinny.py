"""Products of a few rows by a wide weight: out [M, N] = x [M, K] @ W[N, K]^T (+ bias), 2 <= M <= 16 (decode steps
of a few sequences, short prompts).

Such a product is bound by reading W once. cuBLAS at 8 rows read the Qwen2.5-7B projections at ~3.5 TB/s on the
H200, and a kernel of this design at ~3.8 (bench/probe_reader_partition.py, bench/RESULTS.md 2026-12-06 23:51;
there the split partial sums went to fp32 atomics, here to the fixup below). Each program takes BN
output columns and a range of K: W's tiles [BN, BK] come through the bulk tensor copy engine (a TMA descriptor) in a
software pipeline and are the wide operand of the tensor cores' product with x's rows (padded to 16) transposed, so
the tensor cores need no more than 16 rows of x. K is split over programs so that every SM has several in flight
even where N is narrow (o_proj, down_proj: 28 column tiles); the last program of a column tile to finish (a counter
per tile, reset by that program) sums the tile's partial sums from a workspace and writes the output, so a call is
one launch and needs no zeroed buffer. skinny_reference is the plain-torch definition.

The model's projections in passes without autograd on Hopper GPUs take it with DARK_SKINNY=1
(dark.models.decoder._project, and SlotLoRA.extended's product over the extended weights). By default they stay on
cuBLAS: in the engine's decode steps on an H100 it was 0.7-1.2% faster without an adapter and -2.2% to +0.5% with
one (bench/ab_decode_env.py, bench/RESULTS.md 2026-12-07), and it is not yet measured there on the H200. Under
programmatic dependent launch (decode steps) it waits for the kernel before it first thing.
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

BN, BK, STAGES, WARPS = 128, 128, 3, 4   # the best of five tilings at every partition size, H100 and H200 alike
ROWS = 16                                # x's rows as the tensor cores take them (the smallest product width)
MIN_CHUNKS = 4                           # BK-wide steps a program takes at least (a pipeline of 3 stages)
PROGRAMS_PER_SM = 2                      # K splits aimed at (engine A/B, H100: 2 beat 4 and 8 by 2-4%)


def skinny_reference(x, weight, bias=None):
    return F.linear(x, weight, bias)


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether skinny() takes this product: 2-16 rows of x, a 16-bit weight with unit stride along K and rows
    16-byte aligned (what a TMA descriptor needs), and x of the weight's dtype."""
    return (x.dim() == 2 and 2 <= x.shape[0] <= ROWS and x.dtype == weight.dtype
            and weight.dtype in (torch.bfloat16, torch.float16) and weight.dim() == 2 and weight.stride(1) == 1
            and (weight.stride(0) * weight.element_size()) % 16 == 0 and weight.data_ptr() % 16 == 0
            and x.shape[1] == weight.shape[1] and x.shape[1] % 8 == 0)


def plan(n: int, k: int, sms: int) -> tuple[int, int]:
    """(BK steps a program takes, programs along K) for an [n, k] weight on a device of `sms` SMs."""
    chunks = triton.cdiv(k, BK)
    tiles = triton.cdiv(n, BN)
    want = triton.cdiv(PROGRAMS_PER_SM * sms, tiles)
    splits = max(1, min(want, chunks // MIN_CHUNKS))
    per = triton.cdiv(chunks, splits)
    return per, triton.cdiv(chunks, per)


_WORK: dict = {}


def _workspace(device: torch.device, n: int, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial sums [tiles, splits, BN, ROWS] fp32 and the tiles' counters (zeros; every call leaves them zero).
    Eager calls take those of their stream, so products on two streams at once (serving's and a learn job's
    reference passes) never share a counter; calls captured in a CUDA graph take one set for all graphs (the
    engine replays one decode step at a time), made and zeroed by an eager call of the same shape before (the
    engine's warm-up before each capture), else inside the capture, where each replay zeroes them first."""
    tiles = triton.cdiv(n, BN)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    graphs = (str(device), "graphs", tiles, splits)
    if capturing:
        key = graphs
    else:
        key = (str(device), torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0, tiles,
               splits)
    for k in (key,) if capturing or device.type != "cuda" else (key, graphs):
        if k not in _WORK:
            _WORK[k] = (torch.empty(tiles * splits * BN * ROWS, device=device, dtype=torch.float32),
                        torch.zeros(tiles, device=device, dtype=torch.int32))
    return _WORK[key]


def skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (2 <= M <= 16, see applies), weight [N, K], bias [N] or None -> [M, N] in x's dtype."""
    assert applies(x, weight), "skinny: 2-16 rows and a 16-bit weight with aligned rows (applies)"
    assert bias is None or (bias.shape == (weight.shape[0],) and bias.is_contiguous()), "skinny: a bias [N]"
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    per, splits = plan(N, K, launch_sms(x.device))
    work, counters = _workspace(x.device, N, splits) if splits > 1 else (x, x)  # one program a tile: no sums
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    _skinny_kernel[(triton.cdiv(N, BN), splits)](
        tma_descriptor(weight, [BN, BK]), x, bias if bias is not None else x, out, work, counters, M, N, K,
        x.stride(0), out.stride(0), CHUNKS=per, SPLITS=splits, HAS_BIAS=bias is not None, BN=BN, BK=BK, R=ROWS,
        STAGES=STAGES, UPCAST=os.environ.get("TRITON_INTERPRET") == "1", num_warps=WARPS, **pdl(x.device))
    return out


if triton is not None:
    from . import wait_prior

    @triton.jit
    def _skinny_kernel(w_desc, x_ptr, b_ptr, out_ptr, work_ptr, count_ptr, M, N, K, stride_xm, stride_om,
                       CHUNKS: tl.constexpr, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, R: tl.constexpr, STAGES: tl.constexpr, UPCAST: tl.constexpr,
                       PDL: tl.constexpr):
        # under programmatic dependent launch (decode steps) x, the workspace and the counters may be the kernel
        # before's: wait for it before anything (the weight's first tiles would be free to fetch, but the
        # pipelined loop issues them with x's)
        wait_prior(PDL)
        tile = tl.program_id(0)
        part = tl.program_id(1)
        n0 = tile * BN
        k_lo = part * (CHUNKS * BK)
        offs_r = tl.arange(0, R)
        offs_k = tl.arange(0, BK)
        acc = tl.zeros([BN, R], tl.float32)
        for c in tl.range(0, CHUNKS, num_stages=STAGES):
            k = k_lo + c * BK
            w = w_desc.load([n0, k])  # past N or K the copy engine fills zeros
            ks = k + offs_k
            x = tl.load(x_ptr + offs_r[:, None] * stride_xm + ks[None, :],
                        mask=(offs_r[:, None] < M) & (ks[None, :] < K), other=0.0)
            if UPCAST:  # the CPU interpreter's 16-bit dot is wrong: there the same steps run in fp32
                acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(x), acc)
        offs_t = tl.arange(0, BN)
        offs_n = n0 + offs_t
        if SPLITS == 1:
            _skinny_store(acc, b_ptr, out_ptr, offs_n, offs_r, M, N, stride_om, HAS_BIAS)
        else:
            tile_work = work_ptr + tile * (SPLITS * BN * R) + offs_t[:, None] * R + offs_r[None, :]
            tl.store(tile_work + part * (BN * R), acc)
            tl.debug_barrier()  # every thread's partial stored before the counter says so
            done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if done == SPLITS - 1:  # the tile's last program: the others' partials are visible (acquire)
                total = tl.zeros([BN, R], tl.float32)
                for s in tl.static_range(SPLITS):
                    total += tl.load(tile_work + s * (BN * R), cache_modifier=".cg")
                tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next call
                _skinny_store(total, b_ptr, out_ptr, offs_n, offs_r, M, N, stride_om, HAS_BIAS)

    @triton.jit
    def _skinny_store(acc, b_ptr, out_ptr, offs_n, offs_r, M, N, stride_om, HAS_BIAS: tl.constexpr):
        mask_n = offs_n < N
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + offs_r[None, :] * stride_om + offs_n[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=mask_n[:, None] & (offs_r[None, :] < M))
