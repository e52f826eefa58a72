"""Can training's products ride on decode's weight stream? Skinny products with training rows added, 7B shapes.

Decode during training misses its two lines together because the two contend for the memory system
(bench/probe_partition.py, bench/probe_l2.py): decode streams ~13 GB of weights a step, a training GEMM beside it
pulls its own tiles, and no split of the SMs gives decode <= 1.3x and training >= 0.70. A decode step of 8 rows is
bandwidth bound: its products use a few percent of the tensor cores while every weight byte crosses from HBM once.
Rows added to those same products cost little until the product turns compute bound. This probe measures that
room: the linear layers of a Qwen2.5-7B step (28 layers x q/k/v, o, gate/up, down; 13.05 GB of bf16 weights, each
layer its own, so nothing stays in L2 from one replay to the next) captured in one CUDA graph, replayed back to
back, in these forms:

  fwd M            Y = X W^T with M rows (8: the decode step; 8 + T: T training rows riding in the same product)
  fwd 8, bwd T     the decode product, then a backward-shaped product dX = dY W over T rows on the same weight
                   (the data gradient a LoRA training step needs through every frozen weight): two reads of W
  paired 8+T, T    the same two products cut into chunks of the weight's rows of about --chunk-mb each, the
                   backward product of a chunk right after its forward one, so the second reads the chunk from L2
  fwd 4096         the training-sized product: the rate a full training step's GEMMs get alone (TFLOP/s)
  dual M / T       dark.kernels.dual: one read of each weight for both the forward product over M rows and the
                   backward-shaped dX = dY W over T rows (--dual-rows T ...; --dual-fwd adds forward rows to M),
                   into fp32 sums zeroed before each product (`no zeroing`: once, outside the graph), in each of
                   the --dual-tilings (BN,BK,warps,stages)

For each: ms a replay, the weight bytes over that time (TB/s), and for the riding forms the training tokens a
second they would carry at that decode step time (T / ms). The question it answers: how many training rows a
decode step can carry in its own weight reads before it slows by more than the decode line allows (1.3x).

    PYTHONPATH=$PWD python3 bench/probe_piggyback.py --out $OUT/piggyback.json
    PYTHONPATH=$PWD python3 bench/probe_piggyback.py --only-dual --dual-rows 16 32 64 128 --out $OUT/dual.json
    python bench/probe_piggyback.py --tiny --device cpu     # check the script on a CPU (small shapes, no graphs)
    TRITON_INTERPRET=1 python bench/probe_piggyback.py --tiny --device cpu --only-dual --dual-rows 16
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import replay_ms  # noqa: E402

H, I, LAYERS, QKV = 3584, 18944, 28, 4608


def shapes(tiny: bool) -> list[tuple[int, int]]:
    """(out, in) of a layer's four products: q/k/v, o, gate/up, down."""
    h, i, qkv = (64, 160, 96) if tiny else (H, I, QKV)
    return [(qkv, h), (h, h), (2 * i, h), (h, i)]


