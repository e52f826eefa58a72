"""The LoRA work of one decode step of 64 sequences over 32 adapters, alone and beside the base GEMMs, on the GPU
(Qwen2.5-7B shapes, rank 16 on all 7 projections: q/k/v and gate/up as fused groups, as the engine runs them).

Every projection of all 28 layers is captured in one CUDA graph under dependent launch, as the engine's decode
step is, and the graph is replayed back to back (CUDA events). Modes:

- `lora`: only the shrink + expand pairs (the factors read: 32 x 81 MB = 2.6 GB a step);
- `gemm`: only the base projections' GEMMs (15 GB of weights a step);
- `serial`: each GEMM then its pair, as the engine does it;
- `side`: each projection's shrink on a second stream, beside its GEMM; the expand after both;
- `ext`: one GEMM over the weight with every slot's A rows after its own (the base output and every slot's codes
  side by side), then lora_expand_codes adds each token's own slot's delta (`ext_gemm`: that GEMM alone);
- `side_delta`: shrink and expand on the second stream into a zeroed delta buffer, beside the GEMM; then y += delta
  (`side_delta_no_add`: without that add, the bound for a consumer kernel that adds the delta as it reads y).

`--variants NAME=module.ATTR=V,...` sets knobs of dark.kernels.<module> (e.g. `lora.EXPAND_WARPS=8`) for
another set of graphs in the same process. Each mode's kernels are also summed by name under the profiler.

    PYTHONPATH=$PWD python bench/bench_lora_multi.py --out /tmp/lora_multi.json
"""
from __future__ import annotations

import argparse
import ast
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import replay_ms  # noqa: E402
from profile_adapter_step import kernels_of  # noqa: E402

# (group, fan-in, member outs): the engine's fused groups (dark.lora.slots.GROUPS) and the lone projections
PROJECTIONS = [("qkv", 3584, [3584, 512, 512]), ("o", 3584, [3584]), ("gate_up", 3584, [18944, 18944]),
               ("down", 18944, [3584])]


def build(layers: int, slots: int, rank: int, tokens: int, adapters: int, with_gemm: bool, dev, slot_rank: int = 0):
    """slot_rank: rows a member has in a slot (the engine's max_lora_rank; rows past rank are zeros)."""
    slot_rank = slot_rank or rank
    g = torch.Generator(device=dev).manual_seed(0)
    bf = dict(dtype=torch.bfloat16, device=dev)
    lay = []
    for _ in range(layers):
        per = []
        for name, k, outs in PROJECTIONS:
            n = sum(outs)
            A = torch.zeros(slots, len(outs), slot_rank, k, device=dev, dtype=torch.bfloat16)
            A[:, :, :rank] = (torch.randn(slots, len(outs), rank, k, generator=g, device=dev) * 0.02).to(torch.bfloat16)
            A = A.view(slots, len(outs) * slot_rank, k)
            B = torch.zeros(slots, slot_rank, n, device=dev, dtype=torch.bfloat16)
            B[:, :rank] = (torch.randn(slots, rank, n, generator=g, device=dev) * 0.02).to(torch.bfloat16)
            W = (torch.randn(n, k, generator=g, device=dev) * 0.02).to(torch.bfloat16) if with_gemm else None
            per.append((name, A, B, W, outs))
        lay.append(per)
    xs = {name: torch.randn(tokens, k, generator=g, device=dev).to(torch.bfloat16) for name, k, _ in PROJECTIONS}
    ys = {name: torch.zeros(tokens, sum(outs), **bf) for name, _, outs in PROJECTIONS}
    token_slots = (torch.arange(tokens, device=dev) % adapters).to(torch.int32)
    return lay, xs, ys, token_slots


def factor_bytes(rank: int, adapters: int, layers: int) -> int:
    return layers * adapters * sum((len(outs) * rank * k + rank * sum(outs)) * 2 for _, k, outs in PROJECTIONS)


def weight_bytes(layers: int) -> int:
    return layers * sum(k * sum(outs) * 2 for _, k, outs in PROJECTIONS)


def beside(side, fn):
    """fn() on the stream `side`, after this stream's work so far: (its result, an event recorded after it)."""
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = fn()
        done = torch.cuda.Event()
        done.record()
    return out, done


