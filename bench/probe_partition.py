"""Can decode and training share one GPU by SM partitions? Decode replays against training-sized GEMMs.

The engine's captured decode step (8 sequences, Qwen2.5-7B shapes, random bf16 weights) is replayed back to back
while a stream of bf16 GEMMs of a training step's shape (4096 x 3584 x 18944) runs beside it, in these layouts:
  full            each alone on every SM (the two baselines)
  shared-N        decode on every SM (high priority), GEMMs in torch's green context of N SMs: the engine today
  split-N         decode in a partition of N SMs, GEMMs in the disjoint partition of the rest (dark.engine.green);
                  the decode step captured again on the partition's stream (a graph's kernels run on the SMs of
                  the stream it was captured on, not of the one that replays it)
For each: decode ms a step (alone in its partition and with the GEMMs running) and GEMM TFLOP/s (alone and beside
decode). A layout is good for "decode during training" when decode beside the GEMMs is <= 1.3x its full-device time
and the GEMMs keep >= 70% of their full-device rate.

    PYTHONPATH=$PWD python3 bench/probe_partition.py --tokenizer .data/tok --out $OUT/partition.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import QWEN25_7B, prompts_ids, replay_ms, run_ours  # noqa: E402
from bench_learn_gpu import build_model  # noqa: E402

M, K, N = 4096, 3584, 18944


def gemm_loop(stream, x, ws, out, n: int, every: int = 4) -> list:
    """n GEMMs on `stream`, an event after every `every` of them (timing-enabled), the first before any."""
    events = []
    with torch.cuda.stream(stream):
        for i in range(n):
            if i % every == 0:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                events.append(e)
            torch.mm(x, ws[i % len(ws)].t(), out=out)
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        events.append(e)
    return events


def tflops(gemms: int, ms: float, m: int = M, k: int = K, n: int = N) -> float:
    """TFLOP/s of `gemms` [m, k] x [k, n] products in `ms` (default: the training step's shape)."""
    return round(2 * m * k * n * gemms / (ms / 1000) / 1e12, 1)


def gemm_alone(stream, x, ws, out, n: int = 60) -> float:
    gemm_loop(stream, x, ws, out, 4)
    ev = gemm_loop(stream, x, ws, out, n, every=n)
    ev[-1].synchronize()
    return tflops(n, ev[0].elapsed_time(ev[-1]))


def decode_alone(stream, graph, reps: int = 40) -> float:
    with torch.cuda.stream(stream):
        ms = replay_ms(graph, reps)
    stream.synchronize()
    return ms


def together(dec_stream, gemm_stream, graph, x, ws, out, reps: int = 60, every: int = 4, n_gemm: int = 400) -> dict:
    """GEMMs queued first (enough to outlast the decode replays), then the replays; GEMM rate over the replays'
    window from the GEMM events that fall inside it (TFLOP/s of x @ ws[i]^T)."""
    ev = gemm_loop(gemm_stream, x, ws, out, n_gemm, every)
    with torch.cuda.stream(dec_stream):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
    torch.cuda.synchronize()
    window = start.elapsed_time(end)
    at = [start.elapsed_time(e) for e in ev]
    inside = [t for t in at if 0 <= t <= window]
    covered = at[-1] >= window and at[0] <= 0
    rate = (tflops(every * (len(inside) - 1), inside[-1] - inside[0], *x.shape, ws[0].shape[0])
            if len(inside) > 2 else None)
    return {"decode_ms": round(window / reps, 3), "gemm_tflops": rate, "gemms_outlast_decode": covered}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=Path(".data/tok"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sms", type=int, nargs="+", default=[16, 32, 40, 48, 56, 64, 80])
    ap.add_argument("--shared", type=int, nargs="+", default=[66, 96])
    ap.add_argument("--streams", type=int, default=8)
    a = ap.parse_args()
    from dark import OnlineLLM
    from dark.engine.green import split
    from dark.learn.jobs import training_stream

    dev = torch.device("cuda")
    report: dict = {"device": torch.cuda.get_device_name(dev), "sms_total": torch.cuda.get_device_properties(dev).multi_processor_count,
                    "gemm": [M, K, N], "streams": a.streams, "layouts": {}}

    def save():
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1))

    tmp = Path(tempfile.mkdtemp(prefix="dark-partition-"))
    t = time.perf_counter()
    hf = build_model(QWEN25_7B, a.tokenizer.resolve(), tmp / "model", dev)
    del hf
    torch.cuda.empty_cache()
    llm = OnlineLLM(str(tmp / "model"), data_dir=tmp / "data", device="cuda", dtype="bfloat16", num_kv_blocks=1024,
                    max_num_seqs=a.streams, warm_learning=False)
    run_ours(llm, prompts_ids(a.streams, 128, 0), 48)
    runner = llm.engine.runner
    keys = [k for k in runner._graphs if k[0] == a.streams and not k[1]]
    graph = runner._graphs[keys[0]][0]
    report["setup_s"] = round(time.perf_counter() - t, 1)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g)
    ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(2)]
    out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)

    main_stream = torch.cuda.Stream(dev, priority=-1)
    low = torch.cuda.Stream(dev, priority=0)
    base = {"decode_ms": decode_alone(main_stream, graph), "gemm_tflops": gemm_alone(low, x, ws, out)}
    base["together_same_device"] = together(main_stream, low, graph, x, ws, out)
    report["layouts"]["full"] = base
    print(json.dumps({"full": base}), flush=True)
    save()

    def judged(row):
        t = row["together"]
        row["decode_ratio"] = round(t["decode_ms"] / base["decode_ms"], 3)
        row["gemm_ratio"] = round(t["gemm_tflops"] / base["gemm_tflops"], 3) if t["gemm_tflops"] else None
        return row

    for n in a.shared:
        try:
            _, stream = training_stream(dev, n)
            row = {"gemm_alone_tflops": gemm_alone(stream, x, ws, out),
                   "together": together(main_stream, stream, graph, x, ws, out)}
            report["layouts"][f"shared-{n}"] = judged(row)
        except Exception as e:
            report["layouts"][f"shared-{n}"] = {"error": repr(e)}
        print(json.dumps({f"shared-{n}": report["layouts"][f"shared-{n}"]}), flush=True)
        save()

    for n in a.sms:
        try:
            dec, rest = split(dev, n, priorities=(-1, 0))
            # the step captured again on the partition's stream: a graph's kernels run where it was captured
            runner.partition = dec.stream
            with torch.cuda.stream(dec.stream), torch.inference_mode():
                runner._replay(a.streams, False, keys[0][2])
            dec.stream.synchronize()
            confined = runner._graphs[keys[0] + (dec.stream.cuda_stream,)][0]
            row = {"decode_sms": dec.sms, "train_sms": rest.sms,
                   "decode_alone_ms_graph_of_every_sm": decode_alone(dec.stream, graph),
                   "decode_alone_ms": decode_alone(dec.stream, confined),
                   "gemm_alone_tflops": gemm_alone(rest.stream, x, ws, out),
                   "together": together(dec.stream, rest.stream, confined, x, ws, out)}
            report["layouts"][f"split-{n}"] = judged(row)
        except Exception as e:
            report["layouts"][f"split-{n}"] = {"error": repr(e)}
        print(json.dumps({f"split-{n}": report["layouts"][f"split-{n}"]}), flush=True)
        save()
    llm.close()


if __name__ == "__main__":
    main()
