"""Does decode's weight stream evict training's GEMM tiles from L2? Decode-like skinny products beside training GEMMs.

Decode during training misses its targets because the two share the HBM bandwidth (bench/probe_partition.py): decode
streams ~13 GB of weights a step through L2, and a training GEMM whose tiles are evicted before their reuse reads
them from HBM again. This probe replays, as one CUDA graph, the linear layers of a Qwen2.5-7B decode step of 8 rows
(28 layers x q/k/v, o, gate/up, down: 13.1 GB of bf16 weights) in three ways:
  cublas        F.linear, what the engine runs at 8 sequences
  triton        a skinny Triton product (x padded to 16 rows), weights loaded with the default cache policy
  triton-first  the same with the weights' loads marked evict_first (they pass through L2 without displacing
                lines that will be read again)
each alone, and beside a queue of 4096 x 3584 x 18944 bf16 GEMMs (a training step's largest) on a low-priority
stream on every SM and in torch's green context of half the SMs (the engine's default while serving). Reported:
decode ms a step alone and beside, and the GEMMs' TFLOP/s alone and beside.

    PYTHONPATH=$PWD python3 bench/probe_l2.py --out $OUT/l2.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import replay_ms  # noqa: E402
from probe_partition import K, M, N, gemm_alone, together  # noqa: E402

H, I, LAYERS, QKV = 3584, 18944, 28, 4608


@triton.jit
def _skinny(x_ptr, w_ptr, out_ptr, N, K, ROWS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
            EVICT: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BN + tl.arange(0, BN)
    m = tl.arange(0, 16)
    acc = tl.zeros((16, BN), tl.float32)
    k0 = 0
    while k0 < K:  # a while loop: the interpreter cannot take tensor bounds in range()
        k = k0 + tl.arange(0, BK)
        xt = tl.load(x_ptr + m[:, None] * K + k[None, :])
        wt = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=(n < N)[:, None], other=0.0, eviction_policy=EVICT)
        acc += tl.dot(xt, tl.trans(wt))
        k0 += BK
    tl.store(out_ptr + m[:, None] * N + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(m < ROWS)[:, None] & (n < N)[None, :])


def skinny(x16, w, out, evict: str, bn: int, bk: int, stages: int, warps: int):
    n, k = w.shape
    _skinny[(triton.cdiv(n, bn),)](x16, w, out, n, k, ROWS=out.shape[0], BN=bn, BK=bk, EVICT=evict,
                                    num_stages=stages, num_warps=warps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--shared", type=int, nargs="+", default=[66])
    ap.add_argument("--tiles", nargs="+", default=["16,256,4,4", "32,128,4,4", "16,512,3,4"],
                    help="BN,BK,stages,warps of the Triton product")
    a = ap.parse_args()
    from dark.learn.jobs import training_stream

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    layers = [[torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
               for n, k in ((QKV, H), (H, H), (2 * I, H), (H, I))] for _ in range(LAYERS)]
    gb = sum(w.numel() for ws in layers for w in ws) * 2 / 1e9
    x16 = {k: torch.randn(16, k, device=dev, dtype=torch.bfloat16, generator=g) for k in (H, I)}
    outs = [[torch.empty(a.rows, w.shape[0], device=dev, dtype=torch.bfloat16) for w in ws] for ws in layers]
    report: dict = {"device": torch.cuda.get_device_name(dev), "decode_weights_gb": round(gb, 2), "rows": a.rows,
                    "gemm": [M, K, N], "variants": {}}

    def save():
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1))

    def step(kind: str, tile: tuple[int, int, int, int] | None):
        for ws, os_ in zip(layers, outs):
            for w, o in zip(ws, os_):
                x = x16[w.shape[1]]
                if kind == "cublas":
                    torch.mm(x[:a.rows], w.t(), out=o)
                else:
                    skinny(x, w, o, "evict_first" if kind == "triton-first" else "", *tile)

    main_stream = torch.cuda.Stream(dev, priority=-1)
    low = torch.cuda.Stream(dev, priority=0)
    xg = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g)
    wg = [torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(2)]
    og = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    report["gemm_alone_tflops"] = gemm_alone(low, xg, wg, og)
    shared = {n: training_stream(dev, n)[1] for n in a.shared}
    for n, s in shared.items():
        report[f"gemm_alone_tflops_green_{n}"] = gemm_alone(s, xg, wg, og)
    save()

    variants = [("cublas", None)] + [(k, tuple(int(v) for v in t.split(","))) for t in a.tiles
                                     for k in ("triton", "triton-first")]
    for kind, tile in variants:
        name = kind if tile is None else f"{kind} {','.join(map(str, tile))}"
        try:
            with torch.cuda.stream(main_stream):
                step(kind, tile)  # compile, warm
                main_stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=main_stream):
                    step(kind, tile)
                alone = replay_ms(graph, 20)
            row = {"decode_alone_ms": round(alone, 3), "decode_alone_tb_s": round(gb / alone, 2)}
            for label, stream in [("every_sm_low_priority", low)] + [(f"green_{n}", s_) for n, s_ in shared.items()]:
                t = together(main_stream, stream, graph, xg, wg, og, reps=40)
                base = report["gemm_alone_tflops"]
                t["decode_ratio"] = round(t["decode_ms"] / alone, 3)
                t["gemm_ratio"] = round(t["gemm_tflops"] / base, 3) if t["gemm_tflops"] else None
                row[label] = t
            report["variants"][name] = row
        except Exception as e:  # a tile Triton cannot build: note it, go on
            report["variants"][name] = {"error": repr(e)[:400]}
        print(json.dumps({name: report["variants"][name]}), flush=True)
        save()


if __name__ == "__main__":
    main()
