"""How much of the HBM bandwidth can a few SMs pull, alone and beside training's GEMMs on the other SMs?

The decode-during-training lines need decode within 1.3x of its solo step while training keeps 70% of its rate.
probe_partition.py (2026-12-03) found no SM split that gives both with the engine's decode step (cuBLAS products):
on 40 SMs that step took 5.64 ms alone against 4.44 on every SM, and 1.67x beside the GEMMs. This probe asks whether
that is a limit of the hardware or of the products' kernels: the linear products of one 8-sequence decode step
(Qwen2.5-7B: 28 layers x q/k/v, o, gate/up, down, 13.05 GB of bf16 weights) replayed in one CUDA graph on a
partition of N SMs, as
  cublas       torch.mm, as the engine runs them
  tma-*        a Triton product W @ x^T (the weight as the wide operand, 16 rows of x) whose weight tiles come
               through the bulk tensor copy engine in a software pipeline, K split over programs so that every
               SM of the partition has several programs in flight (fp32 atomics into the output)
  ld-*         the same kernel with ordinary pointer loads
each alone on its partition, then beside a queue of 4096 x 3584 x 18944 bf16 GEMMs on the partition of the other
SMs (the shape of a training step's products). Reported: ms a step, TB/s, and the GEMMs' TFLOP/s beside it against
alone on every SM.

    PYTHONPATH=$PWD python3 bench/probe_reader_partition.py --out $OUT/reader.json
    TRITON_INTERPRET=1 python3 bench/probe_reader_partition.py --check     # the kernels against torch, on a CPU
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_decode  # noqa: E402
from probe_partition import together  # noqa: E402

M, K, N = 4096, 3584, 18944                      # a training step's product (as in probe_partition.py)
SHAPES = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)]   # (out, in) of q/k/v, o, gate/up, down
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ROWS = 16                                        # 8 decode rows, padded to the tensor cores' smallest tile
CONFIGS = [(128, 128, 4, 4), (128, 64, 8, 4), (64, 128, 6, 4), (256, 64, 4, 8), (128, 128, 3, 4)]


@triton.jit
def _skinny_tma(w_desc, x_desc, y_ptr, n_out, CHUNKS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, R: tl.constexpr,
                STAGES: tl.constexpr, UPCAST: tl.constexpr = False):
    n0 = tl.program_id(0) * BN
    k_lo = tl.program_id(1) * CHUNKS * BK
    acc = tl.zeros([BN, R], tl.float32)
    for c in tl.range(0, CHUNKS, num_stages=STAGES):  # CHUNKS chunks of BK from k_lo
        k = k_lo + c * BK
        w = w_desc.load([n0, k])
        x = x_desc.load([0, k])
        if UPCAST:  # the interpreter's bf16 dot is wrong: the CPU check runs the same indexing in fp32
            acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
    offs_n = n0 + tl.arange(0, BN)
    offs_r = tl.arange(0, R)
    tl.atomic_add(y_ptr + offs_r[None, :] * n_out + offs_n[:, None], acc, sem="relaxed")


@triton.jit
def _skinny_ld(w_ptr, x_ptr, y_ptr, n_out, n_in, CHUNKS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, R: tl.constexpr,
               STAGES: tl.constexpr, UPCAST: tl.constexpr = False):
    n0 = tl.program_id(0) * BN
    k_lo = tl.program_id(1) * CHUNKS * BK
    offs_n = n0 + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    offs_r = tl.arange(0, R)
    acc = tl.zeros([BN, R], tl.float32)
    for c in tl.range(0, CHUNKS, num_stages=STAGES):  # CHUNKS chunks of BK from k_lo
        k = k_lo + c * BK
        w = tl.load(w_ptr + offs_n[:, None] * n_in + (k + offs_k)[None, :])
        x = tl.load(x_ptr + offs_r[:, None] * n_in + (k + offs_k)[None, :])
        if UPCAST:  # the interpreter's bf16 dot is wrong: the CPU check runs the same indexing in fp32
            acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
    tl.atomic_add(y_ptr + offs_r[None, :] * n_out + offs_n[:, None], acc, sem="relaxed")


def split_k(n_out: int, n_in: int, bn: int, bk: int, programs: int, min_chunks: int = 4) -> int:
    """The K range a program takes: enough programs to fill `programs`, each at least `min_chunks` BK chunks."""
    tiles = n_out // bn
    chunks = n_in // bk
    splits = max(1, min(math.ceil(programs / tiles), chunks // min_chunks))
    while chunks % splits:
        splits -= 1
    return chunks // splits * bk


def launcher(kind: str, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, cfg: tuple, programs: int):
    """A call that adds x @ w^T (as y^T's rows: y is fp32 [ROWS, out]) into y with one kernel launch."""
    bn, bk, stages, warps = cfg
    n_out, n_in = w.shape
    ks = split_k(n_out, n_in, bn, bk, programs)
    grid = (n_out // bn, n_in // ks)
    if kind == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor

        wd = TensorDescriptor.from_tensor(w, [bn, bk])
        xd = TensorDescriptor.from_tensor(x, [ROWS, bk])
        return lambda: _skinny_tma[grid](wd, xd, y, n_out, ks // bk, BN=bn, BK=bk, R=ROWS, STAGES=stages,
                                         UPCAST=INTERPRET, num_warps=warps)
    return lambda: _skinny_ld[grid](w, x, y, n_out, n_in, ks // bk, BN=bn, BK=bk, R=ROWS, STAGES=stages,
                                    UPCAST=INTERPRET, num_warps=warps)


def check(device: torch.device) -> dict:
    """Both kernels against torch at small sizes (TRITON_INTERPRET=1 runs them on a CPU)."""
    g = torch.Generator(device=device).manual_seed(0)
    out = {}
    for kind in ("ld", "tma"):
        for n_out, n_in in [(256, 512), (128, 1024)]:
            w = torch.randn(n_out, n_in, device=device, generator=g).to(torch.bfloat16)
            x = torch.zeros(ROWS, n_in, device=device, dtype=torch.bfloat16)
            x[:8] = torch.randn(8, n_in, device=device, generator=g).to(torch.bfloat16)
            y = torch.zeros(ROWS, n_out, device=device, dtype=torch.float32)
            launcher(kind, w, x, y, (64, 64, 2, 4), programs=8)()
            ref = x.float() @ w.float().t()
            err = ((y - ref).norm() / ref.norm()).item()
            out[f"{kind}-{n_out}x{n_in}"] = err
            if not err < 1e-2:
                raise AssertionError(f"{kind} {n_out}x{n_in}: relative error {err}")
    return out


class Step:
    """The weights of one decode step's products and a graph of them per (kind, config, partition)."""

    def __init__(self, device: torch.device, layers: int = 28):
        g = torch.Generator(device=device).manual_seed(1)
        self.device = device
        self.ws = [torch.empty(o, i, device=device, dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
                   for _ in range(layers) for o, i in SHAPES]
        self.bytes = sum(w.numel() * 2 for w in self.ws)
        self.x = torch.zeros(ROWS, max(i for _, i in SHAPES), device=device, dtype=torch.bfloat16)
        self.x[:8].normal_(generator=g)
        self.xs = {i: self.x[:, :i].contiguous() for _, i in SHAPES}
        self.ys = [torch.zeros(ROWS, w.shape[0], device=device, dtype=torch.float32) for w in self.ws]
        self.x8 = {i: self.xs[i][:8].contiguous() for _, i in SHAPES}
        self.outs = [torch.empty(8, w.shape[0], device=device, dtype=torch.bfloat16) for w in self.ws]

    def calls(self, kind: str, cfg: tuple | None, programs: int) -> list:
        if kind == "cublas":
            return [(lambda w=w, o=o: torch.mm(self.x8[w.shape[1]], w.t(), out=o)) for w, o in zip(self.ws, self.outs)]
        return [launcher(kind, w, self.xs[w.shape[1]], y, cfg, programs) for w, y in zip(self.ws, self.ys)]

    def graph(self, stream, kind: str, cfg: tuple | None, programs: int) -> torch.cuda.CUDAGraph:
        calls = self.calls(kind, cfg, programs)
        with torch.cuda.stream(stream):
            for c in calls:      # compile and warm outside the capture
                c()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for c in calls:
                c()
        return graph

    def check_graph(self, stream, kind: str, cfg: tuple | None, programs: int) -> float:
        """Relative error of the first product after one clean run (the bench's buffers accumulate across replays)."""
        w, y = self.ws[2], self.ys[2]
        y.zero_()
        with torch.cuda.stream(stream):
            launcher(kind, w, self.xs[w.shape[1]], y, cfg, programs)()
        stream.synchronize()
        ref = self.xs[w.shape[1]].float() @ w.float().t()
        return round(((y - ref).norm() / ref.norm()).item(), 5)


def replay_ms(stream, graph, reps: int = 20) -> float:
    with torch.cuda.stream(stream):
        return bench_decode.replay_ms(graph, reps)


def gemm_ms(stream, x, w, out, n: int = 30) -> float:
    with torch.cuda.stream(stream):
        for _ in range(3):
            torch.mm(x, w.t(), out=out)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            torch.mm(x, w.t(), out=out)
        b.record()
    b.synchronize()
    return a.elapsed_time(b) / n


def tflops(ms: float) -> float:
    return round(2 * M * K * N / (ms / 1000) / 1e12, 1)


def beside(dec_stream, graph, gemm_stream, x, w, out, read_ms: float, g_ms: float, reps: int = 40) -> dict:
    """The GEMMs queued first (enough to outlast the replays), then the replays; the GEMMs' rate from the events
    that fall inside the replays' window (probe_partition.together)."""
    n = int(1.5 * reps * read_ms / g_ms) + 20
    r = together(dec_stream, gemm_stream, graph, x, [w], out, reps=reps, every=2, n_gemm=n)
    return {"read_ms": r["decode_ms"], "gemm_tflops": r["gemm_tflops"], "gemms_outlast": r["gemms_outlast_decode"]}


def main() -> None:
    global M, K, N, CONFIGS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--check", action="store_true", help="only the kernels against torch at small sizes")
    ap.add_argument("--sms", type=int, nargs="+", default=[16, 24, 32, 40, 48, 64])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--gemm", type=int, nargs=3, metavar=("M", "K", "N"), default=[M, K, N],
                    help="the GEMMs beside the reader (default: a training step's 4096 x 3584 x 18944)")
    ap.add_argument("--configs", nargs="+", help="the Triton tilings to try, as BNxBKxSTAGESxWARPS (default: five)")
    a = ap.parse_args()
    M, K, N = a.gemm
    if a.configs:
        CONFIGS = [tuple(int(v) for v in c.split("x")) for c in a.configs]
    if a.check or INTERPRET:
        print(json.dumps({"check": check(torch.device("cuda" if torch.cuda.is_available() else "cpu"))}))
        return
    from dark.engine.green import split

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    report: dict = {"device": props.name, "sms_total": props.multi_processor_count, "gemm": [M, K, N],
                    "check": check(dev), "rows": {}}

    def save():
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(report, indent=1))

    t = time.perf_counter()
    step = Step(dev, a.layers)
    report["step_gb"] = round(step.bytes / 1e9, 3)
    g = torch.Generator(device=dev).manual_seed(2)
    gx = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g)
    gw = torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    gout = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    hi = torch.cuda.Stream(dev, priority=-1)
    lo = torch.cuda.Stream(dev, priority=0)
    g_full = gemm_ms(lo, gx, gw, gout)
    report["gemm_alone_full_tflops"] = tflops(g_full)
    report["setup_s"] = round(time.perf_counter() - t, 1)

    def measure(label: str, stream, programs: int, other, other_ms: float) -> dict:
        row: dict = {"alone": {}}
        graphs = {}
        for kind, cfgs in (("cublas", [None]), ("tma", CONFIGS), ("ld", CONFIGS)):
            for cfg in cfgs:
                name = kind if cfg is None else f"{kind}-{'x'.join(map(str, cfg))}"
                try:
                    gr = step.graph(stream, kind, cfg, programs)
                    ms = replay_ms(stream, gr)
                    row["alone"][name] = {"ms": round(ms, 3), "tb_s": round(step.bytes / ms / 1e9, 3)}
                    if kind != "cublas":
                        row["alone"][name]["rel_err"] = step.check_graph(stream, kind, cfg, programs)
                    graphs[name] = (gr, ms)
                except Exception as e:  # a config the compiler or the shared memory cannot take
                    row["alone"][name] = {"error": repr(e)[:300]}
        best = {}
        for kind in ("tma", "ld"):
            ok = [(v[1], n) for n, v in graphs.items() if n.startswith(kind + "-")]
            if ok:
                best[kind] = min(ok)[1]
        row["best"] = best
        row["beside"] = {}
        for name in ["cublas"] + list(best.values()):
            gr, ms = graphs[name]
            r = beside(stream, gr, other, gx, gw, gout, ms, other_ms)
            r["tb_s"] = round(step.bytes / r["read_ms"] / 1e9, 3)
            r["gemm_ratio"] = round(r["gemm_tflops"] / report["gemm_alone_full_tflops"], 3) if r["gemm_tflops"] else None
            row["beside"][name] = r
        del graphs
        report["rows"][label] = row
        print(json.dumps({label: {"best": best, "alone": {k: v.get("ms") for k, v in row["alone"].items()},
                                  "beside": row["beside"]}}), flush=True)
        save()
        return row

    full = measure("full", hi, 4 * props.multi_processor_count, lo, g_full)
    full_ms = {k: v["ms"] for k, v in full["alone"].items() if "ms" in v}
    for name, r in full["beside"].items():
        r["read_x_alone_full"] = round(r["read_ms"] / full_ms[name], 3)
    save()
    for n in a.sms:
        try:
            part, rest = split(dev, n, priorities=(-1, 0))
            other_ms = gemm_ms(rest.stream, gx, gw, gout)
            # the same K splits as on every SM (a partition runs the extra programs in waves; fewer compiles)
            row = measure(f"split-{part.sms}", part.stream, 4 * props.multi_processor_count, rest.stream, other_ms)
            row["read_sms"], row["gemm_sms"] = part.sms, rest.sms
            row["gemm_alone_tflops"] = tflops(other_ms)
            for name, r in row["beside"].items():
                # against the best full-device step of any reader: what decode's 1.3x line is measured against
                r["read_x_best_full"] = round(r["read_ms"] / min(full_ms.values()), 3)
                r["read_x_alone_full"] = round(r["read_ms"] / full_ms[name], 3) if name in full_ms else None
            save()
        except Exception as e:
            report["rows"][f"split-{n}"] = {"error": repr(e)[:300]}
            save()
    print(json.dumps({k: {n: (r.get("read_x_best_full"), r.get("gemm_ratio")) for n, r in v.get("beside", {}).items()}
                      for k, v in report["rows"].items()}), flush=True)


if __name__ == "__main__":
    main()