def make_weights(device, dtype, layers: int, tiny: bool) -> list[list[torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(0)
    return [[(torch.randn(o, i, device=device, generator=g, dtype=torch.float32) * 0.02).to(dtype)
             for o, i in shapes(tiny)] for _ in range(layers)]


def chunk_rows(w: torch.Tensor, chunk_mb: float) -> int:
    """Rows of w in a chunk of about chunk_mb MB (at least one)."""
    per_row = w.shape[1] * w.element_size()
    return max(1, int(chunk_mb * 1e6 // per_row))


class Form:
    """One form's products over every layer, with its buffers made once (so a CUDA graph captures them)."""

    def __init__(self, ws, fwd_rows: int, bwd_rows: int, paired: bool, chunk_mb: float, device, dtype,
                 dual: bool = False, zero: bool = True):
        self.ws, self.paired, self.chunk_mb, self.dual, self.zero = ws, paired, chunk_mb, dual, zero
        g = torch.Generator(device=device).manual_seed(1)
        rnd = lambda *s: torch.randn(*s, device=device, generator=g, dtype=torch.float32).to(dtype)  # noqa: E731
        lay = ws[0]
        self.x = [rnd(fwd_rows, w.shape[1]) for w in lay] if fwd_rows else None
        out = torch.float32 if dual else dtype  # the dual kernel's sums are fp32
        self.y = [torch.zeros(fwd_rows, w.shape[0], device=device, dtype=out) for w in lay] if fwd_rows else None
        self.dy = [rnd(bwd_rows, w.shape[0]) for w in lay] if bwd_rows else None
        self.dx = [torch.zeros(bwd_rows, w.shape[1], device=device, dtype=out) for w in lay] if bwd_rows else None

    def run(self):
        if self.dual:
            dual = kernel_module_dual().dual
        for layer in self.ws:
            for j, w in enumerate(layer):
                if self.dual:
                    y = None if self.y is None else self.y[j]
                    dx = None if self.dx is None else self.dx[j]
                    if self.zero:
                        for t in (y, dx):
                            if t is not None:
                                t.zero_()
                    dual(None if self.x is None else self.x[j], None if self.dy is None else self.dy[j], w, y, dx)
                    continue
                if not self.paired:
                    if self.x is not None:
                        torch.mm(self.x[j], w.t(), out=self.y[j])
                    if self.dy is not None:
                        torch.mm(self.dy[j], w, out=self.dx[j])
                    continue
                step = chunk_rows(w, self.chunk_mb)
                for a in range(0, w.shape[0], step):
                    wc = w[a:a + step]
                    torch.mm(self.x[j], wc.t(), out=self.y[j][:, a:a + step])
                    # dX = sum over chunks of dY[:, chunk] W[chunk]: accumulated in place (beta 1)
                    self.dx[j].addmm_(self.dy[j][:, a:a + step], wc, beta=0.0 if a == 0 else 1.0)

    def flops(self) -> float:
        f = 0.0
        for o, i in ((w.shape[0], w.shape[1]) for w in self.ws[0]):
            f += 2 * o * i * ((self.x[0].shape[0] if self.x is not None else 0)
                              + (self.dy[0].shape[0] if self.dy is not None else 0))
        return f * len(self.ws)


def time_form(form: Form, device, reps: int) -> float:
    """ms of one pass of the form: a CUDA graph replayed back to back on CUDA, wall time on the CPU."""
    if device.type != "cuda":
        form.run()
        t = time.perf_counter()
        for _ in range(reps):
            form.run()
        return round(1000 * (time.perf_counter() - t) / reps, 3)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        form.run()  # warm-up outside the capture (cuBLAS picks its kernels and workspace here)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        form.run()
    ms = replay_ms(graph, reps)
    del graph
    return ms


def kernel_module_dual():
    from dark.models.decoder import kernel_module

    return kernel_module("dual")


def dual_error(layer, decode_rows: int, train_rows: int, device, dtype) -> dict:
    """The dual kernel's relative error against torch (fp32 products of the same inputs) on one layer's weights."""
    dk = kernel_module_dual()
    g = torch.Generator(device=device).manual_seed(2)
    out = {}
    for name, w in zip(("qkv", "o", "gate_up", "down"), layer):
        x = torch.randn(decode_rows, w.shape[1], device=device, generator=g).to(dtype)
        dy = torch.randn(train_rows, w.shape[0], device=device, generator=g).to(dtype)
        y, dx = dk.dual(x, dy, w)
        ry, rdx = x.float() @ w.float().t(), dy.float() @ w.float()
        out[name] = [round(((y - ry).norm() / ry.norm()).item(), 8), round(((dx - rdx).norm() / rdx.norm()).item(), 8)]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small widths and 2 layers (a check of the script)")
    ap.add_argument("--decode-rows", type=int, default=8)
    ap.add_argument("--train-rows", type=int, nargs="+", default=[32, 64, 128, 192, 256, 384, 512])
    ap.add_argument("--paired-rows", type=int, nargs="+", default=[64, 128, 192, 256])
    ap.add_argument("--chunk-mb", type=float, nargs="+", default=[8.0, 16.0])
    ap.add_argument("--dual-rows", type=int, nargs="*", default=[], help="T of the dual forms (none: no dual forms)")
    ap.add_argument("--dual-fwd", type=int, nargs="*", default=[64],
                    help="forward rows added to the decode rows in a dual form of each T (beside the plain one)")
    ap.add_argument("--dual-tilings", nargs="*", default=[],
                    help="BN,BK,warps,stages of the dual kernel tried at T=64 (and with the --dual-fwd rows) beside "
                         "its default; one the device cannot take is recorded as an error")
    ap.add_argument("--only-dual", action="store_true", help="of the other forms only fwd 8, fwd 8+64, bwd 64")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" or a.dual_rows else torch.float32  # the kernel takes 16 bits
    layers = 2 if a.tiny else LAYERS
    ws = make_weights(device, dtype, layers, a.tiny)
    weight_bytes = sum(w.numel() * w.element_size() for layer in ws for w in layer)
    d = a.decode_rows
    rows = []

    def report(err=None):
        out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "layers": layers, "weight_gb": round(weight_bytes / 1e9, 3), "rows": rows}
        if err is not None:
            out["dual_rel_err"] = err
        if a.out:  # after every form, so that a run cut short still leaves what it measured
            Path(a.out).write_text(json.dumps(out, indent=1))

    def measure(label, fwd, bwd, paired=False, chunk_mb=0.0, carried=0, dual=False, zero=True):
        try:
            form = Form(ws, fwd, bwd, paired, chunk_mb, device, dtype, dual=dual, zero=zero)
            ms = time_form(form, device, a.reps)
        except Exception as e:  # a tiling the device cannot take (shared memory, registers): say so, go on
            if not rows:
                raise
            rows.append({"form": label, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            print(json.dumps(rows[-1]), flush=True)
            return
        row = {"form": label, "fwd_rows": fwd, "bwd_rows": bwd, "ms": ms,
               "weight_tb_s": round(weight_bytes / ms / 1e9, 3), "tflop_s": round(form.flops() / ms / 1e9, 1)}
        if carried:
            row["train_rows"] = carried
        rows.append(row)
        base = rows[0]["ms"]
        row["x_decode"] = round(ms / base, 3)
        if carried:  # training rows a decode step carries, at this step time: tokens a second
            row["train_tok_s_carried"] = round(carried / ms * 1000, 1)
        print(json.dumps(row), flush=True)
        report()
        del form
        if device.type == "cuda":
            torch.cuda.empty_cache()

    measure(f"fwd {d}", d, 0)
    if a.only_dual:
        a.train_rows, a.paired_rows, a.chunk_mb = [64], [64], []
        measure(f"fwd {d}, bwd 64", d, 64, carried=64)
    for t in a.train_rows:
        measure(f"fwd {d}+{t}", d + t, 0, carried=t)
    for t in a.paired_rows:
        measure(f"fwd {d}+{t}, bwd {t}", d + t, t, carried=t)
        for c in a.chunk_mb:
            measure(f"paired {d}+{t}, {t} ({c:g} MB chunks)", d + t, t, paired=True, chunk_mb=c, carried=t)
    if a.dual_rows:
        dk = kernel_module_dual()
        measure(f"dual {d} / 0", d, 0, dual=True)
        for t in a.dual_rows:
            measure(f"dual {d} / {t}", d, t, carried=t, dual=True)
            for f in a.dual_fwd:
                measure(f"dual {d}+{f} / {t}", d + f, t, carried=t, dual=True)
        t = 64 if 64 in a.dual_rows else a.dual_rows[0]
        measure(f"dual {d} / {t}, no zeroing", d, t, carried=t, dual=True, zero=False)
        default = (dk.BN, dk.BK, dk.WARPS, dk.STAGES)
        for tiling in a.dual_tilings:
            dk.BN, dk.BK, dk.WARPS, dk.STAGES = (int(v) for v in tiling.split(","))
            measure(f"dual {d} / {t}, tiling {tiling}", d, t, carried=t, dual=True)
            for f in a.dual_fwd:
                measure(f"dual {d}+{f} / {t}, tiling {tiling}", d + f, t, carried=t, dual=True)
        dk.BN, dk.BK, dk.WARPS, dk.STAGES = default
        err = dual_error(ws[0], d, t, device, dtype)
        print(json.dumps({"dual_rel_err": err}), flush=True)
    else:
        err = None
    if not a.only_dual:
        big = 64 if a.tiny else 4096
        measure(f"fwd {big}", big, 0)
    report(err)


if __name__ == "__main__":
    sys.exit(main())
