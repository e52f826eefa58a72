"""Where the offline benchmark's decode steps spend their GPU time (Qwen2.5-7B shapes, random bf16 weights).

Three parts, in one process on the GPU:
  attention   paged_decode alone at 256 and 128 sequences of ~1,100 tokens: ms and the GB/s of keys and values
              read, for a few tile sizes and warp counts (the default first)
  steady      decode steps of B sequences (B = 256, 128, 64) whose contexts are ~1,000 tokens: GPU kernel time
              per step by kernel, against the wall time per step (CUDA graphs, steps launched ahead: as served)
  prefill     16 prompts (one output token each) under the profiler: the prefill steps' kernels
  adapter     steady steps at batch 1 (context 128) without and with one adapter, and 64 sequences without and
              over 32 adapters (rank 16 on the 7 projections)
  offline     run_all's offline run (256 requests, lengths uniform in 100..1024): the steps per graph bucket,
              how many rows each bucket padded, and the host's time per step outside the runner
  offline_split_ab  the offline run with a mixed step's decode rows in the flash batch, then through paged_decode
  offline_trace  the same run's first --trace-seconds (its prefill steps) under torch.profiler: the GPU's busy
              time by kernel against the wall time of each step; the timeline to --trace

    PYTHONPATH=$PWD python bench/profile_offline.py --tokenizer .data/tok --out /tmp/offline.json
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import QWEN25_7B, StepClock, build_folder, prompts_ids  # noqa: E402
from run_all import run_requests, warm_requests  # noqa: E402


def attention_micro(dev) -> list[dict]:
    from triton.testing import do_bench

    from dark.models.decoder import kernel_module

    kernel_module()  # dark.kernels, from the checkout
    from dark.kernels.paged_attention import default_splits, paged_decode

    out = []
    bs, kvh, d, h = 16, 4, 128, 28
    for batch, ctx in ((256, 1100), (128, 1100), (64, 1100), (32, 1100), (8, 4000), (1, 4000)):
        blocks = batch * (-(-ctx // bs))
        kc = torch.randn(blocks, bs, kvh, d, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        bt = torch.randperm(blocks, device=dev, dtype=torch.int32).view(batch, -1)
        lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
        q = torch.randn(batch, h, d, device=dev, dtype=torch.bfloat16)
        gb = 2 * batch * ctx * kvh * d * 2 / 1e9
        dflt = default_splits(batch, kvh)
        configs = [(64, 4, None, dflt)] + [(64, 4, st, sp) for st in (3, 4) for sp in (1, 2, 4, 8, 16, 32)
                                           if batch * kvh * sp <= 8192 and (sp >= dflt or batch >= 32)]
        for block_n, warps, stages, splits in configs:
            try:
                ms = do_bench(lambda: paged_decode(q, kc, vc, bt, lens, 0.088, splits=splits, block_n=block_n,
                                                   num_warps=warps, num_stages=stages), warmup=10, rep=40)
            except Exception as e:  # a tile that does not fit: say so and go on
                out.append({"batch": batch, "ctx": ctx, "stages": stages, "splits": splits, "error": repr(e)[:200]})
                continue
            out.append({"batch": batch, "ctx": ctx, "block_n": block_n, "warps": warps, "stages": stages,
                        "splits": splits, "us": round(1000 * ms, 1), "kv_gb_s": round(gb / ms * 1e3, 1)})
            print("attention", out[-1], flush=True)
        del kc, vc
    return out


def attention_graph(dev) -> list[dict]:
    """paged_decode as a decode step runs it: 28 calls back to back (one per layer) captured in a CUDA graph
    (dependent launch on, as in the engine), timed by replays; us per call. A kernel timed alone with dependent
    launch on also counts its wait for the kernel before it, which misleads at small batches."""
    from dark.models.decoder import kernel_module

    kernel_module()
    from dark.kernels.paged_attention import default_splits, paged_decode

    out = []
    bs, kvh, d, h, layers = 16, 4, 128, 28, 28
    for batch, ctx in ((8, 1100), (16, 1100), (32, 1100), (48, 1100), (64, 1100), (128, 1100), (256, 1100)):
        blocks = batch * (-(-ctx // bs))
        kc = torch.randn(blocks, bs, kvh, d, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        bt = torch.randperm(blocks, device=dev, dtype=torch.int32).view(batch, -1)
        lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
        q = torch.randn(batch, h, d, device=dev, dtype=torch.bfloat16)
        dflt = default_splits(batch, kvh)
        for stages in (None, 3):
            for splits in sorted({dflt, 1, 2, 4, 8, 16}):
                if batch * kvh * splits > 4096:
                    continue
                kw = dict(splits=splits, num_stages=stages)
                for _ in range(2):  # compile, warm
                    paged_decode(q, kc, vc, bt, lens, 0.088, **kw)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    x = q
                    for _ in range(layers):
                        x = paged_decode(x, kc, vc, bt, lens, 0.088, **kw)
                graph.replay()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(20):
                    graph.replay()
                end.record()
                end.synchronize()
                us = start.elapsed_time(end) * 1000 / 20 / layers
                out.append({"batch": batch, "ctx": ctx, "stages": stages, "splits": splits, "default": splits == dflt,
                            "us": round(us, 1)})
                print("attention_graph", out[-1], flush=True)
                del graph
        del kc, vc
    return out


def steady(llm, clock: StepClock, batch: int, ctx: int, steps: int, adapters=None) -> dict:
    """Profile `steps` decode steps of `batch` sequences once all of them decode (adapters: refs given to the
    sequences in turn; None: the base model)."""
    from torch.profiler import ProfilerActivity, profile

    from dark.engine.sequence import SamplingParams

    done = threading.Event()
    left = [batch]
    lock = threading.Lock()

    def on_output(out):
        if out.finished:
            with lock:
                left[0] -= 1
                if not left[0]:
                    done.set()

    clock.clear()
    ids = [llm.engine.add_request(p, SamplingParams(max_tokens=4 * steps + 200, ignore_eos=True),
                                  adapters[i % len(adapters)] if adapters else None, on_output)
           for i, p in enumerate(prompts_ids(batch, ctx, 31 + batch))]
    while not (len(clock.seqs) >= 3 and all(q == batch for q in clock.seqs[-3:])
               and all(n == batch for _, _, n in clock.steps[-3:])):
        time.sleep(0.01)
    try:
        from torch._C._profiler import _ExperimentalConfig

        kw = {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except (ImportError, TypeError):
        kw = {}
    with profile(activities=[ProfilerActivity.CUDA], **kw) as prof:
        first = len(clock.steps)
        while len(clock.steps) < first + steps:
            time.sleep(0.002)
        last = len(clock.steps)
    n = last - first
    wall = (clock.steps[last - 1][1] - clock.steps[first - 1][1]) / n
    for i in ids:
        llm.engine.abort(i)
    done.wait(60)
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events) / 1000 / n
    groups = collections.Counter()
    for e in events:
        k = e.key.lower()
        g = ("lora" if any(s in k for s in ("lora", "shrink", "expand", "segments")) else
             "attention" if "paged_decode" in k or "merge" in k else
             "matmul" if any(s in k for s in ("gemm", "nvjet", "cutlass", "gemv", "sm90", "xmma")) else
             "norm/rope/kv" if any(s in k for s in ("norm", "rotary", "store")) else "other")
        groups[g] += e.device_time_total / 1000 / n
    top = sorted(events, key=lambda e: -e.device_time_total)[:24]
    r = {"batch": batch, "ctx": ctx, "steps": n, "adapters": len(set(adapters or [])), "wall_ms_per_step": round(1000 * wall, 3),
         "gpu_ms_per_step": round(total, 3), "by_group_ms": {k: round(v, 3) for k, v in groups.items()},
         "top_ms_per_step": [(e.key[:80], round(e.count / n, 1), round(e.device_time_total / 1000 / n, 4)) for e in top]}
    print("steady", json.dumps(r), flush=True)
    return r


def adapter_variants(llm, clock: StepClock) -> list[dict]:
    """Batch 1 with one adapter under other tilings of the kernels that carry its delta (module knobs of
    dark.kernels.gemv / norm_rope, graphs captured anew for each): ms a step against the defaults."""
    from dark.models.decoder import kernel_module

    gemv, norm = kernel_module("gemv"), kernel_module("norm_rope")
    defaults = (gemv.GLU_LORA_BLOCK_N, norm.CODES_PER_PROGRAM, norm.CODES_WARPS)
    out = []
    for glu_bn, cpb, warps in [defaults, (4, 4, 8), (8, 4, 8), (None, 4, 4), (None, 8, 8), (None, 2, 4), defaults]:
        gemv.GLU_LORA_BLOCK_N, norm.CODES_PER_PROGRAM, norm.CODES_WARPS = glu_bn, cpb, warps
        llm.engine.runner.set_fast(True)
        r = steady(llm, clock, 1, 128, 60, [("a0", 1)])
        out.append({"glu_lora_block_n": glu_bn, "codes_per_program": cpb, "codes_warps": warps,
                    "wall_ms_per_step": r["wall_ms_per_step"]})
        print("variant", json.dumps(out[-1]), flush=True)
    gemv.GLU_LORA_BLOCK_N, norm.CODES_PER_PROGRAM, norm.CODES_WARPS = defaults
    llm.engine.runner.set_fast(True)
    return out


def offline(llm, clock: StepClock, n: int, salt: int = 0, seed: int = 0) -> dict:
    """salt: another run's prompts of the same lengths (a run after one with salt 0 finds none of its prefixes in
    the cache); seed: other lengths (0: run_all's)."""
    from dark.engine.runner import GRAPH_BUCKETS

    runner = llm.engine.runner
    rng = random.Random(seed)
    reqs = [(prompts_ids(1, rng.randint(100, 1024), 1000 + i + salt)[0], rng.randint(100, 1024), None)
            for i in range(n)]
    run_requests(llm, warm_requests(n, 5000))
    clock.clear()
    before = (runner.ahead_launched, runner.ahead_used, runner.ahead_narrowed)
    secs, produced = run_requests(llm, reqs)
    after = (runner.ahead_launched, runner.ahead_used, runner.ahead_narrowed)
    buckets = collections.Counter()
    padded = collections.Counter()
    dur = collections.defaultdict(float)
    for (s, e, tok), q in zip(clock.steps, clock.seqs):
        if tok != q:
            continue
        b = next(g for g in GRAPH_BUCKETS if g >= q)
        buckets[b] += 1
        padded[b] += b - q
        dur[b] += e - s
    gaps = [b[0] - a[1] for a, b in zip(clock.steps, clock.steps[1:])]
    r = {"tok_s": round(produced / secs, 1), "seconds": round(secs, 2), "summary": clock.summary(),
         "ahead": dict(zip(("launched", "used", "narrowed"), (y - x for x, y in zip(before, after)))),
         "host_between_steps_s": round(sum(gaps), 3),
         "host_between_steps_p50_ms": round(1000 * sorted(gaps)[len(gaps) // 2], 3),
         "buckets": {b: {"steps": buckets[b], "padded_rows_mean": round(padded[b] / buckets[b], 1),
                         "ms_mean": round(1000 * dur[b] / buckets[b], 2)} for b in sorted(buckets)}}
    print("offline", json.dumps(r), flush=True)
    return r


def offline_trace(llm, clock: StepClock, n: int, seconds: float, trace: Path | None) -> dict:
    """run_all's offline requests, the first `seconds` profiled: per prefill step (a step with prompt chunks) its
    wall time and the GPU kernel time inside it, and the kernels of those steps by name."""
    import bisect

    from torch.profiler import ProfilerActivity, profile, record_function

    rng = random.Random(0)
    reqs = [(prompts_ids(1, rng.randint(100, 1024), 1000 + i)[0], rng.randint(100, 1024), None) for i in range(n)]
    run_requests(llm, warm_requests(n, 5000))
    clock.clear()
    th = threading.Thread(target=run_requests, args=(llm, reqs), daemon=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("dark_t0"):  # the profiler's clock at perf_counter's t0
            t0 = time.perf_counter()
        th.start()
        time.sleep(seconds)
    th.join()
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    events = prof.events()
    base = next(e.time_range.start for e in events if e.name == "dark_t0") / 1e6
    kernels = sorted(((e.time_range.start / 1e6 - base, e.time_range.end / 1e6 - base, e.name)
                      for e in events if e.device_type.name == "CUDA"))
    starts = [k[0] for k in kernels]
    steps = [(s - t0, e - t0, tok, q) for (s, e, tok), q in zip(clock.steps, clock.seqs) if s - t0 < seconds]
    rows, by_name = [], collections.Counter()
    for s, e, tok, q in steps:
        busy = 0.0
        for ks, ke, name in kernels[bisect.bisect_left(starts, s - 0.05):bisect.bisect_left(starts, e)]:
            if ke > s:
                busy += min(ke, e) - max(ks, s)
                if tok != q:
                    by_name[name[:90]] += (min(ke, e) - max(ks, s)) * 1000
        rows.append({"t_ms": round(1000 * s, 1), "wall_ms": round(1000 * (e - s), 2), "gpu_ms": round(1000 * busy, 2),
                     "tokens": tok, "seqs": q})
    pre = [r for r in rows if r["tokens"] != r["seqs"]]
    r = {"steps": rows[:60], "prefill_steps": len(pre), "prefill_wall_ms": round(sum(x["wall_ms"] for x in pre), 1),
         "prefill_gpu_ms": round(sum(x["gpu_ms"] for x in pre), 1),
         "prefill_kernels_ms": [[k, round(v, 2)] for k, v in by_name.most_common(40)]}
    print("offline_trace", json.dumps({k: v for k, v in r.items() if k != "steps"}), flush=True)
    return r


def offline_engine(tokenizer: Path, requests: int, prefix: str, adapter_slots: int = 34):
    """(OnlineLLM, StepClock, its folder): the engine as run_all's offline part sets it up (Qwen2.5-7B shapes, random bf16
    weights in a fresh folder under /dev/shm), KV blocks for `requests` sequences of up to 2k tokens."""
    from dark import OnlineLLM

    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir="/dev/shm"))
    build_folder(QWEN25_7B, tokenizer.resolve(), tmp / "model", torch.device("cuda"))
    llm = OnlineLLM(str(tmp / "model"), data_dir=tmp / "data", device="cuda", dtype="bfloat16",
                    num_kv_blocks=(requests * 2 * 1024) // 16 + 1024, max_num_seqs=requests,
                    max_num_batched_tokens=8192, max_adapter_slots=adapter_slots, max_lora_rank=16)
    return llm, StepClock(llm.engine.runner), tmp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=Path(".data/tok"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--parts", nargs="+", default=["attention", "steady", "offline"])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--trace-seconds", type=float, default=4.0)
    ap.add_argument("--trace", type=Path)
    a = ap.parse_args()
    dev = torch.device("cuda")
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__}
    try:
        if "attention" in a.parts:
            report["attention"] = attention_micro(dev)
        if "attention_graph" in a.parts:
            report["attention_graph"] = attention_graph(dev)
        if not {"steady", "offline", "offline_split_ab", "offline_trace", "prefill", "adapter"} & set(a.parts):
            return
        llm, clock, tmp = offline_engine(a.tokenizer, a.requests, "dark-offline-")
        try:
            if "offline" in a.parts:
                report["offline"] = offline(llm, clock, a.requests)
            if "offline_split_ab" in a.parts:  # mixed steps' decode rows through flash, then the default again
                import dark.engine.attention as attention

                report["offline_split_ab"] = {}
                runs = (("decode rows through paged_decode", True), ("decode rows through flash", False),
                        ("decode rows through paged_decode again", True), ("decode rows through flash again", False))
                for i, (label, on) in enumerate(runs):
                    attention.SPLIT_DECODE_ROWS = on
                    report["offline_split_ab"][label] = offline(llm, clock, a.requests, salt=10_000 * (i + 1))
                attention.SPLIT_DECODE_ROWS = True
            if "offline_trace" in a.parts:
                clock.clear()
                report["offline_trace"] = offline_trace(llm, clock, a.requests, a.trace_seconds, a.trace)
            clock.clear()
            if "prefill" in a.parts:  # 16 prompts of 100..1024 tokens, one output token each: prefill steps alone
                from profile_prefill import profiled_prefill

                rng = random.Random(1)
                prof = profiled_prefill(llm, [(prompts_ids(1, rng.randint(100, 1024), 77_000 + i)[0], 1, None)
                                              for i in range(16)])
                prof["steps"] = clock.summary()
                report["prefill"] = prof
                print("prefill", json.dumps(prof), flush=True)
            if "steady" in a.parts:
                report["steady"] = [steady(llm, clock, b, 1000, 30) for b in (256, 128, 64)]
            if "adapter" in a.parts:  # batch 1 with and without one adapter; 64 sequences over 32 adapters and none
                from bench_decode import random_adapter

                for i in range(32):
                    llm.engine.adapters.publish(f"a{i}", 1, random_adapter(llm, 16, seed=100 + i))
                report["adapter"] = [steady(llm, clock, 1, 128, 60), steady(llm, clock, 1, 128, 60, [("a0", 1)])]
                os.environ["DARK_NORM_CODES"] = "0"  # A/B: the codes from lora_shrink launches (graphs captured anew)
                llm.engine.runner.set_fast(True)
                report["adapter"].append({**steady(llm, clock, 1, 128, 60, [("a0", 1)]), "norm_codes": False})
                del os.environ["DARK_NORM_CODES"]
                llm.engine.runner.set_fast(True)
                report["adapter_variants"] = adapter_variants(llm, clock)
                report["adapter"] += [steady(llm, clock, 64, 128, 30),
                                      steady(llm, clock, 64, 128, 30, [(f"a{i}", 1) for i in range(32)])]
        finally:
            llm.close()
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