def step_fn(mode: str, lay, xs, ys, token_slots, slots: int, rank: int, lk, side, ext=None, yext=None,
            slot_rank: int = 0):
    slot_rank = slot_rank or rank
    def step():
        seg = lk.lora_segments(token_slots, slots)
        for per in lay:
            for name, A, B, W, outs in per:
                x, y = xs[name], ys[name]
                kw = dict(splits=outs if len(outs) > 1 else None, stride=slot_rank)
                if mode in ("gemm", "serial"):
                    torch.matmul(x, W.t(), out=y)
                if mode in ("lora", "serial"):
                    lk.lora_apply(x, y, A, B, token_slots, rank, segments=seg, fused=False, **kw)
                elif mode == "side":  # the shrink beside the GEMM, the expand after both
                    h, done = beside(side, lambda: lk.lora_shrink(x, A, token_slots, rank, members=len(outs),
                                                                  stride=slot_rank, segments=seg))
                    torch.matmul(x, W.t(), out=y)
                    torch.cuda.current_stream().wait_event(done)
                    lk.lora_expand(h, B, token_slots, y, rank, splits=kw["splits"], segments=seg)
                elif mode in ("ext", "ext_gemm"):  # one GEMM over [W; every slot's A], then the expand
                    n = sum(outs)
                    ye = yext[name]
                    torch.matmul(x, ext[id(W)].t(), out=ye)
                    if mode == "ext":
                        lk.lora_expand_codes(ye[:, n:], B, token_slots, ye[:, :n], rank, slot_rank, splits=kw["splits"],
                                             segments=seg)
                elif mode in ("side_delta", "side_delta_no_add"):  # the pair beside it, into a delta buffer
                    def pair():
                        d = torch.zeros_like(y)
                        h = lk.lora_shrink(x, A, token_slots, rank, members=len(outs), stride=slot_rank,
                                           segments=seg)
                        return lk.lora_expand(h, B, token_slots, d, rank, splits=kw["splits"], segments=seg)
                    d, done = beside(side, pair)
                    torch.matmul(x, W.t(), out=y)
                    torch.cuda.current_stream().wait_event(done)
                    if mode == "side_delta":
                        y.add_(d)
    return step


def capture(step, dev):
    from dark import kernels

    with kernels.dependent_launch():
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            step()  # compile and warm up outside the capture
            step()
        torch.cuda.current_stream(dev).wait_stream(s)
        torch.cuda.synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    torch.cuda.synchronize(dev)
    return graph


def kernel_sums(graph, reps: int = 5) -> list[dict]:
    """GPU time by kernel name and grid over one replay (own durations; under dependent launch they overlap)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        kernels = kernels_of(path)
    own = collections.defaultdict(float)
    count = collections.Counter()
    for k in kernels:
        label = f"{k['name'][:48]} [{k['grid']}]"
        own[label] += k["dur"] / reps
        count[label] += 1
    return [{"label": k, "a_step": count[k] / reps, "own_us": round(v, 1)} for k, v in sorted(own.items(), key=lambda kv: -kv[1])][:24]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--slot-rank", type=int, default=0, help="rows a member has in a slot (max_lora_rank); 0: --rank")
    ap.add_argument("--slots", type=int, default=0, help="adapter slots (0: --adapters + 1)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--modes", nargs="+", default=["lora", "gemm", "serial", "side", "side_delta", "side_delta_no_add"])
    ap.add_argument("--variants", nargs="*", default=[])
    ap.add_argument("--profile", action="store_true", help="kernel sums for every mode and variant")
    a = ap.parse_args()
    from dark.models.decoder import kernel_module

    dev = torch.device("cuda")
    lk = kernel_module("lora")
    slots = a.slots or a.adapters + 1
    a.slot_rank = a.slot_rank or a.rank
    need_gemm = any(m != "lora" for m in a.modes)
    lay, xs, ys, token_slots = build(a.layers, slots, a.rank, a.tokens, a.adapters, need_gemm, dev,
                                     a.slot_rank)
    side = torch.cuda.Stream(dev)
    ext, yext = {}, {}
    if any(m.startswith("ext") for m in a.modes):
        for per in lay:
            for name, A, B, W, outs in per:
                ext[id(W)] = torch.cat([W, A.reshape(-1, A.shape[-1])])
        for name, k, outs in PROJECTIONS:
            yext[name] = torch.zeros(a.tokens, sum(outs) + slots * len(outs) * a.slot_rank, dtype=torch.bfloat16,
                                     device=dev)
    fb, wb = factor_bytes(a.rank, a.adapters, a.layers), weight_bytes(a.layers)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "tokens": a.tokens, "adapters": a.adapters, "rank": a.rank,
              "slots": slots, "slot_rank": a.slot_rank,
              "layers": a.layers, "factor_gb": round(fb / 1e9, 3), "weight_gb": round(wb / 1e9, 3), "runs": {}}
    specs = [("default", [])] + [(s.partition("=")[0], [p.split("=", 1) for p in s.partition("=")[2].split(",") if p])
                                 for s in a.variants]
    try:
        for name, pairs in specs:
            knobs = [(kernel_module(k.split(".")[0]), k.split(".")[1], ast.literal_eval(v)) for k, v in pairs]
            old = [(m, attr, getattr(m, attr)) for m, attr, _ in knobs]
            for m, attr, v in knobs:
                setattr(m, attr, v)
            try:
                run = {}
                for mode in a.modes:
                    graph = capture(step_fn(mode, lay, xs, ys, token_slots, slots, a.rank, lk, side, ext, yext, a.slot_rank),
                                    dev)
                    ms = min(replay_ms(graph, a.reps) for _ in range(3))
                    moved = {"lora": fb, "gemm": wb, "ext_gemm": wb + fb // 2}.get(mode, fb + wb)
                    run[mode] = {"ms": round(ms, 3), "tb_s": round(moved / ms / 1e9, 2)}
                    if a.profile:
                        run[mode]["kernels"] = kernel_sums(graph)
                    del graph
                report["runs"][name] = run
                print(name, json.dumps({m: v for m, v in run.items()}, default=str)[:600], flush=True)
            finally:
                for m, attr, v in old:
                    setattr(m, attr, v)
    finally:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
