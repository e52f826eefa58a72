"""Block sizes of the batch-1 GEMV (dark.kernels.gemv) at the Qwen2.5-7B projection shapes, on the GPU.

Each configuration is timed as decode runs it: 20 calls back to back in one CUDA graph (programmatic dependent
launch on where the device has it, so each call overlaps the tail of the one before), weights rotated over
copies past the L2 cache. Prints and writes, per shape, cuBLAS (F.linear), the configuration in use
(gemv.config) and the best one found, in microseconds per call and TB/s.

    PYTHONPATH=$PWD python bench/sweep_gemv.py --out /tmp/gemv.json [--budget-s 60] [--shapes down o] [--block-k 512 1024]
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import replay_ms  # noqa: E402

SHAPES = {"qkv": (4608, 3584, False), "o": (3584, 3584, False), "gate_up_glu": (18944, 3584, True),
          "down": (3584, 18944, False), "lm_head": (152064, 3584, False)}
CALLS = 20


def graph_us(fn, calls: int = CALLS, reps: int = 20) -> float:
    """Microseconds per call of fn(i) for i < calls, captured back to back in one CUDA graph."""
    fn(0)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    return replay_ms(graph, reps) * 1000 / calls


def main() -> None:
    from dark.models.decoder import kernel_module

    kernel_module()
    from dark.kernels import dependent_launch
    from dark.kernels.gemv import config, gemv

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--budget-s", type=float, default=240,
                    help="stop trying a shape's configurations after this long")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--block-k", type=int, nargs="*", default=[256, 512, 1024])
    a = ap.parse_args()
    with dependent_launch():  # as decode steps run (programmatic dependent launch where the device has it)
        sweep(a, gemv, config)


def sweep(a, gemv, config) -> None:
    t0 = time.perf_counter()
    report = {}
    for name in a.shapes:
        n, k, glu = SHAPES[name]
        rows = 2 * n if glu else n
        nbytes = rows * k * 2
        copies = max(2, -(-200_000_000 // nbytes))
        ws = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        lin = graph_us(lambda i: F.linear(x, ws[i % copies]))
        cur = config(n, k, glu)
        cands = [cur]
        for bn, bk, nw, fk in itertools.product((2, 4, 8, 16, 32), a.block_k, (4, 8), (1, 2, 4)):
            if (bn >= 16) != (k > 8192) and bn != 8 or bk * fk > 4096:
                continue
            if (bn, bk, nw, bk * fk) != cur:
                cands.append((bn, bk, nw, bk * fk))
        results, t_shape = [], time.perf_counter()
        for cfg in cands:
            if time.perf_counter() - t_shape > a.budget_s:
                break
            bn, bk, nw, fk = cfg
            try:
                us = graph_us(lambda i: gemv(x, ws[i % copies], block_n=bn, block_k=bk, num_warps=nw, first_k=fk,
                                             glu=glu))
            except Exception as e:  # a configuration the compiler refuses (registers, shared memory)
                print(name, cfg, "failed:", str(e)[:120], flush=True)
                continue
            results.append((us, cfg))
        results.sort()
        cur_us = next((us for us, c in results if c == cands[0]), None)
        report[name] = {"linear_us": round(lin, 2), "linear_TBps": round(nbytes / lin / 1e6, 2),
                        "current_cfg": list(cur), "current_us": cur_us and round(cur_us, 2),
                        "best_us": round(results[0][0], 2), "best_cfg": list(results[0][1]),
                        "best_TBps": round(nbytes / results[0][0] / 1e6, 2), "tried": len(results),
                        "top5": [[round(us, 2), list(c)] for us, c in results[:5]]}
        print(name, json.dumps(report[name]), flush=True)
        del ws
    report["_meta"] = {"device": torch.cuda.get_device_name(), "calls_per_graph": CALLS,
                       "seconds": round(time.perf_counter() - t0, 1)}
    if a.out:
        a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
